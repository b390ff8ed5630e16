"""The whole search against the real one-node SLURM cluster of tests/slurm/testbed.sh.

Nothing is mocked: main.py submits sbatch jobs through submitit, the jobs train the tiny model with
the trial engine, and sacct is the witness for what was submitted.
"""

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def run_main(tmp_path, prefix, *args, timeout=400):
    cmd = [sys.executable, str(REPO / "main.py"), "search_config=gpt3/tiny", "cluster=bcm",
           "cluster.partition=debug", f"cluster.job_name_prefix={prefix}", f"base_results_dir={tmp_path / 'res'}",
           "memory_check=analytic",  # traced on the orchestrator's machine: tests/test_memory_check.py
           *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def sacct_jobs(prefix):
    """(name, state) of every job whose name starts with prefix."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobName,State", "-S", "now-1hours"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if line.startswith(prefix)]
    return [(name, state.split()[0]) for name, state in rows]


def settled_jobs(prefix, n, timeout=60):
    """sacct's view once it lists n jobs that all ended: a job's result can land before SLURM closes it."""
    deadline = time.time() + timeout
    jobs = sacct_jobs(prefix)
    while time.time() < deadline and (len(jobs) < n or any(s in ("PENDING", "RUNNING", "COMPLETING")
                                                           for _, s in jobs)):
        time.sleep(1)
        jobs = sacct_jobs(prefix)
    return jobs


def prefix():
    return f"t{uuid.uuid4().hex[:6]}:"


def results(tmp_path):
    return tmp_path / "res" / "gpt3" / "tiny"


def test_whole_tiny_search_on_slurm_to_ranked_csv(tmp_path):
    p = prefix()
    proc = run_main(tmp_path, p, "search_config.train_settings.limit_search_runs=2",
                    "search_config.train_settings.search_strategy=exhaustive")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = pd.read_csv(results(tmp_path) / "final_results" / "final_summary_1nodes.csv")
    assert len(summary) == 2
    assert list(summary["full_run_step_time_s"]) == sorted(summary["full_run_step_time_s"])
    jobs = settled_jobs(p, 2)
    assert sorted(state for _, state in jobs) == ["COMPLETED", "COMPLETED"]


def test_job_past_its_time_limit_is_a_timeout_row(tmp_path):
    p = prefix()
    # the job's setup line outlives the 1-minute limit, so SLURM kills it before the trial starts
    proc = run_main(tmp_path, p, "search_config.train_settings.limit_search_runs=1",
                    "search_config.train_settings.max_minutes_per_run=1", "cluster.setup=[sleep 300]")
    assert proc.returncode == 1  # no trial succeeded
    rows = pd.read_csv(results(tmp_path) / "final_results" / "all_trials_1nodes.csv")
    ran = rows[rows["plan_status"] == "selected"]
    assert list(ran["status"]) == ["timeout"]
    assert "TIMEOUT" in ran["reason"].iloc[0]
    assert [state for _, state in settled_jobs(p, 1)] == ["TIMEOUT"]


def test_cancelled_search_gives_cancelled_rows(tmp_path):
    p = prefix()
    common = ("search_config.train_settings.limit_search_runs=2", "cluster.setup=[sleep 120]")
    proc = run_main(tmp_path, p, "detach=true", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cancel=true" in proc.stdout
    proc = run_main(tmp_path, p, "cancel=true", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deadline = time.time() + 60
    while time.time() < deadline and [s for _, s in sacct_jobs(p)] != ["CANCELLED", "CANCELLED"]:
        time.sleep(2)  # slurmdbd records the cancellation a moment later
    assert [s for _, s in sacct_jobs(p)] == ["CANCELLED", "CANCELLED"]
    proc = run_main(tmp_path, p, *common)  # the same command collects
    rows = pd.read_csv(results(tmp_path) / "final_results" / "all_trials_1nodes.csv")
    assert sorted(rows[rows["plan_status"] == "selected"]["status"]) == ["cancelled", "cancelled"]
    assert len(sacct_jobs(p)) == 2  # collecting submitted nothing new


def test_killed_orchestrator_resumes_without_duplicates(tmp_path):
    p = prefix()
    args = ("search_config.train_settings.limit_search_runs=3", "search_config.train_settings.search_strategy=exhaustive")
    cmd = [sys.executable, str(REPO / "main.py"), "search_config=gpt3/tiny", "cluster=bcm",
           "cluster.partition=debug", f"cluster.job_name_prefix={p}", f"base_results_dir={tmp_path / 'res'}", *args]
    orchestrator = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ledger = results(tmp_path) / "jobs.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        lines = ledger.read_text().splitlines() if ledger.exists() else []
        if any(json.loads(line)["state"] == "submitted" for line in lines):
            break
        time.sleep(0.5)
    orchestrator.send_signal(signal.SIGKILL)
    orchestrator.wait()

    proc = run_main(tmp_path, p, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = settled_jobs(p, 3)
    names = [name for name, _ in jobs]
    assert len(names) == len(set(names)) == 3, jobs  # every trial submitted exactly once
    rows = pd.read_csv(results(tmp_path) / "final_results" / "all_trials_1nodes.csv")
    assert sorted(rows[rows["plan_status"] == "selected"]["status"]) == ["ok", "ok", "ok"]


def test_bad_partition_fails_before_any_submission(tmp_path):
    p = prefix()
    cmd = [sys.executable, str(REPO / "main.py"), "search_config=gpt3/tiny", "cluster=bcm",
           "cluster.partition=nosuchpart", f"cluster.job_name_prefix={p}", f"base_results_dir={tmp_path / 'res'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cluster.partition='nosuchpart'" in proc.stderr and "debug" in proc.stderr
    assert not (results(tmp_path) / "jobs.jsonl").exists()
    assert sacct_jobs(p) == []
