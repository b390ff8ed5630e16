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
    frame = pd.DataFrame([{"status": "ok", "tp": 2, "pp": 1, "batch_size": 8}])
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
