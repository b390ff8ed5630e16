"""launch_scripts/*.sbatch on the real SLURM testbed with the tiny model."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pandas as pd
import pytest
import yaml

from hp_tool.contracts.spec import load_spec

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
FINAL_STATES = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "TIMEOUT")


def job_end(job_id: str, timeout: float) -> tuple[str, str]:
    """(state, exit code "N:S") once the job has ended: slurmctld's word (scontrol), sacct's once slurmctld
    has forgotten the job."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", info))
        if not fields:
            acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
                                  capture_output=True, text=True).stdout.split()
            fields = dict(zip(("JobState", "ExitCode"), acct[0].split("|"))) if acct else {}
        state = fields.get("JobState", "").split()[0] if fields.get("JobState") else ""
        if state in FINAL_STATES:
            return state, fields.get("ExitCode", "0:0")
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end within {timeout:.0f} s")


def submit_and_wait(args: list[str], cwd: Path, env: Optional[dict] = None,
                    timeout: float = 400) -> subprocess.CompletedProcess:
    """``sbatch --wait <args>`` as its exit code goes (the job's exit code; 1 for a job that did not complete
    with one), but looked at every 0.5 s: sbatch's own --wait sleeps 2 s and then four times longer each time
    up to 32 s (10 s for a 5-s job, 42 s for a 12-s one), which is most of these tests' time. The job is
    submitted with --parsable in place of --wait; otherwise the line is unchanged."""
    proc = subprocess.run([args[0], "--parsable", *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=env)
    if proc.returncode != 0:
        return proc
    state, exit_code = job_end(proc.stdout.strip().split(";")[0], timeout)
    status, _, signal_number = exit_code.partition(":")
    code = int(status) or (128 + int(signal_number) if signal_number and int(signal_number) else 0)
    returncode = code or (0 if state == "COMPLETED" else 1)
    return subprocess.CompletedProcess(proc.args, returncode, proc.stdout, proc.stderr + f"job {state} {exit_code}")


def sbatch_wait(tmp_path, *args, timeout=400):
    env_python = f"PYTHON={sys.executable}"
    return submit_and_wait(["sbatch", f"--export=ALL,{env_python}", f"--chdir={tmp_path}", *args], tmp_path,
                           timeout=timeout)


def test_search_sbatch_runs_the_orchestrator_as_a_batch_job(tmp_path):
    # the whole search inside one allocation: the orchestrator job runs its trials with the local executor
    proc = sbatch_wait(tmp_path, "--cpus-per-task=2", "--ntasks=1",
                       f"--export=ALL,HP_TOOL_MAIN={REPO / 'main.py'},PYTHON={sys.executable}",
                       str(REPO / "launch_scripts" / "search.sbatch"), "search_config=gpt3/tiny", "cluster=local",
                       "search_config.train_settings.limit_search_runs=1",
                       "search_config.train_settings.max_steps_per_run=6",
                       "memory_check=analytic",  # traced on the orchestrator's machine: tests/test_memory_check.py
                       f"base_results_dir={tmp_path / 'res'}")
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
    args = shlex.split(command)  # the line as README shows it; submit_and_wait blocks until the job ends
    proc = submit_and_wait(args, tmp_path, env={**os.environ, "PYTHON": sys.executable})
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
