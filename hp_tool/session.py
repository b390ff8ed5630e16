"""A launch session: what the training and the inference search share between planning and collecting.

    kind = executor_kind(app, jobs)          # slurm or local; on SLURM the target is checked first
    code = LaunchSession(app, kind, results_dir, ledger_dir, ...).launch(jobs)
    if code is None: ...collect...           # every job has ended

The SLURM preflight; the one ``Launcher`` (hp_tool/launch/runner.py) with its ledger, resume and re-attach;
and what the command line asks of a session: ``detach=true`` submits and returns, ``cancel=true`` cancels
every job of the folder, Ctrl-C leaves submitted jobs running and says how to resume or cancel them. What
the jobs are, what happens after each one ends and how the results are read belong to each search. The
results folder's lock (hp_tool/launch/lock.py) is held by the command (hp_tool/cli.py) around the plan's
files and both searches, a dry run included, so it is taken there, not here.
"""

from __future__ import annotations

import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from hp_tool.config import AppConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.executors import resolve_kind
from hp_tool.launch.job import JobSpec
from hp_tool.launch.ledger import search_id
from hp_tool.launch.monitor import Progress
from hp_tool.launch.runner import Launcher
from hp_tool.launch.slurm import check_slurm_target

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the exit code after Ctrl-C, as a shell reports SIGINT

Hook = Callable[[JobSpec, dict], None]  # after a job ends: (job, its result)
Gate = Callable[[JobSpec], Optional[tuple[str, str]]]  # before a submission: (status, reason) to skip it
Watch = Callable[[JobSpec, float], Optional[tuple[str, str]]]  # a running job: (stop_reason, reason) to stop it


def preflight(app: AppConfig, jobs: list[JobSpec]) -> None:
    """SLURM: the partition and account exist and can ever hold each job (ConfigError otherwise)."""
    per_task = app.cluster.cpus_per_task or 1  # unset: the node's CPUs are shared, at least one each
    check_slurm_target(app.cluster, [(j.name, j.num_nodes, j.tasks_per_node, j.tasks_per_node * per_task)
                                     for j in jobs])


def executor_kind(app: AppConfig, jobs: list[JobSpec], kind: Optional[str] = None) -> str:
    """`slurm` or `local` for ``jobs`` (``kind`` when given, else executors.resolve_kind); on SLURM the
    partition and account are checked to hold each job, so a target that can never run them fails
    before any file is written."""
    kind = kind or resolve_kind(app, [(j.num_nodes, j.tasks_per_node) for j in jobs])
    if kind == "slurm":
        preflight(app, jobs)
    return kind


def chain(*hooks: Optional[Hook]) -> Hook:
    """One after-job hook that calls each of ``hooks`` (None: skipped) in turn."""
    def on_end(job: JobSpec, result: dict) -> None:
        for hook in hooks:
            if hook is not None:
                hook(job, result)
    return on_end


def same_command(extra: str = "") -> str:
    """This command line again (without detach= and cancel=), plus ``extra``: to resume or cancel."""
    args = [a for a in sys.argv[1:] if not a.startswith(("detach=", "cancel="))]
    return " ".join(["python3", "main.py", *map(shlex.quote, args), extra]).strip()


@dataclass
class LaunchSession:
    """One search's jobs through the one launcher, as the command line asks: run to the end, detach or
    cancel. The caller has run ``executor_kind`` (the SLURM preflight) before writing any file."""

    app: AppConfig
    kind: str  # slurm | local (executor_kind)
    results_dir: Path  # the search's folder: its search_id is part of every job name
    ledger_dir: Path  # where jobs.jsonl lives: results_dir, or results_dir/inference
    what: str = "trials"  # the jobs in messages: trials, inference configs
    max_parallel: Optional[int] = None  # jobs at once; None: the cluster's limit
    on_end: Optional[Hook] = None
    gate: Optional[Gate] = None
    watch: Optional[Watch] = None

    def launch(self, jobs: list[JobSpec]) -> Optional[int]:
        """Submit, resume, detach or cancel ``jobs``. None once every job has ended (the caller collects);
        else the command's exit code: 0 when it only detached or cancelled, INTERRUPTED after Ctrl-C
        (submitted jobs keep running; the message says how to resume or cancel them)."""
        try:
            return self._launch(jobs)
        except KeyboardInterrupt:
            return INTERRUPTED

    def _launch(self, jobs: list[JobSpec]) -> Optional[int]:
        """``launch`` without the Ctrl-C exit code: KeyboardInterrupt propagates."""
        if self.kind != "slurm" and self.app.detach:
            raise ConfigError("detach", True, "a detached search needs SLURM (local jobs die with the shell)",
                              "drop detach=true, or use cluster=bcm")
        log.info("Launching %d %s with the %s executor", len(jobs), self.what, self.kind)
        progress = Progress()
        launcher = Launcher(self.app, self.ledger_dir, jobs, self.kind, progress, search_id(self.results_dir),
                            self.on_end, self.gate, self.watch)
        launcher.resume()
        if self.app.cancel:
            n = launcher.cancel_all()
            print(f"Cancelled {n} jobs; {len(launcher.pending)} {self.what} were never submitted.")
            return 0
        if self.app.detach:
            launcher.submit_all_now()
            print(f"Submitted; to watch and collect later run:\n  {same_command()}\n"
                  f"to cancel:\n  {same_command('cancel=true')}")
            return 0
        try:
            with progress:
                launcher.run(self.max_parallel)
        except KeyboardInterrupt:
            print(f"\nInterrupted: submitted jobs keep running. Resume with:\n  {same_command()}\n"
                  f"or cancel them with:\n  {same_command('cancel=true')}", file=sys.stderr)
            raise
        for name, cause in launcher.hook_failures:
            print(f"W&B: {name} was not uploaded ({cause}); its files are complete.", file=sys.stderr)
        return None
