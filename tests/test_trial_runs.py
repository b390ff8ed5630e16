"""Single-process trials: the result contract, the time box, signals, memory caps, checkpointing."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from hp_tool.vocab import LOSING, STATUSES, STOP_REASONS
from hp_tool.contracts.result import METRIC_FIELDS, RESULT_FIELDS, request_stop
from hp_tool.trial.train import run_trial
from trial_helpers import REPO, read_metrics, read_result, tiny_spec, write_spec


def run(tmp_path, spec):
    out = tmp_path / "out"
    result = run_trial(write_spec(spec, tmp_path), str(out))
    return result, out


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["gpt3", "llama"])
def test_result_and_metrics_follow_the_contract(tmp_path, family):
    spec = tiny_spec(family, max_steps=4, warmup_steps=2)
    result, out = run(tmp_path, spec)
    on_disk = read_result(out)
    assert on_disk == json.loads(json.dumps(result))
    assert list(on_disk) == list(RESULT_FIELDS)
    assert on_disk["status"] == "ok" and on_disk["status"] in STATUSES
    assert on_disk["stop_reason"] == "max_steps" and on_disk["stop_reason"] in STOP_REASONS
    assert on_disk["steps_run"] == 4 and on_disk["steps_measured"] == 2
    metrics = read_metrics(out)
    assert [m["timed"] for m in metrics] == [False, False, True, True]
    assert all(list(m) == list(METRIC_FIELDS) for m in metrics)
    tokens = spec.training.global_batch_size * spec.model.seq_length
    assert all(m["tokens"] == tokens and m["memory_gib"] > 0 for m in metrics)
    timed = sorted(m["step_time_s"] for m in metrics if m["timed"])
    assert on_disk["step_time_s_median"] == pytest.approx(sum(timed) / 2)
    median = on_disk["step_time_s_median"]
    assert on_disk["tokens_per_s"] == pytest.approx(tokens / median)
    assert on_disk["samples_per_s"] == pytest.approx(spec.training.global_batch_size / median)
    assert on_disk["mfu"] == pytest.approx(on_disk["model_tflops_per_gpu"] / 1.0)  # peak 1 TFLOPS
    assert on_disk["peak_memory_gib"] > 0 and on_disk["peak_memory_reserved_gib"] is None
    assert on_disk["first_losses"][0] == pytest.approx(math.log(spec.model.vocab_size), rel=0.02)
    assert on_disk["final_loss"] == metrics[-1]["loss"]
    assert on_disk["versions"]["torch"] and on_disk["versions"]["transformers"]
    assert on_disk["start_time"] < on_disk["end_time"]
    assert "None" not in (out / "result.json").read_text()


@pytest.mark.e2e
def test_activation_checkpointing_keeps_the_losses(tmp_path):
    plain, _ = run(tmp_path / "plain", tiny_spec("llama", max_steps=3))
    ckpt, _ = run(tmp_path / "ckpt", tiny_spec("llama", max_steps=3, act_ckpt=4))
    assert ckpt["first_losses"] == pytest.approx(plain["first_losses"], rel=1e-4)


@pytest.mark.e2e
def test_time_budget_stops_the_run(tmp_path, monkeypatch):
    """On a clock that each step moves by 1 s: a 12 s job leaves 10.8 s for training, so the run stops after
    10 steps; an 11th would end at 11 s. (How long the write-out really takes is a benchmark's, not a test's.)"""
    from hp_tool.trial import measure, train

    clock, real_step = [0.0], train.train_step

    def one_second_step(engine, step):
        clock[0] += 1.0
        return real_step(engine, step)

    monkeypatch.setattr(measure, "now_s", lambda: clock[0])
    monkeypatch.setattr(train, "train_step", one_second_step)
    spec = tiny_spec("gpt3", max_steps=100_000, max_minutes=0.2)  # 12 s job, 10.8 s for training
    result, out = run(tmp_path, spec)
    assert result["status"] == "ok" and result["stop_reason"] == "time_budget"
    assert result["steps_run"] == len(read_metrics(out)) == 10
    assert [m["step_time_s"] for m in read_metrics(out)] == [1.0] * 10


def test_stable_step_time_stops_early(tmp_path):
    spec = tiny_spec("gpt3", max_steps=200, stable_cv=10.0, stable_window=3)
    result, _ = run(tmp_path, spec)
    assert result["stop_reason"] == "stable"
    assert result["steps_run"] == spec.run.warmup_steps + 3


def _start(tmp_path, spec):
    cmd = [sys.executable, "-m", "hp_tool.trial.train", str(write_spec(spec, tmp_path)),
           "--output-dir", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_sigterm_writes_results_and_exits_cleanly(tmp_path):
    proc = _start(tmp_path, tiny_spec("gpt3", max_steps=100_000, warmup_steps=1))
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output[-3000:]
    result = read_result(tmp_path / "out")
    assert result["status"] == "ok" and result["stop_reason"] == "signal"
    assert result["steps_measured"] >= 2


@pytest.mark.e2e
def test_a_stop_request_ends_the_trial_as_losing_with_its_measurement_and_reason(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    request_stop(out, LOSING, "left by an earlier run")  # not for this run: cleared at its start
    proc = _start(tmp_path, tiny_spec("gpt3", max_steps=100_000, warmup_steps=1))
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 4):
        time.sleep(0.2)
    assert proc.poll() is None, "the earlier run's request stopped this one"
    request_stop(out, LOSING, "0.5 s per step, more than skip_margin=0.25 slower than the best measured")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-3000:]
    result = read_result(out)
    assert result["status"] == "ok" and result["stop_reason"] == "losing"
    assert result["reason"] == "0.5 s per step, more than skip_margin=0.25 slower than the best measured"
    assert result["steps_measured"] >= 3 and result["step_time_s_median"] > 0
    assert result["steps_run"] == len(read_metrics(out)) < 100_000


@pytest.mark.e2e
def test_memory_cap_produces_oom(tmp_path):
    spec = tiny_spec("gpt3", max_steps=3, memory_cap_gib=2.0)
    spec.model.hidden_size, spec.model.ffn_hidden_size = 2048, 8192  # ~3 GiB of weights and Adam state
    proc = _start(tmp_path, spec)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    result = read_result(tmp_path / "out")
    assert result["status"] == "oom", output[-3000:]
    assert "allocate" in result["reason"] and result["stop_reason"] is None


def test_unreadable_spec_leaves_a_failed_status(tmp_path):
    bad = tmp_path / "gpt3_bad.yaml"
    bad.write_text("parallel:\n  tp: 3\n")
    with pytest.raises(Exception):
        run_trial(bad, str(tmp_path / "out"))
    result = read_result(tmp_path / "out")
    assert result["trial_id"] == "gpt3_bad" and result["status"] == "failed"
    assert "parallel" in result["reason"]
