"""cluster=auto (the default) on a machine where SLURM answers: the search runs its trials as sbatch jobs.

The no-SLURM branch (auto falls back to this machine) is tests/test_backends.py's; this is the other one,
against the real one-node cluster of tests/slurm/testbed.sh, with no cluster= on the command line and no
partition (SLURM's default partition takes the job). sacct is the witness.

One search, two readers: the whole tiny search to a ranked CSV (once a test of its own with cluster=bcm
cluster.slurm.partition=debug in test_search_on_slurm.py) reads the same search as the auto test; both run their
trials through the same SLURM backend, the auto one with one more thing to check.
"""

import json
import uuid
from types import SimpleNamespace

import pandas as pd
import pytest

from search_helpers import main_here  # tests/ is on sys.path (its conftest)
from test_search_on_slurm import results, settled_jobs  # tests/slurm is on sys.path (rootdir imports)

pytestmark = pytest.mark.slurm
TS = "search_config.train_settings"


@pytest.fixture(scope="module")
def auto_search(tmp_path_factory):
    """Two gpt3/tiny trials (exhaustive: the two fastest predicted) with the default cluster (auto) and no partition,
    run as the CLI runs it, in this process (search_helpers.main_here; the trials are SLURM jobs)."""
    tmp_path = tmp_path_factory.mktemp("auto_search")
    p = f"t{uuid.uuid4().hex[:6]}:"
    proc = main_here("search_config=gpt3/tiny", f"cluster.job_name_prefix={p}", f"base_results_dir={tmp_path / 'res'}",
                     "memory_check=analytic", f"{TS}.limit_search_runs=2", f"{TS}.search_strategy=exhaustive",
                     f"{TS}.max_steps_per_run=6", cwd=tmp_path)
    return SimpleNamespace(proc=proc, prefix=p, results=results(tmp_path), jobs=settled_jobs(p, 2))


def test_default_cluster_auto_submits_the_trials_to_slurm_when_sinfo_answers(auto_search):
    proc, p = auto_search.proc, auto_search.prefix
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on the slurm backend" in proc.stdout + proc.stderr

    ledger = [json.loads(line) for line in (auto_search.results / "jobs.jsonl").read_text().splitlines()]
    submitted = {e["trial_id"]: e for e in ledger if e["state"] == "submitted"}
    assert [e["kind"] for e in submitted.values()] == ["slurm", "slurm"]
    for name, state in auto_search.jobs:  # sbatch ran them, under the search's job names
        assert name.startswith(p) and name.rsplit(":", 1)[-1] in submitted and state == "COMPLETED"
    assert sorted(name.rsplit(":", 1)[-1] for name, _ in auto_search.jobs) == sorted(submitted)
    rows = pd.read_csv(auto_search.results / "final_results" / "all_trials_1nodes.csv")
    assert list(rows[rows["plan_status"] == "selected"]["status"]) == ["ok", "ok"]


def test_whole_tiny_search_on_slurm_to_ranked_csv(auto_search):
    proc = auto_search.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = pd.read_csv(auto_search.results / "final_results" / "final_summary_1nodes.csv")
    assert len(summary) == 2
    assert list(summary["full_run_step_time_s"]) == sorted(summary["full_run_step_time_s"])
    assert sorted(state for _, state in auto_search.jobs) == ["COMPLETED", "COMPLETED"]
