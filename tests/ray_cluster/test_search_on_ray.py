"""The whole search on a real Ray cluster (tests/ray_cluster/head.sh: one machine, 4 CPUs, no GPU).

Nothing is mocked: main.py submits Ray jobs through Ray's job API, each job's driver runs the trial as a Ray Train
run of 2 workers (the tiny model's 2 CPU processes), and the job API is the witness for what was submitted."""

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

from search_helpers import interruptible, main_here  # tests/ is on sys.path (its conftest)

REPO = Path(__file__).resolve().parents[2]
# two trials, two at once: each is a Ray Train run of 2 workers, 1 CPU each, on the head's 4
SMALL = ("search_config.train_settings.limit_search_runs=2", "search_config.train_settings.max_steps_per_run=8",
         "search_config.train_settings.search_strategy=exhaustive", "memory_check=analytic")


def main_args(tmp_path, address, prefix, *args) -> list[str]:
    return ["search_config=gpt3/tiny", "cluster=ray", f"cluster.ray.address={address}", f"cluster.job_name_prefix={prefix}",
            f"base_results_dir={tmp_path / 'res'}", *SMALL, *args]


def main_command(tmp_path, address, prefix, *args) -> list[str]:
    return [sys.executable, str(REPO / "main.py"), *main_args(tmp_path, address, prefix, *args)]


def run_main(tmp_path, address, prefix, *args):
    """The command, run as the CLI runs it but in this process (search_helpers.main_here): the Ray jobs are what
    these tests watch; the Ctrl-C'd command is a process of its own (main_command)."""
    return main_here(*main_args(tmp_path, address, prefix, *args), cwd=tmp_path)


def jobs_of(client, prefix):
    """The Ray jobs whose submission id starts with ``prefix`` (as the backend writes it)."""
    mark = prefix.replace(":", "-")
    return [j for j in client.list_jobs() if (j.submission_id or "").startswith(mark)]


def table(tmp_path) -> pd.DataFrame:
    return pd.read_csv(next((tmp_path / "res").glob("**/final_results/all_trials_1nodes.csv")))


@pytest.fixture(scope="module")
def interrupted_search(tmp_path_factory, ray_address, ray_client):
    """The tiny search (SMALL), Ctrl-C'd once both trials are submitted, then the same command again to the end.
    One search, two readers: the interrupt test reads both commands; the ranking test reads what the search left,
    which is what the same search run straight through leaves (its jobs run to the end either way: the first
    command submits them, the second follows them to their results and ranks them)."""
    tmp_path = tmp_path_factory.mktemp("ray_search")
    prefix = f"hpt{uuid.uuid4().hex[:6]}:"
    first = subprocess.Popen(main_command(tmp_path, ray_address, prefix), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    deadline = time.time() + 120
    while len(jobs_of(ray_client, prefix)) < 2 and time.time() < deadline and first.poll() is None:
        time.sleep(0.5)
    try:
        first.send_signal(signal.SIGINT)
        output, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    jobs_after_interrupt = jobs_of(ray_client, prefix)
    second = run_main(tmp_path, ray_address, prefix)
    return SimpleNamespace(tmp_path=tmp_path, prefix=prefix, first=first, first_output=output,
                           jobs_after_interrupt=jobs_after_interrupt, second=second)


def test_a_tiny_search_ranks_ok_trials_that_ran_as_ray_train_workers(interrupted_search, ray_client):
    tmp_path, prefix, proc = interrupted_search.tmp_path, interrupted_search.prefix, interrupted_search.second
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = table(tmp_path).query("status == 'ok'")
    assert len(launched) == 2
    jobs = jobs_of(ray_client, prefix)
    assert len(jobs) == 2 and {str(j.status).rsplit(".", 1)[-1] for j in jobs} == {"SUCCEEDED"}
    for job in jobs:
        assert "--workers 2" in job.entrypoint
        assert "RayTrainWorker" in ray_client.get_job_logs(job.submission_id)  # the trial ran in Ray's workers
    for out in (tmp_path / "res").glob("**/result.json"):
        result = json.loads(out.read_text())
        if result.get("status") == "ok":
            assert result["world_size"] == 2 and result["steps_run"] >= 3
    optimal = next((tmp_path / "res").glob("**/final_results/optimal_config_*.yaml")).read_text()
    assert "# Train on Ray: ray job submit" in optimal and "hp_tool.launch.backends.ray_driver" in optimal


def test_an_interrupted_search_is_followed_again_and_never_submitted_twice(interrupted_search, ray_client):
    """Ctrl-C once both trials are submitted: the orchestrator exits 130 and the Ray jobs keep running; the same
    command again finds each live job by its name and waits for it instead of submitting it again."""
    search = interrupted_search
    assert search.first.returncode == 130, search.first_output[-3000:]
    live = [j for j in search.jobs_after_interrupt if str(j.status).rsplit(".", 1)[-1] in ("PENDING", "RUNNING")]
    assert len(search.jobs_after_interrupt) == 2 and live  # submitted, and not stopped by the interrupt
    second = search.second
    assert second.returncode == 0, second.stderr[-3000:]
    assert "re-attached" in second.stderr + second.stdout
    assert len(jobs_of(ray_client, search.prefix)) == 2  # none submitted twice
    assert (table(search.tmp_path).status == "ok").sum() == 2


def test_a_detached_search_returns_at_once_and_cancel_stops_its_jobs(tmp_path, ray_address, ray_client):
    """detach=true submits and returns; cancel=true stops the search's live jobs (each then reads as cancelled)."""
    prefix = f"hpt{uuid.uuid4().hex[:6]}:"
    assert run_main(tmp_path, ray_address, prefix, "detach=true").returncode == 0
    proc = run_main(tmp_path, ray_address, prefix, "cancel=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Cancelled 2 jobs" in proc.stdout + proc.stderr
    deadline = time.time() + 60
    while time.time() < deadline and any(str(j.status).rsplit(".", 1)[-1] != "STOPPED"
                                         for j in jobs_of(ray_client, prefix)):
        time.sleep(0.5)
    assert {str(j.status).rsplit(".", 1)[-1] for j in jobs_of(ray_client, prefix)} == {"STOPPED"}
    results = [json.loads(r.read_text()) for r in (tmp_path / "res").glob("**/training_logs/*/result.json")]
    assert [r["status"] for r in results] == ["cancelled", "cancelled"]


def test_a_trial_whose_workers_need_a_gpu_the_cluster_lacks_is_unschedulable(tmp_path, ray_address, ray_client):
    prefix = f"hpt{uuid.uuid4().hex[:6]}:"
    proc = run_main(tmp_path, ray_address, prefix, "cluster.ray.gpus_per_worker=1")
    rows = table(tmp_path).query("status == 'unschedulable'")
    assert len(rows) == 2, proc.stderr[-3000:]
    assert all("need 2 GPU and the Ray cluster has 0 in all" in reason for reason in rows.reason)


def test_a_cluster_that_does_not_answer_is_named_before_anything_is_written(tmp_path, ray_address):
    proc = run_main(tmp_path, "http://127.0.0.1:9", f"hpt{uuid.uuid4().hex[:6]}:")
    assert proc.returncode == 2
    assert "cluster.ray.address" in proc.stderr and "http://127.0.0.1:9" in proc.stderr
    assert not (tmp_path / "res").exists()
