"""launch_scripts/*.sbatch on the real SLURM testbed with the tiny model."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from hp_tool.trial.spec import load_spec

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def sbatch_wait(tmp_path, *args, timeout=400):
    env_python = f"PYTHON={sys.executable}"
    return subprocess.run(["sbatch", "--wait", f"--export=ALL,{env_python}", f"--chdir={tmp_path}", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def test_search_sbatch_runs_the_orchestrator_as_a_batch_job(tmp_path):
    # the whole search inside one allocation: the orchestrator job runs its trials with the local executor
    proc = sbatch_wait(tmp_path, "--cpus-per-task=2", "--ntasks=1",
                       f"--export=ALL,HP_TOOL_MAIN={REPO / 'main.py'},PYTHON={sys.executable}", str(REPO / "launch_scripts" / "search.sbatch"), "search_config=gpt3/tiny", "cluster=local",
                       "search_config.train_settings.limit_search_runs=1", f"base_results_dir={tmp_path / 'res'}")
    logs = "".join(p.read_text() for p in tmp_path.glob("hp_tool_search_*.out"))
    assert proc.returncode == 0, proc.stderr + logs[-3000:]
    summary = pd.read_csv(tmp_path / "res" / "gpt3" / "tiny" / "final_results" / "final_summary_1nodes.csv")
    assert list(summary["status"]) == ["ok"]
    assert "Recommended:" in logs


def test_train_sbatch_trains_a_config_with_srun(tmp_path):
    # a full-mode config as the results step writes it, shortened to a few steps
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.planner import make_plan
    from hp_tool.trial.spec import dump_spec

    cfg, name = compose(["search_config=gpt3/tiny"])
    plan = make_plan(to_app_config(cfg), name, tmp_path / "plan")
    base = plan.base
    base.run.max_steps = 4
    base.run.output_dir = str(tmp_path / "train_out")
    dump_spec(base, tmp_path / "optimal.yaml")
    assert load_spec(tmp_path / "optimal.yaml").run.mode == "full"

    world = base.parallel.tp * base.parallel.pp * base.parallel.dp
    proc = sbatch_wait(tmp_path, "--nodes=1", f"--ntasks-per-node={world}", f"--gpus-per-node={world}",
                       str(REPO / "launch_scripts" / "train.sbatch"), str(tmp_path / "optimal.yaml"))
    logs = "".join(p.read_text() for p in tmp_path.glob("hp_tool_train_*.out"))
    assert proc.returncode == 0, proc.stderr + logs[-3000:]
    result = yaml.safe_load((tmp_path / "train_out" / "result.json").read_text())
    assert result["status"] == "ok" and result["steps_run"] == 4 and result["world_size"] == world
