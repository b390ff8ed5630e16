"""SLURM's own facts, checked before and during a search on the real testbed: a trial the partition can
never hold is refused before anything is submitted; a queued job that can never start (its only node
drained) or that waits past cluster.max_queue_minutes is cancelled and recorded ``unschedulable``."""

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from search_helpers import main_here  # tests/ is on sys.path (its conftest)
from test_search_on_slurm import SHARED_NODE  # tests/slurm is on sys.path

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
TS = "search_config.train_settings"
ONE_TRIAL = (f"{TS}.limit_search_runs=1", f"{TS}.max_steps_per_run=4")


def main_args(tmp_path, prefix, *args):
    return ["search_config=gpt3/tiny", "cluster=bcm", "cluster.slurm.partition=debug", f"cluster.job_name_prefix={prefix}",
            f"base_results_dir={tmp_path / 'res'}",
            "memory_check=analytic",  # traced on the orchestrator's machine: tests/test_memory_check.py
            *args]


def orchestrator(tmp_path, prefix, *args):
    """The command as a process of its own (the drained-node test acts on the cluster while it runs); the other
    tests run it in this process (search_helpers.main_here)."""
    return [sys.executable, str(REPO / "main.py"), *main_args(tmp_path, prefix, *args)]


def sacct_names(prefix):
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobName,State", "-S", "now-1hours"],
                         capture_output=True, text=True, check=True).stdout
    return [line.split("|") for line in out.splitlines() if line.startswith(prefix)]


@pytest.fixture
def blocker(slurm_cluster):
    """A job holding the whole node, so the next one queues; cancelled at the end in any case."""
    name = f"blk{uuid.uuid4().hex[:6]}"
    job_id = subprocess.run(["sbatch", "--parsable", "--exclusive", "-p", slurm_cluster.partition, "-J", name,
                             "-o", "/dev/null", "--wrap", "sleep 300"],
                            capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    deadline = time.time() + 60
    while time.time() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if state.strip() == "RUNNING":
            break
        time.sleep(0.5)
    yield job_id
    subprocess.run(["scancel", job_id])


def wait_for_submission(tmp_path, timeout=120):
    ledger = tmp_path / "res" / "gpt3" / "tiny" / "jobs.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        lines = ledger.read_text().splitlines() if ledger.exists() else []
        if any(json.loads(line)["state"] == "submitted" for line in lines):
            return
        time.sleep(0.5)
    raise AssertionError("the orchestrator submitted nothing")


def trial_result(tmp_path):
    [path] = (tmp_path / "res" / "gpt3" / "tiny" / "training_logs").glob("*/result.json")
    return json.loads(path.read_text())


def test_a_trial_bigger_than_the_partition_is_refused_before_anything_is_submitted(tmp_path, slurm_cluster):
    p = f"t{uuid.uuid4().hex[:6]}:"
    # gpt3/5b's trials ask for one node of 8 GPUs; the testbed's node has 2 GPUs and 2 CPUs
    proc = main_here(*main_args(tmp_path, p, "search_config=gpt3/5b"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cluster.slurm.partition='debug': can never run gpt3_5b_" in proc.stderr
    assert (f"asks for 1 node(s) with 8 GPUs and 8 CPUs each; the partition has 1 node(s) "
            f"({slurm_cluster.gpus_per_node} GPUs and {slurm_cluster.cpus_per_node} CPUs)") in proc.stderr
    assert not (tmp_path / "res").exists()  # no plan file, no ledger
    assert sacct_names(p) == []


def test_a_job_whose_only_node_is_drained_is_cancelled_as_unschedulable(tmp_path, slurm_cluster, blocker):
    p = f"t{uuid.uuid4().hex[:6]}:"
    search = subprocess.Popen(orchestrator(tmp_path, p, *ONE_TRIAL), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for_submission(tmp_path)  # queued behind the blocker
        subprocess.run(["scontrol", "update", f"nodename={slurm_cluster.node}", "state=drain",
                        "reason=hp_tool test"], check=True)
        subprocess.run(["scancel", blocker], check=True)
        out, err = search.communicate(timeout=300)
    finally:
        search.kill()
        subprocess.run(["scontrol", "update", f"nodename={slurm_cluster.node}", "state=resume"])
    assert search.returncode == 1, err[-3000:]  # no trial succeeded
    result = trial_result(tmp_path)
    assert result["status"] == "unschedulable"
    assert "SLURM can never start job" in result["reason"]
    assert "ReqNodeNotAvail" in result["reason"] or "DRAINED" in result["reason"]  # squeue's words for it
    deadline = time.time() + 60
    while time.time() < deadline and [s.split()[0] for _, s in sacct_names(p)] != ["CANCELLED"]:
        time.sleep(1)
    assert [s.split()[0] for _, s in sacct_names(p)] == ["CANCELLED"]


def test_a_job_queued_past_max_queue_minutes_is_cancelled_with_slurms_reason(tmp_path, blocker):
    p = f"t{uuid.uuid4().hex[:6]}:"
    proc = main_here(*main_args(tmp_path, p, *ONE_TRIAL, "cluster.max_queue_minutes=0.1"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = trial_result(tmp_path)
    assert result["status"] == "unschedulable"
    assert "more than cluster.max_queue_minutes=0.1" in result["reason"] and "Resources" in result["reason"]
    rows = (tmp_path / "res" / "gpt3" / "tiny" / "final_results" / "all_trials_1nodes.csv").read_text()
    assert "unschedulable" in rows


def test_a_submission_cut_between_sbatch_and_submitits_pickle_rename_still_runs(tmp_path, blocker):
    """The cause of a killed-orchestrator run that once ended `failed` on a loaded machine: submitit runs
    sbatch, then renames the job's pickle to <job_id>_submitted.pkl; a kill in between leaves a queued job
    that waits 60 s for that file and fails. The state such a kill leaves is made here exactly (jobs held
    back by the blocker, so none starts early), then the same command resumes. The two trials are one-process
    jobs that share the node (SHARED_NODE), so both run at once once the blocker is gone."""
    p = f"t{uuid.uuid4().hex[:6]}:"
    args = (*SHARED_NODE, f"{TS}.limit_search_runs=2", f"{TS}.max_steps_per_run=4", f"{TS}.search_strategy=exhaustive")
    detached = main_here(*main_args(tmp_path, p, *args, "detach=true"), cwd=tmp_path)
    assert detached.returncode == 0, detached.stderr[-3000:]
    out = tmp_path / "res" / "gpt3" / "tiny"
    lines = (out / "jobs.jsonl").read_text().splitlines()
    cut = json.loads(lines[1])  # the first trial's "submitted" line: the kill came before it
    assert cut["state"] == "submitted"
    folder = Path(cut["folder"])
    (folder / f"{cut['job_id']}_submitted.pkl").rename(folder / f"{uuid.uuid4().hex}.pkl")
    (out / "jobs.jsonl").write_text("\n".join(lines[:1] + lines[2:]) + "\n")
    subprocess.run(["scancel", blocker], check=True)

    proc = main_here(*main_args(tmp_path, p, *args), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = (out / "final_results" / "all_trials_1nodes.csv").read_text()
    statuses = [json.loads(path.read_text())["status"] for path in (out / "training_logs").glob("*/result.json")]
    assert statuses == ["ok", "ok"], rows
    names = [name for name, _ in sacct_names(p)]
    assert len(names) == len(set(names)) == 2  # each trial submitted once
