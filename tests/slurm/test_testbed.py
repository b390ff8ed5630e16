"""Behaviour of submitit on the SLURM test cluster that hp_tool's launcher relies on.

Each test submits real jobs (see tests/slurm/README.md). The submitit folder has a space and a quote
in its path, so a quoting bug in how the job script is written shows up here.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

# The job functions below live in a test module the job's Python cannot import: ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

QUEUE_WAIT_S = 180  # a job may wait behind others on the one node


def _no_result_grace(job: submitit.Job) -> submitit.Job:
    """result()/exception() of a job killed before writing its result wait 15 s for the file (slow
    shared file systems); the file is local here, so 2 s is plenty and keeps the tests short."""
    job._results_timeout_s = 2
    return job


def _wait_done(job: submitit.Job, timeout_s: float, poll_s: float = 1.0) -> float:
    """Poll with a forced sacct check until the job is done; return the seconds it took."""
    t0 = time.monotonic()
    while not job.done(force_check=True):
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"job {job.job_id} not done after {timeout_s:.0f}s (state {job.state})")
        time.sleep(poll_s)
    return time.monotonic() - t0


# --- job functions (run on the cluster) -----------------------------------------------------------


def _distributed_sum() -> dict:
    import os

    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo")
    try:
        value = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(value)
        return {
            "rank": env.rank,
            "world_size": env.world_size,
            "local_rank": env.local_rank,
            "sum": float(value.item()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
    finally:
        dist.destroy_process_group()


def _sleep(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "slept"


# --- tests ----------------------------------------------------------------------------------------


def test_two_task_gloo_all_reduce(slurm_executor, slurm_cluster, slurm_job_name, count_jobs, sacct):
    if slurm_cluster.gpus_per_node < 2 or slurm_cluster.cpus_per_node < 2:
        pytest.skip(f"needs 2 GPUs and 2 CPUs on a node, cluster has {slurm_cluster}")
    executor = slurm_executor(tasks_per_node=2, gpus_per_node=2, cpus_per_task=1, timeout_min=5)
    job = executor.submit(_distributed_sum)
    _wait_done(job, QUEUE_WAIT_S + 120)

    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    assert all(r["sum"] == 3.0 for r in results), results
    # the fake GPUs are handed out by SLURM as for real ones
    assert all(r["cuda_visible_devices"] == "0,1" for r in results), results
    with pytest.raises(AssertionError):
        job.result()  # multi-task jobs must use results()

    # one log pair per task, under the quoted folder
    for rank in (0, 1):
        assert job.paths.folder.joinpath(f"{job.job_id}_{rank}_log.out").exists()
        assert job.paths.folder.joinpath(f"{job.job_id}_{rank}_log.err").exists()
    # the result files appear before SLURM has closed the job: sacct may still say RUNNING here
    assert sacct.wait_for_state(job.job_id, ["COMPLETED"], timeout_s=30) == "COMPLETED"
    assert count_jobs(slurm_job_name) == 1
    assert count_jobs(slurm_job_name, states=["COMPLETED"]) == 1


def test_cancel_reaches_cancelled_and_done(slurm_executor, sacct):
    executor = slurm_executor(timeout_min=10)
    job = _no_result_grace(executor.submit(_sleep, 600))
    sacct.wait_for_state(job.job_id, ["RUNNING"], timeout_s=QUEUE_WAIT_S)

    t0 = time.monotonic()
    job.cancel()
    assert sacct.wait_for_state(job.job_id, ["CANCELLED"], timeout_s=15) == "CANCELLED"
    print(f"sacct CANCELLED {time.monotonic() - t0:.1f}s after cancel")

    # done() without forcing: submitit's own sacct polling must notice within a bounded time
    while not job.done():
        assert time.monotonic() - t0 < 60, f"job.done() still False 60s after cancel (state {job.state})"
        time.sleep(0.5)
    print(f"job.done() {time.monotonic() - t0:.1f}s after cancel; job.state={job.state!r}")
    assert job.state.startswith("CANCELLED"), job.state
    with pytest.raises(UncompletedJobError, match="CANCELLED"):
        job.result()


def test_unknown_partition_fails_at_submission(slurm_executor, slurm_job_name, count_jobs):
    executor = slurm_executor(slurm_partition="no_such_partition")
    with pytest.raises(FailedJobError) as excinfo:
        executor.submit(_sleep, 1)
    assert "no_such_partition" in str(excinfo.value) or "partition" in str(excinfo.value).lower()
    assert "partition" in str(excinfo.value).lower()
    assert count_jobs(slurm_job_name) == 0
