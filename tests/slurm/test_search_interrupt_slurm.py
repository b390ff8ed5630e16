"""Ctrl-C during a search on SLURM (README: "Ctrl-C exits 130, submitted jobs keep running"): SIGINT to the
orchestrator's whole process group, as a terminal sends it; the orchestrator exits 130, the sbatch job
keeps running (SLURM's, not the command's), and the same command again re-attaches to it by its job id,
submits nothing, and collects its result. sacct is the witness. The local-backend twin (SIGINT to the
orchestrator alone) is tests/test_search_interrupt.py.
"""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pandas as pd
import pytest

from hp_tool.contracts.result import request_stop
from hp_tool.vocab import LOSING
from search_helpers import ledger, start, steps, wait_for  # tests/ is on sys.path (its conftest)
from test_search_on_slurm import (REPO, SHARE_THE_NODE, results, sacct_jobs,  # tests/slurm is on sys.path
                                  settled_jobs)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("beside_timed_out_search")]
TS = "search_config.train_settings"
SLURM_WAIT = (120.0, 0.5)  # seconds to wait for a step of the search, and between looks (the scheduler is slower)


def command(tmp_path: Path, prefix: str) -> list[str]:
    """One one-process gpt3/tiny trial that trains until it is asked to stop (or its 4-minute limit). Its job
    shares the node (SHARE_THE_NODE) with the timeout test's, which waits out SLURM's time limit beside this test
    (tests/slurm/conftest.py: timed_out_search)."""
    return [sys.executable, str(REPO / "main.py"), "search_config=gpt3/tiny", "cluster=bcm", "cluster.slurm.partition=debug",
            f"cluster.job_name_prefix={prefix}", f"base_results_dir={tmp_path / 'res'}", "memory_check=analytic",
            *SHARE_THE_NODE,
            f"{TS}.gpus_per_node=1", f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.pipeline_parallel_sizes=[1]",
            f"{TS}.micro_batch_sizes=[2]", f"{TS}.limit_search_runs=1", f"{TS}.search_strategy=exhaustive",
            f"{TS}.stable_cv=0", f"{TS}.max_steps_per_run=1000000", f"{TS}.max_minutes_per_run=4"]


def submitted(res: Path) -> list[dict]:
    return [e for e in ledger(res) if e["state"] == "submitted"]


def test_ctrl_c_exits_130_the_slurm_job_keeps_running_and_the_next_run_reattaches(tmp_path):
    p = f"t{uuid.uuid4().hex[:6]}:"
    res = results(tmp_path)
    started: list[subprocess.Popen] = []
    try:
        first = start(command(tmp_path, p), tmp_path / "first.log")
        started.append(first)
        [entry] = wait_for("submitted job", lambda: submitted(res), first, *SLURM_WAIT)
        out = res / "training_logs" / entry["trial_id"]
        wait_for("trained step", lambda: steps(out) >= 2, first, *SLURM_WAIT)

        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: the orchestrator's whole process group
        said = (tmp_path / "first.log").read_text
        assert first.wait(timeout=60) == 130, said()[-3000:]
        assert "Interrupted: submitted jobs keep running" in said() and "cancel=true" in said()
        trained = steps(out)
        wait_for("step after the interrupt", lambda: steps(out) > trained, None, *SLURM_WAIT)  # the job still trains
        assert [state for _, state in sacct_jobs(p)] == ["RUNNING"]

        log = tmp_path / "second.log"
        second = start(command(tmp_path, p), log)
        started.append(second)
        wait_for("re-attachment", lambda: f"re-attached {entry['trial_id']} to job {entry['job_id']}" in log.read_text(),
                 second, *SLURM_WAIT)
        request_stop(out, LOSING, "asked to stop by the test")  # ends the endless trial after its current step
        assert second.wait(timeout=120) == 0, log.read_text()[-3000:]
    except BaseException:
        for job in submitted(res):  # never leave a job of a failed test running on the cluster
            subprocess.run(["scancel", job["job_id"]], capture_output=True, timeout=30)
        raise
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    assert [e["job_id"] for e in submitted(res)] == [entry["job_id"]]  # submitted once: the second run re-attached
    assert [state for _, state in settled_jobs(p, 1)] == ["COMPLETED"]
    rows = pd.read_csv(res / "final_results" / "all_trials_1nodes.csv")
    [row] = rows[rows["plan_status"] == "selected"].itertuples()
    assert row.status == "ok" and row.steps_run > trained
