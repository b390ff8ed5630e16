"""Ctrl-C during a search (README: "Ctrl-C exits 130"; hp_tool/session.py): the orchestrator exits 130 and
says how to resume or cancel; a job that outlives it keeps running, and the same command again re-attaches
to it instead of submitting it a second time, then collects its result.

On this machine (cluster=local) a job is a submitit controller process, re-attached by its pid. A terminal's
Ctrl-C reaches the whole foreground process group, controllers included (so local jobs "may end with this
command"); here SIGINT goes to the orchestrator alone, as ``kill -INT <pid>`` sends it, and the job outlives
it. tests/slurm/test_search_interrupt_slurm.py sends it to the whole group, where SLURM's jobs outlive it
anyway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from hp_tool.contracts.result import request_stop
from hp_tool.vocab import LOSING
from search_helpers import ledger, start, steps, wait_for

REPO = Path(__file__).resolve().parent.parent
TS = "search_config.train_settings"


def command(tmp_path: Path) -> list[str]:
    """One one-process gpt3/tiny trial that trains until it is asked to stop (or its 2-minute limit)."""
    return [sys.executable, str(REPO / "main.py"), "search_config=gpt3/tiny", "cluster=local",
            f"base_results_dir={tmp_path / 'res'}", "memory_check=analytic", f"{TS}.gpus_per_node=1",
            f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.pipeline_parallel_sizes=[1]", f"{TS}.micro_batch_sizes=[2]",
            f"{TS}.limit_search_runs=1", f"{TS}.search_strategy=exhaustive", f"{TS}.stable_cv=0",
            f"{TS}.max_steps_per_run=1000000", f"{TS}.max_minutes_per_run=2"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.e2e
def test_sigint_exits_130_the_job_keeps_running_and_the_next_run_reattaches_to_it(tmp_path):
    results = tmp_path / "res" / "gpt3" / "tiny"
    started: list[subprocess.Popen] = []
    job_pid = None
    try:
        first = start(command(tmp_path), tmp_path / "first.log")
        started.append(first)
        entry = wait_for("submitted job", lambda: next((e for e in ledger(results) if e["state"] == "submitted"),
                                                       None), proc=first)
        job_pid, out = int(entry["job_id"]), results / "training_logs" / entry["trial_id"]
        wait_for("trained step", lambda: steps(out) >= 2, proc=first)

        first.send_signal(signal.SIGINT)  # the orchestrator alone, not its job
        said = (tmp_path / "first.log").read_text
        assert first.wait(timeout=60) == 130, said()[-3000:]
        assert "Interrupted:" in said() and "Resume with:" in said() and "cancel=true" in said()
        trained = steps(out)
        wait_for("step after the interrupt", lambda: steps(out) > trained)  # the job still trains
        assert alive(job_pid) and not (out / "result.json").exists()

        log = tmp_path / "second.log"
        second = start(command(tmp_path), log)
        started.append(second)
        wait_for("re-attachment", lambda: f"re-attached {entry['trial_id']} to job {job_pid}" in log.read_text(),
                 proc=second)
        request_stop(out, LOSING, "asked to stop by the test")  # ends the endless trial after its current step
        assert second.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if job_pid is not None and alive(job_pid):
            os.kill(job_pid, signal.SIGTERM)

    submitted = [e for e in ledger(results) if e["state"] == "submitted"]
    assert [e["job_id"] for e in submitted] == [str(job_pid)]  # submitted once: the second run re-attached
    rows = pd.read_csv(results / "final_results" / "all_trials_1nodes.csv")
    [row] = rows[rows["plan_status"] == "selected"].itertuples()
    assert row.status == "ok" and row.steps_run > trained
