"""A launch session: what the training and the inference search share between planning and collecting.

    backend = prepare_backend(app, jobs)     # the cluster's backend, its preflight passed
    code = LaunchSession(app.cluster, backend, results_dir, ledger_dir, app.detach, app.cancel, ...).launch(jobs)
    if code is None: ...collect...           # every job has ended

The backend's preflight (hp_tool/launch/backends/); the one ``Launcher`` (hp_tool/launch/runner.py) with
its ledger, resume and re-attach;
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

from hp_tool.config import AppConfig, ClusterConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.backends import Backend, backend_for
from hp_tool.launch.job import JobSpec
from hp_tool.launch.ledger import search_id
from hp_tool.launch.monitor import Progress
from hp_tool.launch.runner import Gate, Launcher

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the exit code after Ctrl-C, as a shell reports SIGINT

Hook = Callable[[JobSpec, dict], None]  # after a job ends: (job, its result)

Watch = Callable[[JobSpec, float], Optional[tuple[str, str]]]  # a running job: (stop_reason, reason) to stop it


def prepare_backend(app: AppConfig, jobs: list[JobSpec], backend: Optional[Backend] = None) -> Backend:
    """The backend ``jobs`` run on (``backend`` when given, else the cluster config's), its preflight passed:
    a target that can never run them, or ``detach=true`` where jobs cannot outlive the command, fails
    before any file is written."""
    backend = backend or backend_for(app.cluster, app.gpu)
    backend.preflight(jobs)
    if app.detach and not backend.detachable:
        raise ConfigError("detach", True, f"jobs of cluster.type={app.cluster.type} run on the {backend.kind} "
                          "backend and end with this command", "drop detach=true, or use cluster=bcm")
    return backend


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
    cancel. The caller has run ``prepare_backend`` (the backend's preflight) before writing any file."""

    cluster: ClusterConfig
    backend: Backend  # prepare_backend's
    results_dir: Path  # the search's folder: its search_id is part of every job name
    ledger_dir: Path  # where jobs.jsonl lives: results_dir, or results_dir/inference
    detach: bool = False  # submit and return (a detachable backend only)
    cancel: bool = False  # cancel every job of the folder that has no result yet
    what: str = "trials"  # the jobs in messages: trials, inference configs
    max_parallel: Optional[int] = None  # jobs at once; None: the backend's parallelism
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
        log.info("Launching %d %s on the %s backend", len(jobs), self.what, self.backend.kind)
        progress = Progress()
        launcher = Launcher(self.cluster, self.backend, self.ledger_dir, jobs, progress,
                            search_id(self.results_dir), self.on_end, self.gate, self.watch)
        launcher.resume()
        if self.cancel:
            n = launcher.cancel_all()
            print(f"Cancelled {n} jobs; {len(launcher.pending)} {self.what} were never submitted.")
            return 0
        if self.detach:
            launcher.submit_all_now()
            print(f"Submitted; to watch and collect later run:\n  {same_command()}\n"
                  f"to cancel:\n  {same_command('cancel=true')}")
            return 0
        try:
            with progress:
                launcher.run(self.max_parallel)
        except KeyboardInterrupt:
            kept = "submitted jobs keep running" if self.backend.detachable else \
                f"jobs on the {self.backend.kind} backend may end with this command"
            print(f"\nInterrupted: {kept}. Resume with:\n  {same_command()}\n"
                  f"or cancel them with:\n  {same_command('cancel=true')}", file=sys.stderr)
            raise
        for name, cause in launcher.hook_failures:
            print(f"W&B: {name} was not uploaded ({cause}); its files are complete.", file=sys.stderr)
        return None
