"""vLLM as the inference search's engine (inference_settings.engine=vllm): the command a job runs, the reading of
vLLM's JSON, the `vllm serve` line of the pick, and the checks before anything runs.

vLLM needs a GPU and is not installed on these CPU machines: what runs here is the command hp_tool builds, the parsing
of vLLM's documented ``vllm bench latency --output-json`` format (vllm/benchmarks/latency.py: avg_latency,
std_latency, latencies, percentiles keyed 10/25/50/75/90/99), and the job's handling of the process, with a small
executable named ``vllm`` standing in for vLLM on PATH (it writes that JSON, or fails as vLLM fails)."""

from __future__ import annotations

import json
import os
import stat

import pandas as pd
import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.contracts.inference import InferenceJobConfig, load_job_config
from hp_tool.contracts.spec import ModelSpec
from hp_tool.contracts.vllm import bench_command, failure_status, latency_result, serve_command
from hp_tool.errors import ConfigError
from hp_tool.inference.search import plan_inference, run_inference_search
from hp_tool.trial.vllm_runner import run_vllm

IS = "search_config.inference_settings"
# vLLM's latency JSON as json.dump writes it (the percentiles' int keys become strings): 5 batches, skewed so that
# the mean (avg_latency) and the median differ
LATENCY_JSON = {"avg_latency": 1.3, "std_latency": 0.6, "latencies": [1.0, 1.0, 1.1, 1.2, 2.2],
                "percentiles": {"10": 1.0, "25": 1.0, "50": 1.1, "75": 1.2, "90": 1.8, "99": 2.16}}


def test_the_bench_command_carries_the_layout_and_lengths():
    argv = bench_command("meta-llama/Llama-2-7b-hf", 2, 1, 16, 128, 64, 2, 10, "bf16", "/out/v.json")
    assert argv[:5] == ["vllm", "bench", "latency", "--model", "meta-llama/Llama-2-7b-hf"]
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags == {"--tensor-parallel-size": "2", "--pipeline-parallel-size": "1", "--dtype": "bfloat16",
                     "--batch-size": "16", "--input-len": "128", "--output-len": "64", "--num-iters-warmup": "2",
                     "--num-iters": "10", "--max-model-len": "192", "--output-json": "/out/v.json"}


def test_vllm_latency_json_becomes_the_result_fields():
    got = latency_result(json.loads(json.dumps(LATENCY_JSON)), batch_size=16, output_len=64, gpus=2)
    assert got["latency_ms_p50"] == pytest.approx(1100)  # the median, not avg_latency's 1300
    assert got["latency_ms_p99"] == pytest.approx(2160)
    assert got["latency_ms_p95"] == pytest.approx(1000 * (1.2 + 0.8 * 1.0))  # from the latencies themselves
    assert got["tokens_per_s"] == pytest.approx(16 * 64 / 1.1)
    assert got["tokens_per_s_per_gpu"] == pytest.approx(16 * 64 / 1.1 / 2)
    assert got["time_to_first_token_ms"] is None  # vLLM's latency benchmark does not time it


def test_the_serve_line_and_the_failure_kinds():
    line = serve_command("Qwen/Qwen3-8B", 2, 1, 64, "bf16", 2048)
    assert line == ("vllm serve Qwen/Qwen3-8B --tensor-parallel-size 2 --pipeline-parallel-size 1 --dtype bfloat16 "
                    "--max-num-seqs 64 --max-model-len 2048")
    assert failure_status("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate") == "oom"
    assert failure_status("ValueError: No available memory for the cache blocks.") == "oom"
    assert failure_status("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate") == "oom"
    assert failure_status("ModuleNotFoundError: No module named 'flash_attn'") == "failed"


def stand_in_vllm(folder, body: str):
    """A ``vllm`` executable in ``folder`` running ``body`` (sh), for PATH: vLLM cannot run here."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "vllm"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return folder


def job(tmp_path) -> InferenceJobConfig:
    return InferenceJobConfig("llama_6.74b_tp2_pp1_bs16", ModelSpec("llama", 4, 64, 4, 4, 256, 512, 128), 2, 1, 16,
                              128, 64, 0, 0, str(tmp_path / "out"), warmup=2, repeats=5, engine="vllm",
                              model_path="meta-llama/Llama-2-7b-hf")


@pytest.mark.e2e  # starts the stand-in
def test_a_vllm_job_writes_its_result_from_the_json(tmp_path, monkeypatch):
    body = ('out=""; while [ $# -gt 0 ]; do [ "$1" = "--output-json" ] && out="$2"; shift; done\n'
            f"printf '%s' '{json.dumps(LATENCY_JSON)}' > \"$out\"\n")
    monkeypatch.setenv("PATH", f"{stand_in_vllm(tmp_path / 'bin', body)}{os.pathsep}{os.environ['PATH']}")
    result = run_vllm(job(tmp_path))
    assert result["status"] == "ok" and result["latency_ms_p50"] == pytest.approx(1100)
    written = json.loads((tmp_path / "out" / "result.json").read_text())
    assert written["status"] == "ok" and written["tokens_per_s_per_gpu"] == pytest.approx(16 * 64 / 1.1 / 2)
    assert written["fingerprint"] == job(tmp_path).fingerprint()
    assert run_vllm(job(tmp_path / "other"), rank=1)["status"] is None  # the other tasks write nothing
    assert not (tmp_path / "other" / "out" / "result.json").exists()


@pytest.mark.e2e  # starts the stand-in
def test_a_vllm_job_that_runs_out_of_memory_or_is_missing_says_so(tmp_path, monkeypatch):
    bins = stand_in_vllm(tmp_path / "bin", "echo 'torch.OutOfMemoryError: CUDA out of memory.' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", f"{bins}{os.pathsep}{os.environ['PATH']}")
    result = run_vllm(job(tmp_path))
    assert result["status"] == "oom" and "CUDA out of memory" in result["reason"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    missing = run_vllm(job(tmp_path / "again"))
    assert missing["status"] == "failed" and "vllm is not installed" in missing["reason"]
    assert json.loads((tmp_path / "again" / "out" / "result.json").read_text())["status"] == "failed"


def test_a_vllm_search_plans_its_checkpoint_and_names_the_key_when_it_has_none(tmp_path):
    cfg, _ = compose(["search_config=finetune/qwen3_8b", f"{IS}.engine=vllm", f"{IS}.max_batch_sizes=[1,8]",
                      f"{IS}.tensor_parallel_sizes=[1,2]"])
    plan = plan_inference(to_app_config(cfg), tmp_path)
    config = next(iter(plan.configs.values()))
    assert (config.engine, config.model_path) == ("vllm", "Qwen/Qwen3-8B")
    hp, _ = compose(["search_config=finetune/qwen3_8b", f"{IS}.max_batch_sizes=[1,8]", f"{IS}.tensor_parallel_sizes=[1,2]"])
    same = plan_inference(to_app_config(hp), tmp_path).configs[config.config_id]
    assert same.engine == "hp_tool" and same.fingerprint() != config.fingerprint()  # what measures it differs
    top = next(c for c in plan.configs.values() if (c.tp, c.batch_size) == (2, 8))
    frame = pd.DataFrame([{"status": "ok", "config_id": top.config_id}])
    assert plan.serve_line(frame) == ("vllm serve Qwen/Qwen3-8B --tensor-parallel-size 2 --pipeline-parallel-size 1 "
                                      "--dtype bfloat16 --max-num-seqs 8 --max-model-len 80")
    gpt, _ = compose(["search_config=gpt3/5b", f"{IS}.engine=vllm"])
    with pytest.raises(ConfigError) as err:
        plan_inference(to_app_config(gpt), tmp_path)
    assert err.value.key == f"{IS}.model_path" and "Fix:" in str(err.value)
    path, _ = compose(["search_config=gpt3/5b", f"{IS}.engine=vllm", f"{IS}.model_path=EleutherAI/gpt-j-6b"])
    assert next(iter(plan_inference(to_app_config(path), tmp_path).configs.values())).model_path == "EleutherAI/gpt-j-6b"


def test_a_local_vllm_search_without_vllm_stops_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cfg, name = compose(["search_config=finetune/tiny", "cluster=local", f"base_results_dir={tmp_path}",
                         f"{IS}.engine=vllm", f"{IS}.model_path=/models/tiny"])
    with pytest.raises(ConfigError) as err:
        run_inference_search(to_app_config(cfg), name, tmp_path / "res")
    assert err.value.key == f"{IS}.engine" and "no `vllm` on PATH" in str(err.value)
    assert not (tmp_path / "res").exists()


def test_the_job_config_round_trips_with_its_engine(tmp_path):
    from hp_tool.contracts.inference import dump_job_config

    cfg = job(tmp_path)
    assert load_job_config(dump_job_config(cfg, tmp_path / "c.yaml")) == cfg


def test_weight_and_kv_cache_formats_are_searched_where_the_engine_serves_them(tmp_path):
    """fp8 weights and an fp8 KV cache on H100s: four formats per layout, named in the config ids; fp8 weights hold
    half the memory and, one request per step being memory-bound, serve faster; the job's vLLM flags and the serve
    line carry them. hp_tool's own loop serves the precision alone, and an A100 has no fp8 KV cache: invalid with the
    fix."""
    from hp_tool.contracts.vllm import bench_command
    from hp_tool.estimate.serving import ServingEfficiency

    base = ["search_config=finetune/llama2_7b", "gpu=h100_80gb", f"{IS}.max_batch_sizes=[1]",
            f"{IS}.tensor_parallel_sizes=[1]", f"{IS}.weight_formats=[bf16,fp8]", f"{IS}.kv_cache_formats=[bf16,fp8]"]
    cfg, _ = compose([*base, f"{IS}.engine=vllm"])
    plan = plan_inference(to_app_config(cfg), tmp_path)
    by_id = {c.config_id: c for c in plan.candidates}
    assert set(by_id) == {"llama_6.74b_tp1_pp1_bs1", "llama_6.74b_tp1_pp1_bs1_kvfp8", "llama_6.74b_tp1_pp1_bs1_wfp8",
                          "llama_6.74b_tp1_pp1_bs1_wfp8_kvfp8"}
    bf16, fp8 = by_id["llama_6.74b_tp1_pp1_bs1"], by_id["llama_6.74b_tp1_pp1_bs1_wfp8"]
    step = ServingEfficiency().step_s  # a step's fixed cost (launches, sampling) is the same in either format
    assert fp8.memory_gib < 0.6 * bf16.memory_gib + 3
    assert fp8.predicted.tpot_s - step < 0.6 * (bf16.predicted.tpot_s - step)
    job = plan.configs["llama_6.74b_tp1_pp1_bs1_wfp8_kvfp8"]
    argv = bench_command(job.model_path, job.tp, job.pp, job.batch_size, 128, 128, 1, 1, job.precision, "o.json",
                         job.weights, job.kv_cache)
    assert argv[argv.index("--quantization") + 1] == "fp8" and argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert plan.configs["llama_6.74b_tp1_pp1_bs1"].fingerprint() != job.fingerprint()
    frame = pd.DataFrame([{"status": "ok", "config_id": job.config_id}])
    assert "--quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 1" in plan.serve_line(frame)
    own, _ = compose(base)
    mine = {c.config_id: c for c in plan_inference(to_app_config(own), tmp_path).candidates}
    assert mine["llama_6.74b_tp1_pp1_bs1_wfp8"].status == "invalid"
    assert "engine=vllm" in mine["llama_6.74b_tp1_pp1_bs1_wfp8"].reason
    a100, _ = compose([*base, "gpu=a100_80gb", f"{IS}.engine=vllm"])
    on_a100 = {c.config_id: c for c in plan_inference(to_app_config(a100), tmp_path).candidates}
    assert on_a100["llama_6.74b_tp1_pp1_bs1_kvfp8"].status == "invalid"
    assert on_a100["llama_6.74b_tp1_pp1_bs1_wfp8"].status == "valid"  # fp8 weights dequantised on the A100


def test_dollars_per_million_tokens_come_from_the_gpu_price(tmp_path):
    from hp_tool.inference.search import plan_csv_text

    cfg, _ = compose(["search_config=finetune/llama2_7b", "gpu=h100_80gb", "gpu.price_per_gpu_hour=3.6",
                      f"{IS}.max_batch_sizes=[1,16]", f"{IS}.tensor_parallel_sizes=[1]"])
    plan = plan_inference(to_app_config(cfg), tmp_path)
    rows = {r.split(",")[0]: r for r in plan_csv_text(plan).splitlines()[1:]}
    header = plan_csv_text(plan).splitlines()[0].split(",")
    for c in plan.candidates:
        usd = float(rows[c.config_id].split(",")[header.index("predicted_usd_per_million_tokens")])
        assert usd == pytest.approx(3.6 / (3600 * c.predicted.tokens_per_s_per_gpu) * 1e6, rel=1e-4)
