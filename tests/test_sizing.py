"""Model size from a budget and days to train, against published check values (NeMo auto-configurator)."""

import pytest

from hp_tool.architectures import count_parameters, model_flops_per_step
from hp_tool.families.gpt3 import gpt3_shape, gpt_parameters
from hp_tool.base_config import schedule
from hp_tool.sizing import days_to_train, format_days, recommend_model_size_b, size_label


def test_recommended_size():
    assert recommend_model_size_b("gpt3", 10, 256, 140, 300) == 12.9
    assert recommend_model_size_b("gpt3", 5, 160, 140, 300) == 4.03
    assert recommend_model_size_b("mt5", 10, 256, 140, 300) == pytest.approx(0.87 * 12.9, abs=0.01)


def test_days_to_train():
    assert days_to_train("gpt3", 175, 1024, 140, 300) == pytest.approx(33.9, abs=0.01)
    assert days_to_train("mt5", 175, 1024, 140, 300) == pytest.approx(1.15 * 33.91, abs=0.02)


@pytest.mark.parametrize("size, layers, hidden", [
    (0.126, 12, 768), (5, 24, 4096), (20, 44, 6144), (43, 52, 8192), (175, 96, 12288),
])
def test_gpt3_layer_search(size, layers, hidden):
    shape, _ = gpt3_shape(size, 51200, 2048)
    assert (shape.num_layers, shape.hidden_size) == (layers, hidden)
    assert shape.ffn_hidden_size == 4 * hidden


def test_parameter_counts():
    assert gpt_parameters(24, 4096, 51200, 2048) / 1e9 == pytest.approx(5.05, abs=0.005)
    assert gpt_parameters(96, 12288, 51200, 2048) / 1e9 == pytest.approx(174.6, abs=0.05)
    shape, _ = gpt3_shape(5, 51200, 2048)
    # the per-module count (separate biases and norms) agrees with the closed form to 0.001%
    assert count_parameters(shape) == pytest.approx(gpt_parameters(24, 4096, 51200, 2048), rel=1e-5)


def test_gpt_flops_match_narayanan():
    shape, _ = gpt3_shape(175, 51200, 2048)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert model_flops_per_step(shape, B) == pytest.approx(expected, rel=1e-12)


def test_schedule_check_values():
    assert schedule("gpt3", 300, 2048, 2048) == (71525, 107, 11873)
    steps, warmup, _ = schedule("gpt3", 300, 2048, 256)
    assert (steps, warmup) == (572204, 858)


def test_labels():
    assert [size_label(x) for x in (5e9, 12.9e9, 0.126e9, 241_000)] == ["5b", "12.9b", "126m", "241k"]
    assert format_days(33.91) == "33.9 days"
    assert format_days(0.5) == "12 hours"
