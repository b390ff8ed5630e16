"""launch_scripts/*.sbatch on the real SLURM testbed with the tiny model."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from hp_tool.contracts.spec import load_spec

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


README_TRAIN = re.compile(r"sbatch --nodes=\d+ --ntasks-per-node=\d+ --gpus-per-node=\d+ "
                          r"launch_scripts/train\.sbatch \S+")


def tiny_full_config(tmp_path) -> tuple:
    """A full-mode config as the results step writes it, shortened to a few steps."""
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.planner import make_plan
    from hp_tool.contracts.spec import dump_spec

    cfg, name = compose(["search_config=gpt3/tiny"])
    base = make_plan(to_app_config(cfg), name, tmp_path / "plan").base
    base.run.max_steps = 4
    base.run.output_dir = str(tmp_path / "train_out")
    dump_spec(base, tmp_path / "optimal.yaml")
    assert load_spec(tmp_path / "optimal.yaml").run.mode == "full"
    (tmp_path / "launch_scripts").symlink_to(REPO / "launch_scripts")  # README's relative path
    return base, "optimal.yaml"


def run_as_readme(tmp_path, command: str):
    args = shlex.split(command)
    args.insert(1, "--wait")  # block until the job ends; otherwise the line as README shows it
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHON": sys.executable})
    logs = "".join(p.read_text() for p in tmp_path.glob("hp_tool_train_*.out"))
    return proc, logs


def test_train_sbatch_runs_exactly_as_readme_shows(tmp_path):
    from hp_tool.results.optimal import train_sbatch_command

    [shown] = README_TRAIN.findall((REPO / "README.md").read_text())
    base, config = tiny_full_config(tmp_path)
    command = train_sbatch_command(base, config)  # what the optimal config's header prints
    assert README_TRAIN.fullmatch(command), (command, shown)
    assert re.sub(r"\d+", "N", command.rsplit(" ", 1)[0]) == re.sub(r"\d+", "N", shown.rsplit(" ", 1)[0])
    proc, logs = run_as_readme(tmp_path, command)
    assert proc.returncode == 0, proc.stderr + logs[-3000:]
    result = yaml.safe_load((tmp_path / "train_out" / "result.json").read_text())
    world = base.parallel.tp * base.parallel.pp * base.parallel.dp
    assert result["status"] == "ok" and result["steps_run"] == 4 and result["world_size"] == world == 2


def test_train_sbatch_with_the_wrong_task_count_says_how_to_submit(tmp_path):
    _, config = tiny_full_config(tmp_path)
    proc, logs = run_as_readme(tmp_path, f"sbatch --nodes=1 --ntasks-per-node=1 launch_scripts/train.sbatch {config}")
    assert proc.returncode != 0
    assert "needs 1 node(s) x 2 tasks; this job has 1 node(s) and 1 tasks" in logs
    assert "sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=2" in logs
    assert not (tmp_path / "train_out").exists()
