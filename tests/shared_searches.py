"""The tiny training searches several tests read, each run once per test session (one search, many asserts):

``readme_tiny_search``: README's main command (``python3 main.py search_config=gpt3/tiny cluster=local``),
    shortened to 2 trials (exhaustive), as a process of its own: the suite's smoke test of the local backend (its
    warm process, two-process trials, the default traced memory check); then the same command again (the CLI's
    entry in this process), which must submit nothing. Read by tests/test_launch.py (the run and its resume, the
    traced memory beside the measured peak) and tests/test_results_report.py (the report.md a real search writes).
``one_layout_gbs_reruns``: gpt3/tiny with one layout (TP 1, PP 1, MBS 2, no checkpointing, one process) in this
    process (cluster=in_process): at global batch 8 with W&B on and its directory broken, then at global batch 16.
    Read by tests/test_results_integrity.py (a search that W&B cannot log to completes; a changed global batch runs
    the trial again and keeps the old result aside).
``llama_tiny_search``: llama/tiny's training search (3 trials, exhaustive) and its inference search in one command
    (the CLI's entry in this process, cluster=local: the trials and inference configs run as processes of their
    own, 2 each). Read by tests/test_llama_planning.py (the ranked trials, the optimal config that trains, the
    inference configs that ran).

Each fixture keeps each command's exit code and output (``Run``), which its readers assert on first, so a failed
search fails each reader with the search's own output; and the ledger's submissions after each run. Readers only
read the results folder (a test that writes there copies it first). The local searches run in this process share
one warm process (``warm_process``): what each would start and end by itself, its forks taking each job's own
environment and folder. No tests here."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
TS = "search_config.train_settings"
IS = "search_config.inference_settings"

__all__ = ["warm_process", "readme_tiny_search", "one_layout_gbs_reruns", "llama_tiny_search"]


@dataclass(frozen=True)
class Run:
    """One command of a fixture: its exit code, what it printed, the ledger's submissions after it and the
    summary table (final_summary_1nodes.csv) it left, as they were before the fixture's next command."""

    returncode: int
    stdout: str
    stderr: str
    submitted: int
    summary: Optional[str]  # final_summary_1nodes.csv's text, None when there is none

    def summary_frame(self) -> pd.DataFrame:
        return pd.read_csv(io.StringIO(self.summary))

    @property
    def output(self) -> str:
        """The end of what the command printed: the message of a reader's first assert."""
        return self.stdout[-3000:] + self.stderr[-3000:]


@dataclass(frozen=True)
class Searched:
    """A fixture's commands in order (``runs``) and the search's results folder."""

    results: Path
    runs: tuple[Run, ...]

    @property
    def final(self) -> Path:
        return self.results / "final_results"


@dataclass(frozen=True)
class OneLayoutReruns(Searched):
    """``one_layout_gbs_reruns``: its two searches, and what the first one left before the second ran."""

    old_result: Optional[str] = None  # the trial's result.json after the first search (global batch 8)


def _run(results: Path, returncode: int, stdout: str, stderr: str) -> Run:
    """A command's Run, read from ``results`` as the command left it."""
    from hp_tool.launch.ledger import Ledger

    summary = results / "final_results" / "final_summary_1nodes.csv"
    return Run(returncode, stdout, stderr, len(Ledger(results).submissions()),
               summary.read_text() if summary.exists() else None)


@pytest.fixture(scope="session")
def warm_process():
    """The warm process local CPU jobs fork from (hp_tool/launch/backends/warm.py), started once for the searches
    run in this process: search_helpers.main_here leaves a warm process it did not start running."""
    from hp_tool.launch.backends import warm

    warm.start()


# README's main command, 2 trials: the predicted fastest two, DP 2 on 2 CPU processes each
README_SEARCH = ["search_config=gpt3/tiny", "cluster=local", f"{TS}.limit_search_runs=2",
                 f"{TS}.search_strategy=exhaustive"]


@pytest.fixture(scope="session")
def readme_tiny_search(tmp_path_factory, warm_process) -> Searched:
    """README's main command as a process (the real command line: its own interpreter and warm process, the
    local backend), then the same command through the CLI's entry in this process (a resume: nothing to run)."""
    from search_helpers import main_here

    base = tmp_path_factory.mktemp("readme_tiny")
    argv = [*README_SEARCH, f"base_results_dir={base / 'res'}"]
    results = base / "res" / "gpt3" / "tiny"
    proc = subprocess.run([sys.executable, str(REPO / "main.py"), *argv], cwd=base, capture_output=True, text=True,
                          timeout=600)
    runs = [_run(results, proc.returncode, proc.stdout, proc.stderr)]
    if proc.returncode == 0:
        again = main_here(*argv, cwd=base)
        runs.append(_run(results, again.returncode, again.stdout, again.stderr))
    return Searched(results, tuple(runs))


# one layout of gpt3/tiny: a single one-process trial, 6 steps
ONE_LAYOUT = (f"{TS}.micro_batch_sizes=[2]", f"{TS}.act_ckpt_layers=[0]", f"{TS}.max_steps_per_run=6")
ONE_LAYOUT_TRIAL = "gpt3_241k_tp1_pp1_mbs2_ac0_torch_z0_noff"


@pytest.fixture(scope="session")
def one_layout_gbs_reruns(tmp_path_factory) -> Searched:
    """ONE_LAYOUT in this process (search_helpers.search_here): first at global batch 8 (gpt3/tiny's own) with
    W&B on (offline) and WANDB_DIR a file, where W&B cannot write; then the same folder at global batch 16 (W&B
    off). ``runs[i].stderr``: what each search wrote to stderr; ``old_result``: the trial's result.json after the
    first search, as it was then (a reader compares the one set aside with it)."""
    from search_helpers import search_here

    base = tmp_path_factory.mktemp("one_layout")
    broken = base / "not_a_dir"
    broken.write_text("a file where W&B wants a folder")
    runs = []
    saved = {key: os.environ.get(key) for key in ("WANDB_MODE", "WANDB_DIR")}
    err = io.StringIO()
    try:
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(broken))
        with contextlib.redirect_stderr(err):
            code, results = search_here(base, *ONE_LAYOUT, f"{TS}.global_batch_size=8", "wandb.enable=true")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    runs.append(_run(results, code, "", err.getvalue()))
    result = results / "training_logs" / ONE_LAYOUT_TRIAL / "result.json"
    old_result = result.read_text() if result.exists() else None
    if code == 0:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code, _ = search_here(base, *ONE_LAYOUT, f"{TS}.global_batch_size=16")
        runs.append(_run(results, code, "", err.getvalue()))
    return OneLayoutReruns(results, tuple(runs), old_result)


# llama/tiny: 3 training trials (exhaustive, 6 steps), then the inference search at batch 2 (TP 1 and TP 2)
LLAMA_SEARCH = ["search_config=llama/tiny", "cluster=local", f"{TS}.limit_search_runs=3", f"{TS}.max_steps_per_run=6",
                f"{TS}.search_strategy=exhaustive", "run_inference_hp_search=true", f"{IS}.max_batch_sizes=[2]"]


@pytest.fixture(scope="session")
def llama_tiny_search(tmp_path_factory, warm_process) -> Searched:
    """LLAMA_SEARCH through the CLI's entry in this process (the orchestrating process is not what its readers
    test; the local backend's trials and inference configs run as processes of their own)."""
    from search_helpers import main_here

    base = tmp_path_factory.mktemp("llama_tiny")
    results = base / "res" / "llama" / "tiny"
    proc = main_here(*LLAMA_SEARCH, f"base_results_dir={base / 'res'}", cwd=base)
    return Searched(results, (_run(results, proc.returncode, proc.stdout, proc.stderr),))
