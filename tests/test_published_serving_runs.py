"""The published serving scorecard (benchmarks/published_serving_runs.py): rows become the serving model's questions
(model shape, GPU, weight and KV formats, requests in flight, measured figures) or are listed with the kind of
reason they cannot be asked; the rank and pick helpers; the fit's linear reading of the model agrees with the model;
the script runs on the data and prints its targets."""

from __future__ import annotations

import importlib.util
import re
import statistics
import sys
from pathlib import Path

import pytest

from hp_tool.estimate.serving import ServingEfficiency, max_concurrency
from hp_tool.families.shape import Shape
from hp_tool.hf_config import load_hf_model

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("published_serving_runs", REPO / "benchmarks/published_serving_runs.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclasses resolve their annotations through the module
spec.loader.exec_module(bench)

pytestmark = pytest.mark.skipif(not bench.DATA.is_file(), reason=f"{bench.DATA} is not in this checkout")


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in bench.load_rows()}


@pytest.fixture(scope="module")
def card(rows):
    """Every row scored once: reads the shipped configs (transformers, once per session's cache) before the tests."""
    return bench.score(list(rows.values()))


def case(rows, row_id):
    return bench.express(rows[row_id])


@pytest.fixture(autouse=True)
def _configs_read(card):
    """The tests time their own work, not the first read of a shipped config."""


def test_fastertransformer_gpt_row_is_its_stated_architecture_at_a_fixed_batch(rows):
    c = case(rows, "ft-530b-tp16pp1-b1-i20-o8")
    assert c.shape == Shape("gpt3", 105, 128 * 160, 128, 128, 4 * 128 * 160, 51200, 2048)
    assert (c.gpu_name, c.layout.weights, c.layout.kv_cache) == ("a100_80gb", "fp16", "fp16")
    assert (c.layout.tp, c.layout.pp, c.layout.concurrency, c.layout.input_len, c.layout.output_len) == \
        (16, 1, 1, 20, 8)
    assert c.engine == "FasterTransformer"
    assert c.measured == {"throughput": 0.88, "latency": 565.0}
    assert not c.fit_weight["throughput"] and c.fit_weight["latency"]  # one measurement counts once in the fit


def test_gptj_fp8_build_is_the_config_shape_with_an_fp8_kv_cache(rows):
    c = case(rows, "trt09-thr-h200-gpt-j6b-tp1-b1024-i128-o128")
    s = c.shape
    assert (c.model, s.family, s.num_layers, s.hidden_size, s.num_attention_heads, s.ffn_hidden_size,
            s.vocab_size) == ("gptj_6b", "gpt3", 28, 4096, 16, 16384, 50400)
    assert (c.gpu_name, c.layout.weights, c.layout.kv_cache, c.layout.concurrency) == ("h200", "fp8", "fp8", 1024)
    assert c.gpu.peak("fp8") == 1979 and c.gpu.memory_bandwidth_gbps == 4800
    assert c.measured == {"throughput": 27304.0}  # stated per GPU


def test_lmdeploy_row_reads_throughput_itl_and_ttft(rows):
    c = case(rows, "lmd010-static-llama2-7b-tp1-b1-i1-o128")
    assert c.shape == load_hf_model("llama2_7b").shape(129)
    assert (c.gpu_name, c.layout.weights, c.layout.kv_cache, c.layout.concurrency) == ("a100_80gb", "fp16", "fp16", 1)
    assert c.engine == "LMDeploy"
    assert c.measured == {"throughput": 100.02, "tpot": 9.0, "ttft": 11.0}  # ITL p50 as TPOT, FTL mean as TTFT


def test_mixtral_on_l40s_is_the_shipped_moe_config(rows):
    c = case(rows, "trt09-thr-l40s-mixtral8x7b-tp4-b256-i128-o128")
    assert c.model == "mixtral_8x7b" and c.shape.num_experts == 8 and c.shape.top_k == 2
    assert (c.gpu_name, c.layout.tp, c.layout.concurrency, c.layout.weights, c.layout.kv_cache) == \
        ("l40s", 4, 256, "fp8", "fp8")


def test_offline_run_without_a_batch_holds_what_the_kv_cache_does_and_per_system_is_divided(rows):
    row = rows["trt1x-llama3370b-h100-tp2pp1-fp8-i128-o128"]
    c = bench.express(row)
    s = c.shape
    assert (c.model, s.num_layers, s.hidden_size, s.num_attention_heads, s.num_kv_heads, s.ffn_hidden_size,
            s.vocab_size) == ("llama3_70b", 80, 8192, 64, 8, 28672, 128256)
    assert (c.gpu_name, c.layout.weights, c.layout.kv_cache, c.layout.tp) == ("h100_80gb", "fp8", "fp8", 2)
    most = max_concurrency(c.shape, c.layout, c.gpu, ServingEfficiency())
    assert c.stated_concurrency is None and 1 < c.layout.concurrency == most < 30000
    assert c.measured["throughput"] == pytest.approx(row["outcome"]["throughput_tokens_per_s"]["value"] / 2)


def test_total_token_throughput_becomes_output_tokens(rows):
    c = case(rows, "vllm-issue1888-mistral7b-tp1")
    assert c.model == "mistral_7b" and c.gpu_name == "a100_80gb"
    assert any("80 GB" in n for n in c.notes)  # the A100's memory is not stated
    assert c.measured["throughput"] == pytest.approx(6464 * 1024 / (10240 + 1024))


def test_continuous_server_past_its_kv_cache_runs_what_fits_and_drops_the_queued_ttft(rows):
    c = case(rows, "nim-llama3370b-v180-2xh100-tp2-i5000-o500-c250")
    assert c.engine == "NVIDIA NIM" and c.stated_concurrency == 250
    assert c.layout.concurrency == c.model_max_concurrency < 250
    assert "ttft" not in c.measured and {"throughput", "tpot"} <= set(c.measured)


def test_an_fp8_build_holds_its_kv_cache_in_fp8_as_the_server_saturates(rows):
    """NIM's fp8 Llama 3.3 70B on 2 H100s states no KV cache format. Measured throughput x time per output token
    (Little's law) gives the requests actually in flight: about 85 at concurrency 100-250, what an fp8 cache holds
    at 5,000 + 500 tokens, twice a 16-bit one's. A weight-only int8 build keeps a 16-bit cache."""
    for row_id in ("nim-llama3370b-v180-2xh100-tp2-i5000-o500-c150", "nim-llama3370b-v180-2xh100-tp2-i5000-o500-c250"):
        c = case(rows, row_id)
        in_flight = c.measured["throughput"] * 2 * c.measured["tpot"] / 1000  # system tokens/s x s per token
        assert c.layout.kv_cache == "fp8" and abs(c.model_max_concurrency - in_flight) < 0.05 * in_flight
    assert bench.formats({"precision": "fp16", "model": {"quantization": "int8 weight-only"}}) == ("int8", "bf16")


def test_fixed_batch_latency_reads_the_median(rows):
    c = case(rows, "vllm-bk9513-h200-latency_llama8B_tp1")
    assert (c.model, c.layout.weights, c.layout.concurrency) == ("llama3_8b", "bf16", 8)
    assert c.measured["latency"] == 834.014


@pytest.mark.parametrize("row_id, kind", [
    ("trt1x-llama3370b-b200-tp1pp1-fp4-i128-o128", "gpu"),
    ("trt1x-llama4scout-h200-tp4pp1-fp8-i128-o128", "model"),
    ("sgl030vllm060-online-sglang-8b-rps4", "request rate"),
    ("lmd020-rps-llama2-7b-tp1-c256", "lengths"),
    ("trtblog-falcon180bh200-llama70b-g8-i128-o128", "layout"),
])
def test_unexpressible_rows_give_their_kind(rows, row_id, kind):
    with pytest.raises(bench.Unexpressible) as why:
        bench.express(rows[row_id])
    assert why.value.kind == kind


def test_value_reads_inferred_fields():
    assert bench.value({"value": 80, "inferred": True, "from": "x"}) == 80
    assert bench.value(7) == 7 and bench.value(None) is None


def test_engine_families_are_the_first_word():
    assert bench.engine_family("LMDeploy (TurboMind)") == "LMDeploy"
    assert bench.engine_family("TensorRT-LLM (NVIDIA MLPerf v4.0 harness)") == "TensorRT-LLM"
    assert bench.engine_family("NVIDIA NIM (Llama-3.3-70b-Instruct container)") == "NVIDIA NIM"
    assert bench.engine_family({"value": "vLLM"}) == "vLLM"


def test_spearman_and_the_median_over_groups():
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert bench.spearman([1, 2, 3], [5, 5, 5]) == 0.0  # no order predicted
    assert bench.spearman([1, 2], [1, 2]) is None and bench.spearman([4, 4, 4], [1, 2, 3]) is None
    assert bench.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # ties at mean ranks
    groups = {"a": [(1, 1), (2, 2), (3, 3)], "b": [(1, 1), (2, 2), (3, 3), (4, 4)], "c": [(1, 3), (2, 2), (3, 1)],
              "d": [(1, 1), (2, 2)]}  # d: under 3 layouts, no Spearman (a pick)
    r = bench.rank_scores(groups)
    assert sorted(r.spearman) == pytest.approx([-1.0, 1.0, 1.0])
    assert r.spearman_median == pytest.approx(1.0) and statistics.fmean(r.spearman) == pytest.approx(1 / 3)
    assert r.spearman_share == pytest.approx(2 / 3)
    assert r.picks == [True, True, False, True] and r.pick_share == pytest.approx(0.75)


def test_the_pick_counts_a_tie_within_5_percent_not_6():
    assert bench.pick_hit([(100.0, 1.0), (95.0, 2.0)])  # picked 5% below the best
    assert not bench.pick_hit([(100.0, 1.0), (94.0, 2.0)])  # 6% below
    assert bench.pick_hit([(100.0, 2.0), (50.0, 1.0)])
    assert bench.rank_scores({"g": [(100.0, 1.0), (95.0, 2.0)], "h": [(100.0, 1.0), (94.0, 2.0)]}).picks == \
        [True, False]


def test_the_fits_linear_reading_agrees_with_the_model_where_it_is_linear(rows):
    """A static batch without a pipeline is of the linear reading's form, exactly; a pipelined batch (the fastest
    of its micro-batch splits) or a continuous-batching server (the prompts joining each step) is not, and the check
    says so, so the fit descends on the model itself (``fit_direct``)."""
    linear = [case(rows, i) for i in ("ft-530b-tp16pp1-b1-i20-o8", "lmd010-static-llama2-7b-tp1-b1-i1-o128")]
    objective = bench.Objective(linear)
    for eff in (ServingEfficiency(), ServingEfficiency(bandwidth=0.5, compute=0.3, allreduce_s=2e-5, step_s=1e-3)):
        assert objective.check(eff, every=1) < 1e-9
        assert objective(eff) >= 0
    for other in ("ft-530b-tp8pp3-b64-i20-o8", "nim-llama3370b-v180-2xh100-tp2-i5000-o500-c5"):
        assert bench.Objective([case(rows, other)]).check(ServingEfficiency(), every=1) > 1e-6, other


@pytest.mark.e2e  # sweeps every published serving run and fits the model: seconds
def test_the_script_runs_on_the_data_and_prints_its_targets(rows, card, capsys):
    code = bench.main(["--summary"])
    text = capsys.readouterr().out
    assert code in (0, 1)
    lines = re.findall(r"^- (.+): (met|MISSED)$", text, re.M)
    assert lines and any("Spearman" in line for line, _ in lines) and any("pick" in line for line, _ in lines)
    assert code == (1 if any(v == "MISSED" for _, v in lines) else 0)
    total, expressible, skipped = map(int, re.search(r"(\d+) rows: (\d+) expressible .*?, (\d+) not expressible",
                                                     text).groups())
    assert total == len(rows) == expressible + skipped and expressible == len(card.cases)
    kinds = {m.group(1): int(m.group(2)) for m in re.finditer(r"^- ([a-z ]+): (\d+) rows \(", text, re.M)}
    assert sum(kinds.values()) == skipped and kinds == dict(card.reasons())
    assert re.search(r"^ServingEfficiency\(bandwidth=", text, re.M)
