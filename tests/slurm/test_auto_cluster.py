"""cluster=auto (the default) on a machine where SLURM answers: the search runs its trials as sbatch jobs.

The no-SLURM branch (auto falls back to this machine) is tests/test_backends.py's; this is the other one,
against the real one-node cluster of tests/slurm/testbed.sh, with no cluster= on the command line and no
partition (SLURM's default partition takes the job). sacct is the witness.
"""

import json
import subprocess
import sys
import uuid

import pandas as pd
import pytest

from test_search_on_slurm import REPO, results, settled_jobs  # tests/slurm is on sys.path (rootdir imports)

pytestmark = pytest.mark.slurm


def test_default_cluster_auto_submits_the_trials_to_slurm_when_sinfo_answers(tmp_path):
    p = f"t{uuid.uuid4().hex[:6]}:"
    cmd = [sys.executable, str(REPO / "main.py"), "search_config=gpt3/tiny", f"cluster.job_name_prefix={p}",
           f"base_results_dir={tmp_path / 'res'}", "memory_check=analytic",
           "search_config.train_settings.limit_search_runs=1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on the slurm backend" in proc.stdout + proc.stderr

    ledger = [json.loads(line) for line in (results(tmp_path) / "jobs.jsonl").read_text().splitlines()]
    submitted = [e for e in ledger if e["state"] == "submitted"]
    assert [e["kind"] for e in submitted] == ["slurm"]
    [(name, state)] = settled_jobs(p, 1)  # sbatch ran it, under the search's job name
    assert name.startswith(p) and name.endswith(f":{submitted[0]['trial_id']}") and state == "COMPLETED"
    rows = pd.read_csv(results(tmp_path) / "final_results" / "all_trials_1nodes.csv")
    assert list(rows[rows["plan_status"] == "selected"]["status"]) == ["ok"]
