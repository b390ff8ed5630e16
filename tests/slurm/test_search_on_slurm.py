"""The whole search against the real one-node SLURM cluster of tests/slurm/testbed.sh.

Nothing is mocked: main.py submits sbatch jobs through submitit, the jobs train the tiny model with
the trial engine, and sacct is the witness for what was submitted. (The plain whole search to a ranked CSV
reads the cluster=auto search of test_auto_cluster.py.)

Time: the timeout test waits out SLURM's shortest time limit. SLURM keeps limits in whole minutes (``sbatch
--time=0:10`` is held as 1:00), so hp_tool's own limit (``max_minutes_per_run``, rounded up to whole minutes for
sbatch) of one minute is the shortest there is, and slurmctld enforces limits in a periodic pass (every 30 s),
so the job ends 60-90 s after it starts. That search (``start_timed_out_search``) therefore starts before the
tests that run beside it (conftest.py's ``timed_out_search``: test_search_interrupt_slurm.py's and this module's
tests) and the timeout test, last here, reads it. So that two jobs fit on the testbed's one node (2 CPUs, 2 fake
GPUs) at once, those tests' searches run one-process trials on a shared node (SHARED_NODE: not exclusive, 1 CPU,
1 GPU, 4 GB each); the multi-process trials that run on SLURM are test_auto_cluster.py's.
"""

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from search_helpers import ledger, main_here  # tests/ is on sys.path (its conftest)

# this module's tests run beside the timeout test's search (conftest.py: beside_timed_out_search)
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("beside_timed_out_search")]

REPO = Path(__file__).resolve().parents[2]
TS = "search_config.train_settings"
# jobs that leave room on the node for a second one (the timed-out search's): 1 of its 2 CPUs, 4 of its 21 GB
SHARE_THE_NODE = ("cluster.slurm.exclusive=false", "cluster.cpus_per_task=1", "cluster.slurm.mem=4G")
ONE_PROCESS = (f"{TS}.gpus_per_node=1", f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.pipeline_parallel_sizes=[1]")
SHARED_NODE = (*SHARE_THE_NODE, *ONE_PROCESS)  # one-process trials (1 fake GPU each) on a shared node


def argv(tmp_path, prefix, *args):
    """main.py's arguments for a gpt3/tiny search on the testbed's partition, results under tmp_path/res."""
    return ["search_config=gpt3/tiny", "cluster=bcm", "cluster.slurm.partition=debug", f"cluster.job_name_prefix={prefix}",
            f"base_results_dir={tmp_path / 'res'}",
            "memory_check=analytic",  # traced on the orchestrator's machine: tests/test_memory_check.py
            *args]


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


def start_timed_out_search(tmp_path: Path) -> SimpleNamespace:
    """The timeout test's search, started as its own process (conftest.py's ``timed_out_search`` starts it before
    the tests that run beside it): its one job's setup line outlives the job's 1-minute limit, so SLURM kills it
    before the trial starts, 60-90 s after it started. ``stop()`` ends the orchestrator and scancels the job."""
    p = prefix()
    cmd = [sys.executable, str(REPO / "main.py"),
           *argv(tmp_path, p, *SHARED_NODE, f"{TS}.limit_search_runs=1", f"{TS}.max_minutes_per_run=1",
                 "cluster.slurm.setup=[sleep 300]")]
    log = tmp_path / "orchestrator.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT)

    def stop():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for entry in ledger(results(tmp_path)):
            if entry.get("job_id"):
                subprocess.run(["scancel", entry["job_id"]], capture_output=True, timeout=30)

    return SimpleNamespace(proc=proc, prefix=p, results=results(tmp_path), log=log, stop=stop)


def test_cancelled_search_gives_cancelled_rows(tmp_path):
    p = prefix()
    common = (*SHARED_NODE, f"{TS}.limit_search_runs=2", "cluster.slurm.setup=[sleep 120]")
    proc = main_here(*argv(tmp_path, p, "detach=true", *common), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cancel=true" in proc.stdout
    proc = main_here(*argv(tmp_path, p, "cancel=true", *common), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deadline = time.time() + 60
    while time.time() < deadline and [s for _, s in sacct_jobs(p)] != ["CANCELLED", "CANCELLED"]:
        time.sleep(2)  # slurmdbd records the cancellation a moment later
    assert [s for _, s in sacct_jobs(p)] == ["CANCELLED", "CANCELLED"]
    proc = main_here(*argv(tmp_path, p, *common), cwd=tmp_path)  # the same command collects
    rows = pd.read_csv(results(tmp_path) / "final_results" / "all_trials_1nodes.csv")
    assert sorted(rows[rows["plan_status"] == "selected"]["status"]) == ["cancelled", "cancelled"]
    assert len(sacct_jobs(p)) == 2  # collecting submitted nothing new


def test_killed_orchestrator_resumes_without_duplicates(tmp_path):
    p = prefix()
    args = argv(tmp_path, p, *SHARED_NODE, f"{TS}.limit_search_runs=3", f"{TS}.search_strategy=exhaustive",
                f"{TS}.max_steps_per_run=6")
    orchestrator = subprocess.Popen([sys.executable, str(REPO / "main.py"), *args], cwd=tmp_path,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ledger_file = results(tmp_path) / "jobs.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        lines = ledger_file.read_text().splitlines() if ledger_file.exists() else []
        if any(json.loads(line)["state"] == "submitted" for line in lines):
            break
        time.sleep(0.5)
    orchestrator.send_signal(signal.SIGKILL)
    orchestrator.wait()

    proc = main_here(*args, cwd=tmp_path)  # the same command again (in this process: the killed one was a process)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = settled_jobs(p, 3)
    names = [name for name, _ in jobs]
    assert len(names) == len(set(names)) == 3, jobs  # every trial submitted exactly once
    rows = pd.read_csv(results(tmp_path) / "final_results" / "all_trials_1nodes.csv")
    assert sorted(rows[rows["plan_status"] == "selected"]["status"]) == ["ok", "ok", "ok"]


def test_bad_partition_fails_before_any_submission(tmp_path):
    p = prefix()
    proc = main_here("search_config=gpt3/tiny", "cluster=bcm", "cluster.slurm.partition=nosuchpart",
                     f"cluster.job_name_prefix={p}", f"base_results_dir={tmp_path / 'res'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "cluster.slurm.partition='nosuchpart'" in proc.stderr and "debug" in proc.stderr
    assert not (results(tmp_path) / "jobs.jsonl").exists()
    assert sacct_jobs(p) == []


def test_job_past_its_time_limit_is_a_timeout_row(timed_out_search):
    """Last in this module: its search (``timed_out_search``) has run beside the tests before it."""
    search = timed_out_search
    assert search.proc.wait(timeout=300) == 1, search.log.read_text()[-3000:]  # no trial succeeded
    rows = pd.read_csv(search.results / "final_results" / "all_trials_1nodes.csv")
    ran = rows[rows["plan_status"] == "selected"]
    assert list(ran["status"]) == ["timeout"]
    assert "TIMEOUT" in ran["reason"].iloc[0]
    assert [state for _, state in settled_jobs(search.prefix, 1)] == ["TIMEOUT"]
