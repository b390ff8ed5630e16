"""Local CPU jobs started from the warm process (hp_tool/launch/backends/warm.py): each rank gets submitit's
local environment and its own log files named by the job id, a job past its limit is signalled and then
killed, a cancelled job stops, and a job outlives the object that started it. Real processes on this
machine."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from hp_tool.launch.backends import warm
from hp_tool.launch.job import SubmititEntry

pytestmark = pytest.mark.e2e


def record_env(config_path: str) -> None:
    """A job's entry: write what this rank sees, and print to its log."""
    rank = os.environ["RANK"]
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_LOCAL_JOB_ID")
    Path(config_path, f"rank{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
    print(f"rank {rank} ran")


def sleep_until_signalled(config_path: str) -> None:
    """A job's entry that ignores nothing: it records the limit's signal and keeps running until killed."""
    def note(signum, _frame):
        Path(config_path, f"signal{os.environ['RANK']}").write_text(str(signum))

    signal.signal(signal.SIGUSR2, note)
    while True:
        time.sleep(0.05)


def spec(tmp_path: Path, entry, tasks: int, timeout_s: float = 60, signal_delay_s: float = 1) -> warm.WarmSpec:
    # the submitter's own process-group variables (as a one-process trial run in its process leaves them)
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "LOCAL_RANK": "0", "RANK": "0"}
    return warm.WarmSpec(SubmititEntry(entry), str(tmp_path), str(tmp_path / "job"), tasks, timeout_s,
                         signal_delay_s, env, os.getcwd())


def wait_done(job, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not job.done():
        assert time.time() < deadline, "the job did not end"
        time.sleep(0.05)


def test_each_rank_gets_the_distributed_environment_and_its_own_logs(tmp_path):
    job = warm.submit(spec(tmp_path, record_env, tasks=2))
    wait_done(job)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["RANK"] for s in seen] == ["0", "1"] and {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert {s["SUBMITIT_LOCAL_JOB_ID"] for s in seen} == {job.job_id}
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and seen[0]["MASTER_PORT"]
    assert (tmp_path / "job" / f"{job.job_id}_1_log.out").read_text().strip() == "rank 1 ran"
    assert job.state == "FINISHED"


def test_a_job_past_its_limit_is_signalled_then_killed(tmp_path):
    started = time.time()
    job = warm.submit(spec(tmp_path, sleep_until_signalled, tasks=2, timeout_s=3, signal_delay_s=1.5))
    wait_done(job, timeout_s=30)
    assert 3 <= time.time() - started < 15
    assert all((tmp_path / f"signal{r}").read_text() == str(int(signal.SIGUSR2)) for r in (0, 1))


def test_a_cancelled_job_stops_its_tasks(tmp_path):
    job = warm.submit(spec(tmp_path, sleep_until_signalled, tasks=2))
    time.sleep(1.0)
    job.cancel()
    wait_done(job, timeout_s=20)
    assert not any((tmp_path / f"signal{r}").exists() for r in (0, 1))  # stopped, not timed out
