"""Where a trial's time went: the per-rank phase log, the reasons built from it, the GPU's allocator-based
peak, and one-process offload (the layout a one-GPU user asks for)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from hp_tool.contracts import phases
from hp_tool.launch.job import JobSpec, write_job_failure
from hp_tool.trial import train as trial_train
from hp_tool.trial.engines.base import FAIL_RANK_ENV, FAIL_STEP_ENV
from hp_tool.trial.train import run_trial
from trial_helpers import REPO, read_result, tiny_spec, trial_process, write_spec


def rows(*marks):
    """Phase lines at the given unix times: (phase, next, time[, step])."""
    out = []
    for mark in marks:
        phase, nxt, when = mark[:3]
        row = {"phase": phase, "next": nxt, "time": when}
        if len(mark) > 3:
            row["step"] = mark[3]
        out.append(json.dumps(row))
    return "\n".join(out) + "\n"


def test_summary_names_the_rank_furthest_behind_its_phase_and_what_each_phase_took(tmp_path):
    t0 = 1000.0
    build = [("start", "imports", t0), ("imports", "distributed_init", t0 + 8),
             ("distributed_init", "model_build", t0 + 9), ("model_build", "weights", t0 + 50),
             ("weights", "optimizer", t0 + 80), ("optimizer", "first_forward", t0 + 81)]
    (tmp_path / phases.file_name(0)).write_text(rows(*build, ("first_forward", "first_backward", t0 + 90),
                                                     ("first_backward", "first_step", t0 + 92)))
    (tmp_path / phases.file_name(1)).write_text(rows(*build))
    text = phases.summary(tmp_path, "timeout", limit_min=2, now_unix=t0 + 96)
    assert text == ("timeout in first forward after 96 s (rank 1, the furthest behind); imports 8 s, distributed "
                    "init 1 s, model build 41 s, weight initialisation / loading 30 s, optimizer build 1 s")


def test_a_trial_still_building_at_its_limit_says_the_build_alone_took_longer(tmp_path):
    (tmp_path / phases.file_name(0)).write_text(rows(("start", "imports", 0.0), ("imports", "distributed_init", 5.0),
                                                     ("distributed_init", "model_build", 6.0),
                                                     ("model_build", "weights", 20.0)) + '{"phase": "wei')  # cut off
    text = phases.summary(tmp_path, "timeout", limit_min=2, now_unix=125.0)
    assert text.startswith("timeout in weight initialisation / loading after 125 s; imports 5 s")
    assert "the build alone took longer than the 2-minute limit" in text
    assert "max_minutes_per_run" in text
    assert phases.summary(tmp_path / "nothing", "timeout") is None


def test_a_trial_in_its_steps_names_the_step_and_the_first_steps_time(tmp_path):
    (tmp_path / phases.file_name(0)).write_text(rows(
        ("start", "imports", 0.0), ("imports", "distributed_init", 3.0), ("distributed_init", "model_build", 3.5),
        ("model_build", "weights", 4.0), ("weights", "optimizer", 6.0), ("optimizer", "first_forward", 7.0),
        ("first_forward", "first_backward", 9.0), ("first_backward", "first_step", 12.0),
        ("first_step", "step", 13.0, 1), ("step", "step", 14.0, 2)))
    text = phases.summary(tmp_path, "timeout", limit_min=1, now_unix=70.0)
    assert text.startswith("timeout in step 3 after 70 s; imports 3 s")
    assert "first forward 2 s, first backward 3 s, first optimizer step 1 s" in text
    assert "build alone" not in text


@pytest.mark.e2e
def test_every_trial_logs_its_phases_in_order_with_their_times(tmp_path):
    spec = tiny_spec("llama", max_steps=3)
    run_trial(write_spec(spec, tmp_path), str(tmp_path / "out"))
    lines = [json.loads(line) for line in (tmp_path / "out" / phases.file_name(0)).read_text().splitlines()]
    assert [r["phase"] for r in lines] == ["start", "imports", "distributed_init", "model_build", "weights",
                                           "optimizer", "first_forward", "first_backward", "first_step",
                                           "step", "step"]
    assert [r.get("step") for r in lines[-3:]] == [1, 2, 3]
    times = [r["time"] for r in lines]
    assert times == sorted(times)
    assert all(r["next"] == lines[i + 1]["phase"] for i, r in enumerate(lines[:-1]) if r["phase"] != "step")


@pytest.mark.e2e
def test_a_failure_names_the_phase_it_happened_in(tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_RANK_ENV, "0")
    monkeypatch.setenv(FAIL_STEP_ENV, "2")  # raises before the second step
    result = run_trial(write_spec(tiny_spec("gpt3", max_steps=4), tmp_path), str(tmp_path / "out"))
    assert result["status"] == "failed"
    first_line = result["reason"].splitlines()[0]
    assert first_line.startswith("rank 0 in step 2 after ")
    assert "first optimizer step" in first_line and "RuntimeError: injected failure" in first_line


SLOW_WEIGHTS = """
import sys, time
import hp_tool.trial.rank as rank
fill = rank.materialize
rank.materialize = lambda *a, **k: (time.sleep(120), fill(*a, **k))[1]  # a build as slow as a 7B one on a GPU
from hp_tool.trial.train import exit_now, main
exit_now(main(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_a_trial_killed_mid_build_reports_the_phase_it_was_in(tmp_path):
    """The weight initialisation is made to take two minutes (a test stand-in for a real-size model); the job
    is killed there, as a scheduler kills one at its limit, and the launcher's failure result says where."""
    spec = tiny_spec("llama", max_steps=3)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WEIGHTS, str(write_spec(spec, tmp_path)), "--output-dir",
                             str(out)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / phases.file_name(0)
    deadline = time.monotonic() + 60
    while not (log.exists() and '"next": "weights"' in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the trial never reached its weights"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    job = JobSpec(spec.trial_id, "spec.yaml", str(out), 1, 1, 1.0, "fp", entry=print,
                  blank={"trial_id": spec.trial_id, "steps_run": 0})
    result = write_job_failure(job, "timeout", "local job reached its 1-minute limit without a result")
    assert result["reason"].startswith("timeout in weight initialisation / loading after ")
    assert "model build" in result["reason"] and "the build alone took longer than the 1-minute limit" in \
        result["reason"]
    assert result["reason"].endswith("; local job reached its 1-minute limit without a result")
    assert read_result(out)["reason"] == result["reason"]


class _NoDispatchTracker:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a dispatch-mode tracker over a GPU step")


def test_on_a_gpu_the_peak_comes_from_the_allocator_never_from_a_dispatch_mode(monkeypatch):
    """No GPU here: the CUDA allocator's two calls are replaced by a counter (allocations of 3, then 5 GiB),
    and the tensor tracker fails if it is ever built."""
    calls = []
    peaks = iter([3 * 2 ** 30, 5 * 2 ** 30])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append("read") or next(peaks))
    monkeypatch.setattr(trial_train, "TensorPeak", _NoDispatchTracker)
    engine = types.SimpleNamespace(device=torch.device("cuda", 0), measures_tensor_peak=True)
    steps = trial_train._TensorPeakSteps(engine, 2)
    for step in range(4):
        with steps.around(step):
            pass
    assert calls == ["reset", "read", "read"]  # reset once before the first step, read after the untimed two
    assert steps.peak == 5 * 2 ** 30


def test_on_cpu_the_tensor_tracker_counts_the_untimed_steps(monkeypatch):
    built = []

    class Tracker:
        def __init__(self, device_type):
            built.append(device_type)

        def track(self, stage, optimizer):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def restart_peak(self):
            pass

        def peak_bytes(self):
            return 7

    monkeypatch.setattr(trial_train, "TensorPeak", Tracker)
    engine = types.SimpleNamespace(device=torch.device("cpu"), measures_tensor_peak=True, stage=None, optimizer=None)
    steps = trial_train._TensorPeakSteps(engine, 1)
    for step in range(3):
        with steps.around(step):
            pass
    assert built == ["cpu"] and steps.peak == 7


def _trial_process(tmp_path, spec) -> dict:
    """A trial in a process of its own, as a job runs one (DeepSpeed keeps its groups per process): forked from
    the warm process (trial_helpers.trial_process), so it spends no seconds importing torch again."""
    out = tmp_path / "out"
    proc = trial_process(write_spec(spec, tmp_path), out, timeout=300)
    assert (out / "result.json").exists(), proc.stderr[-3000:]
    return read_result(out)


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_one_process_offloads_and_trains_like_no_offload(tmp_path, engine):
    """One GPU plus offload, as users with one card ask for: the engine makes a one-rank process group
    (FSDP2's CPU offload; DeepSpeed needs one even without offload) and the losses match the run without.
    The torch trials run in this process (the group is left again after each); DeepSpeed's in processes of
    their own, as jobs run them (it keeps its groups per process)."""
    def trial(folder, **layout):
        spec = tiny_spec("llama", max_steps=3, engine=engine, zero_stage=3, **layout)
        if engine == "deepspeed":
            return _trial_process(folder, spec)
        return run_trial(write_spec(spec, folder), str(folder / "out"))

    base = trial(tmp_path / "a")
    off = trial(tmp_path / "b", offload="optimizer_and_params")
    assert base["status"] == "ok" and off["status"] == "ok", (base["reason"], off["reason"])
    assert off["first_losses"] == pytest.approx(base["first_losses"], rel=1e-5)
    assert off["first_losses"][0] != pytest.approx(off["first_losses"][-1], rel=1e-3)  # it trained


@pytest.mark.e2e
@pytest.mark.parametrize("offload, on_host", [("optimizer_and_params", True), ("none", False)])
def test_fsdp2_offload_materialises_every_parameter_on_the_host(tmp_path, monkeypatch, offload, on_host):
    """FSDP2's CPU offload refuses a parameter not on the host at its first forward, the root's (embeddings,
    final norm, head) too: on a GPU the torch engine must materialise the stage there, buffers and the random
    draws on the GPU. No GPU here, so the compute device is the CPU as well: this checks what the engine
    asks its materialiser for, and that every parameter ends where it asked."""
    from hp_tool.trial import rank as trial_rank
    from hp_tool.trial.engines import torch_engine

    asked, built = [], []

    class Recording(trial_rank.Initialise):
        @classmethod
        def of(cls, spec, device, params_on_host=False):
            asked.append(params_on_host)
            return trial_rank.Initialise.of(spec, device, params_on_host)

    real = trial_rank.Initialise.__call__

    def call(self, stage):
        numel = real(self, stage)
        built.append({p.device.type for p in stage.parameters()})
        return numel

    monkeypatch.setattr(torch_engine, "Initialise", Recording)
    monkeypatch.setattr(trial_rank.Initialise, "__call__", call)
    spec = tiny_spec("llama", max_steps=2, engine="torch", zero_stage=3, offload=offload)
    result = run_trial(write_spec(spec, tmp_path), str(tmp_path / "out"))
    assert result["status"] == "ok", result["reason"]
    assert asked == [on_host] and built == [{"cpu"}]
