"""Inference grid: validity filter, memory check, config ids and model-aware setting checks (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.errors import ConfigError
from hp_tool.inference.grid import (InferenceJobConfig, dump_job_config, kv_cache_bytes, load_job_config,
                                    make_config_id)
from hp_tool.inference.search import plan_inference
from hp_tool.contracts.spec import ModelSpec

IS = "search_config.inference_settings"


def tiny_app(tmp_path, *overrides):
    cfg, _ = compose(["search_config=gpt3/tiny", "cluster=local", f"base_results_dir={tmp_path}",
                      *overrides])
    return to_app_config(cfg)


def test_config_id():
    assert make_config_id("gpt3", "241k", 2, 1, 4) == "gpt3_241k_tp2_pp1_bs4"


def test_tiny_grid_is_all_valid(tmp_path):
    plan = plan_inference(tiny_app(tmp_path), tmp_path)
    assert [c.config_id for c in plan.candidates] == [
        f"gpt3_241k_tp{tp}_pp1_bs{bs}" for tp in (1, 2) for bs in (1, 2, 4)]
    assert all(c.status == "valid" and c.memory_gib > 0 for c in plan.candidates)
    cfg = plan.configs["gpt3_241k_tp2_pp1_bs4"]
    assert (cfg.tp, cfg.pp, cfg.batch_size, cfg.input_seq_len, cfg.output_seq_len) == (2, 1, 4, 16, 8)
    assert cfg.output_dir == str(tmp_path / "inference" / "gpt3_241k_tp2_pp1_bs4")


def test_invalid_layouts_keep_their_reason(tmp_path):
    plan = plan_inference(tiny_app(tmp_path, f"{IS}.tensor_parallel_sizes=[1,3]",
                                   f"{IS}.pipeline_parallel_sizes=[1,2]", f"{IS}.max_batch_sizes=[1]"),
                          tmp_path)
    verdicts = {(c.tp, c.pp): (c.status, c.reason) for c in plan.candidates}
    assert verdicts[(1, 1)] == ("valid", None)
    assert verdicts[(1, 2)] == ("valid", None)
    assert verdicts[(3, 1)][0] == "invalid" and "does not divide the 4 heads" in verdicts[(3, 1)][1]
    assert set(plan.configs) == {"gpt3_241k_tp1_pp1_bs1", "gpt3_241k_tp1_pp2_bs1"}


def test_layout_larger_than_a_node_is_invalid(tmp_path):
    plan = plan_inference(tiny_app(tmp_path, f"{IS}.tensor_parallel_sizes=[1,2]",
                                   f"{IS}.pipeline_parallel_sizes=[2]", f"{IS}.max_batch_sizes=[1]"), tmp_path)
    bad = [c for c in plan.candidates if c.tp == 2]
    assert bad[0].status == "invalid" and "exceeds the 2 GPUs of one node" in bad[0].reason


@pytest.mark.parametrize("override, key, words", [
    (f"{IS}.tensor_parallel_sizes=[3]", f"{IS}.tensor_parallel_sizes", "TP=3 does not divide the 4"),
    (f"{IS}.pipeline_parallel_sizes=[3]", f"{IS}.pipeline_parallel_sizes", "PP=3 does not divide the 4"),
    (f"{IS}.output_seq_len=200", f"{IS}.output_seq_len", "exceeds the model's 128 positions"),
    (f"{IS}.max_batch_sizes=[100000]", f"{IS}.max_batch_sizes", "no layout fits in GPU memory"),
])
def test_bad_settings_name_key_value_and_fix(tmp_path, override, key, words):
    with pytest.raises(ConfigError) as err:
        plan_inference(tiny_app(tmp_path, override), tmp_path)
    assert err.value.key == key and words in str(err.value) and "Fix:" in str(err.value)
    assert not (tmp_path / "inference").exists()


def test_schema_checks_reach_the_user():
    for override in (f"{IS}.max_batch_sizes=[]", f"{IS}.end_id=512", f"{IS}.tensor_parallel_sizes=[0]"):
        cfg, _ = compose(["search_config=gpt3/tiny", override])
        with pytest.raises(ConfigError, match="search_config.inference_settings"):
            to_app_config(cfg)


def test_memory_check_rejects_with_reason(tmp_path):
    app = tiny_app(tmp_path, "gpu.memory_gib=0.503", f"{IS}.max_batch_sizes=[1,64]")
    by_id = {c.config_id: c for c in plan_inference(app, tmp_path).candidates}
    assert by_id["gpt3_241k_tp1_pp1_bs1"].status == "valid"
    big = by_id["gpt3_241k_tp1_pp1_bs64"]
    assert big.status == "over_memory" and "more than the 0.503 GiB available" in big.reason


def test_kv_cache_formula():
    app_shape = ModelSpec("gpt3", 4, 64, 4, 4, 256, 512, 128).shape()
    # 2 (k, v) x 2 layers x batch 3 x 24 tokens x 4 heads x 16 dims x 4 bytes / TP 2
    assert kv_cache_bytes(app_shape, 2, 2, 3, 24, 4) == 2 * 2 * 3 * 24 * 4 * 16 * 4 / 2


def test_job_config_round_trip(tmp_path):
    cfg = InferenceJobConfig("x", ModelSpec("gpt3", 4, 64, 4, 4, 256, 512, 128), 2, 1, 4, 16, 8, 0, 0,
                             str(tmp_path / "out"))
    assert load_job_config(dump_job_config(cfg, tmp_path / "x.yaml")) == cfg


@pytest.mark.e2e
def test_planning_imports_no_torch():
    code = ("import sys; import hp_tool.inference.grid, hp_tool.inference.search, hp_tool.inference.report; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_layout_that_fits_carries_its_predicted_serving_time(tmp_path):
    """GPT-3 5B on an 80 GB A100 (the preset's): TP 2 holds half the weights per GPU and, at one request per step,
    gives less output per GPU than TP 1; a larger batch raises the throughput per GPU and the time per output token.
    The plan.csv columns carry the figures."""
    cfg, _ = compose(["search_config=gpt3/5b", "cluster=local", f"base_results_dir={tmp_path}",
                      f"{IS}.max_batch_sizes=[1,4]", f"{IS}.tensor_parallel_sizes=[1,2]"])
    plan = plan_inference(to_app_config(cfg), tmp_path)
    t = {(c.tp, c.batch_size): c.predicted for c in plan.candidates}
    assert t[(2, 1)].weights_gib == pytest.approx(t[(1, 1)].weights_gib / 2)
    assert t[(2, 1)].tokens_per_s_per_gpu < t[(1, 1)].tokens_per_s_per_gpu
    assert t[(1, 4)].tokens_per_s_per_gpu > t[(1, 1)].tokens_per_s_per_gpu and t[(1, 4)].tpot_s >= t[(1, 1)].tpot_s
    from hp_tool.inference.search import PREDICTED_COLUMNS, plan_csv_text

    header, *rows = plan_csv_text(plan).splitlines()
    assert all(c in header.split(",") for c in PREDICTED_COLUMNS) and all(",," not in r.split(",valid")[0] for r in rows)


def test_slo_limits_prune_on_the_prediction_naming_the_key(tmp_path):
    """max_tpot_ms between the layouts' predictions: the slower ones are over_slo with their number, the rest run;
    below every prediction: a ConfigError naming the key before anything is written."""
    base = ["gpu=h100_80gb", "search_config.train_settings.gpus_per_node=8", f"{IS}.max_batch_sizes=[1,4]"]
    plan = plan_inference(tiny_app(tmp_path, *base), tmp_path)
    tpots = sorted(1e3 * c.predicted.tpot_s for c in plan.candidates)
    limit = (tpots[0] + tpots[-1]) / 2
    pruned = plan_inference(tiny_app(tmp_path, *base, f"{IS}.max_tpot_ms={limit}"), tmp_path)
    over = [c for c in pruned.candidates if c.status == "over_slo"]
    assert over and all(1e3 * c.predicted.tpot_s > limit and "max_tpot_ms" in c.reason for c in over)
    assert set(pruned.configs) == {c.config_id for c in pruned.candidates if 1e3 * c.predicted.tpot_s <= limit}
    with pytest.raises(ConfigError) as err:
        plan_inference(tiny_app(tmp_path, *base, f"{IS}.max_tpot_ms={tpots[0] / 2}"), tmp_path)
    assert err.value.key == f"{IS}.max_tpot_ms" and "Fix:" in str(err.value)
    assert not (tmp_path / "inference").exists()
