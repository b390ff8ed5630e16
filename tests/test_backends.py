"""The launch backends' protocol on each backend: a real job on this machine through submitit's local
executor, the in-process backend in this test process, the SLURM backend's sbatch script against a golden
file (real SLURM jobs: tests/slurm/, marked slurm)."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.errors import ConfigError
from hp_tool.launch.backends import backend_for
from hp_tool.launch.backends.slurm import SlurmBackend
from hp_tool.launch.job import JobSpec, job_name
from hp_tool.launch.ledger import Entry
from hp_tool.planner import make_plan
from hp_tool.search import trial_job_spec
from hp_tool.session import prepare_backend

GOLDEN = Path(__file__).resolve().parent / "golden" / "gpt3_5b_bcm.sbatch"
UPDATE_GOLDEN = "HP_TOOL_UPDATE_GOLDEN"

# a local job's Python cannot import this test module: ship its functions by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sleep_then_write(config_path: str) -> dict:
    """A job: sleep the seconds its config names, then write result.json beside the config."""
    seconds = float(Path(config_path).read_text())
    time.sleep(seconds)
    result = {"status": "ok", "slept_s": seconds, "pid": os.getpid()}
    (Path(config_path).parent / "result.json").write_text(json.dumps(result))
    return result


def raise_error(config_path: str) -> dict:
    raise RuntimeError(f"boom in {Path(config_path).name}")


def app_for(*overrides):
    cfg, _ = compose(["search_config=gpt3/tiny", *overrides])
    return to_app_config(cfg)


def tiny_job(folder: Path, seconds: float, entry=sleep_then_write, tasks: int = 1) -> JobSpec:
    folder.mkdir(parents=True)
    (folder / "job.cfg").write_text(str(seconds))
    return JobSpec(folder.name, str(folder / "job.cfg"), str(folder), 1, tasks, 1.0, "fp", entry)


def wait_done(handle, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not handle.done():
        assert time.time() < deadline, f"job {handle.job_id} still {handle.state}"
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------- selection

def test_each_cluster_type_gets_its_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{tmp_path}:{Path(sys.executable).parent}")  # no sinfo: auto finds no SLURM
    kinds = {t: backend_for(app_for(f"cluster={t}").cluster, app_for().gpu) for t in ("local", "auto", "in_process")}
    assert {t: b.kind for t, b in kinds.items()} == {"local": "local", "auto": "local", "in_process": "in_process"}
    bcm = backend_for(app_for("cluster=bcm", "cluster.slurm.partition=batch").cluster, app_for().gpu)
    assert bcm.kind == "slurm" and bcm.detachable and not kinds["local"].detachable
    assert kinds["in_process"].parallelism == 1


# ---------------------------------------------------------------------------------------- local

@pytest.mark.e2e
def test_local_backend_runs_a_real_job_reattaches_by_pid_and_cancels(tmp_path):
    backend = backend_for(app_for("cluster=local").cluster, app_for().gpu)
    quick = tiny_job(tmp_path / "quick", 0.1)
    handle = backend.submit(quick, job_name("hp_tool:", "sid", quick.name))
    wait_done(handle)
    assert str(handle.state) == "FINISHED"
    assert json.loads((quick.out / "result.json").read_text())["slept_s"] == 0.1
    assert backend.find(job_name("hp_tool:", "sid", quick.name)) is None  # local jobs are followed by pid

    slow = tiny_job(tmp_path / "slow", 120)
    started = backend.submit(slow, "slow")
    entry = Entry(slow.name, "submitted", job_id=str(started.job_id), kind="local")
    again = backend.reattach(slow, entry, str(started.job_id))  # as a restarted orchestrator would
    assert again is not None and not again.done() and again.state == "RUNNING"
    backend.cancel(again)
    wait_done(started, timeout_s=30)  # reaps the controller, a child of this process
    wait_done(again, timeout_s=30)
    assert backend.reattach(slow, entry, str(started.job_id)) is None  # ended: it would run again
    assert not (slow.out / "result.json").exists()
    status, reason = backend.end_state(again, slow, ran_s=2.0, log_tail="")
    assert status == "failed" and "ended without a result" in reason
    assert backend.end_state(again, slow, ran_s=60.0, log_tail="")[0] == "timeout"  # its 1-minute limit


def write_visible_gpus(config_path: str) -> dict:
    """A job: write the CUDA_VISIBLE_DEVICES it was started with beside its config."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    (Path(config_path).parent / "result.json").write_text(json.dumps({"status": "ok", "visible": seen}))
    return {"visible": seen}


@pytest.mark.e2e
@pytest.mark.parametrize("parent, tasks, expected", [(None, 1, "0"), (None, 2, "0,1"), ("2,3", 1, "2"),
                                                     ("3,1,2", 2, "3,1")])
def test_a_local_gpu_job_sees_one_gpu_per_task(tmp_path, monkeypatch, parent, tasks, expected):
    """A GPU preset's local job is started with its GPUs visible (submitit hides them unless asked): the
    machine's first ones, or the first of those this orchestrator was given. No GPU is needed to see what the
    job is handed; whether torch then finds one is the GPU check's (benchmarks/gpu_check.py)."""
    if parent is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    backend = backend_for(app_for("cluster=local").cluster, app_for("gpu=h100_80gb").gpu)
    job = tiny_job(tmp_path / "gpu", 0, entry=write_visible_gpus, tasks=tasks)
    wait_done(backend.submit(job, "gpu"))
    assert json.loads((job.out / "result.json").read_text())["visible"] == expected


def test_local_backend_refuses_a_search_this_machine_cannot_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: no GPU here
    app = app_for("cluster=local", "gpu=h100_80gb")
    with pytest.raises(ConfigError) as err:
        prepare_backend(app, [tiny_job(tmp_path / "j", 0)])
    assert err.value.key == "cluster" and "no GPU" in err.value.problem


# ---------------------------------------------------------------------------------------- in-process

@pytest.mark.e2e
def test_in_process_backend_runs_the_job_in_this_process_and_keeps_its_error(tmp_path):
    backend = prepare_backend(app_for("cluster=in_process"), [])
    job = tiny_job(tmp_path / "ok", 0.1)
    handle = backend.submit(job, "ok")
    wait_done(handle, timeout_s=30)
    assert handle.state == "FINISHED"
    assert json.loads((job.out / "result.json").read_text())["pid"] == os.getpid()
    assert backend.reattach(job, Entry(job.name, "submitted", job_id=handle.job_id, kind="in_process"),
                            handle.job_id) is None  # its orchestrator has ended: it runs again

    broken = tiny_job(tmp_path / "broken", 0, entry=raise_error)
    failed = backend.submit(broken, "broken")
    wait_done(failed, timeout_s=30)
    status, reason = backend.end_state(failed, broken, ran_s=0.1, log_tail="")
    assert failed.state == "FAILED" and status == "failed"
    assert "ended without a result: it raised RuntimeError: boom in job.cfg" in reason


def test_in_process_backend_refuses_multi_process_jobs_parallel_runs_and_detach(tmp_path):
    two = tiny_job(tmp_path / "two", 0, tasks=2)
    with pytest.raises(ConfigError) as err:
        prepare_backend(app_for("cluster=in_process"), [two])
    assert err.value.key == "cluster.type" and err.value.value == "in_process"
    assert "needs 2 processes" in err.value.problem and "cluster=local" in err.value.fix
    with pytest.raises(ConfigError) as err:
        prepare_backend(app_for("cluster=in_process", "cluster.max_parallel_runs=2"), [])
    assert err.value.key == "cluster.max_parallel_runs"
    with pytest.raises(ConfigError) as err:
        prepare_backend(app_for("cluster=in_process", "detach=true"), [])
    assert err.value.key == "detach" and "cluster=bcm" in err.value.fix


def test_a_training_search_with_two_process_trials_is_refused_before_anything_is_written(tmp_path):
    from hp_tool.cli import run

    app = app_for("cluster=in_process", "memory_check=analytic", f"base_results_dir={tmp_path / 'res'}")
    with pytest.raises(ConfigError, match="in-process jobs are one process"):
        run(app, "gpt3/tiny")
    assert not (tmp_path / "res").exists()


# ---------------------------------------------------------------------------------------- SLURM

def test_slurm_backend_writes_the_golden_sbatch_script(tmp_path, monkeypatch):
    """The whole script sbatch receives for gpt3/5b's first trial on cluster=bcm with every cluster key set,
    against tests/golden/ (HP_TOOL_UPDATE_GOLDEN=1 rewrites it). The folder name has a space and quotes to
    catch quoting bugs. submitit's SLURM executor wants `srun` on PATH; where SLURM is not installed a
    placeholder stands in (it is never run: the script is only rendered)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if not any(Path(d, "srun").exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
        (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / "srun").chmod(stat.S_IRWXU)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg, name = compose(["search_config=gpt3/5b", "cluster=bcm", "cluster.slurm.partition=batch", "cluster.slurm.account=acct",
                         "cluster.slurm.qos=high", "cluster.slurm.constraint=h100", "cluster.cpus_per_task=12",
                         "cluster.slurm.container_image=nvcr.io/x:1", "cluster.slurm.container_mounts=[/data:/data]",
                         "cluster.slurm.setup=[module load cuda]", "cluster.slurm.srun_args=['--mpi=pmix']",
                         "+cluster.slurm.additional_sbatch_parameters.reservation=res1",
                         "search_config.train_settings.max_minutes_per_run=30"])
    app = to_app_config(cfg)
    spec = make_plan(app, name, tmp_path / name).specs[0]
    spec.run.output_dir = str(tmp_path / "job folder 'quoted'")
    job = trial_job_spec(spec, tmp_path / "spec.yaml")
    text = SlurmBackend(app.cluster).sbatch_script(job, job_name(app.cluster.job_name_prefix, "s1d", job.name))
    text = text.replace(str(tmp_path), "<tmp>").replace(sys.executable, "<python>")
    if os.environ.get(UPDATE_GOLDEN):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"the sbatch script changed; if on purpose, rerun with {UPDATE_GOLDEN}=1"


def test_a_job_on_this_machine_is_looked_at_every_0_3_s_at_most_a_scheduler_every_fifteen():
    """A local trial's end is noticed within 0.3 s (its GPU idles until the next trial starts; a losing trial
    runs on until its steps are looked at), 0.2 s after a change; SLURM is asked less often as nothing
    changes."""
    from hp_tool.launch.backends.in_process import InProcessBackend
    from hp_tool.launch.backends.local import LocalBackend
    from hp_tool.launch.backends.slurm import SlurmBackend
    from hp_tool.launch.runner import next_poll_delay

    def waits(backend_cls, polls=20):
        delay, out = backend_cls.min_poll_s, []
        for i in range(polls):
            delay = next_poll_delay(delay, changed=i == 10, ceiling=backend_cls.max_poll_s, floor=backend_cls.min_poll_s)
            out.append(delay)
        return out

    local, slurm = waits(LocalBackend), waits(SlurmBackend)
    assert max(local) == 0.3 and local[10] == 0.2 and local[11] == pytest.approx(0.3) and waits(InProcessBackend) == local
    assert max(slurm) == 15.0 and slurm[10] == SlurmBackend.min_poll_s == 1.0 and slurm[11] == 1.5
