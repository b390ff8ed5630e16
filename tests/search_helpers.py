"""Searches of gpt3/tiny run in the test process on the in-process backend (cluster=in_process), one process
per trial; the real-subprocess searches (cluster=local) build their own command lines; ``start``, ``wait_for``,
``ledger`` and ``steps`` watch such a search from outside (the Ctrl-C tests, local and SLURM). No tests here."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from hp_tool.cli import compose, results_dir, run
from hp_tool.config import AppConfig, to_app_config
from hp_tool.vocab import LEDGER_FILE, METRICS_FILE

TS = "search_config.train_settings"
ONE_PROCESS = (f"{TS}.gpus_per_node=1", f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.pipeline_parallel_sizes=[1]")


def in_process_app(tmp_path: Path, *overrides: str) -> tuple[AppConfig, str]:
    """gpt3/tiny on cluster=in_process with one-process trials, results under tmp_path/res, plus overrides."""
    cfg, name = compose(["search_config=gpt3/tiny", "cluster=in_process", "memory_check=analytic", *ONE_PROCESS,
                         f"base_results_dir={tmp_path / 'res'}", *overrides])
    return to_app_config(cfg), name


def search_here(tmp_path: Path, *overrides: str) -> tuple[int, Path]:
    """Run the command `python3 main.py` would, in this process; returns (exit code, results folder)."""
    app, name = in_process_app(tmp_path, *overrides)
    return run(app, name), results_dir(app, name)


def interruptible() -> None:
    """``preexec_fn`` of an orchestrator a test Ctrl-Cs: SIGINT at its default, as a command typed at a terminal
    has it, whatever the test run inherited. A test run started as a shell's background job ignores SIGINT, its
    children inherit the ignored signal, and Python then installs no KeyboardInterrupt handler: the orchestrator
    would never see the Ctrl-C the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """The orchestrator in its own session (so a test can Ctrl-C its process group), its output in ``log``:
    a file, not a pipe, which the job it starts would hold open past its exit; Ctrl-C reaches it as at a
    terminal (``interruptible``)."""
    with log.open("w") as sink:
        return subprocess.Popen(cmd, cwd=log.parent, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=interruptible)


def wait_for(what: str, check, proc: Optional[subprocess.Popen] = None, timeout_s: float = 60.0,
             interval_s: float = 0.2):
    """``check()``'s first true value; fails when ``proc`` (the orchestrator) exits first or at the deadline."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the orchestrator exited {proc.returncode} while waiting for {what}")
        time.sleep(interval_s)
    pytest.fail(f"no {what} after {timeout_s:.0f} s")


def ledger(results: Path) -> list[dict]:
    """The search's ledger lines (jobs.jsonl), none before its first submission."""
    path = results / LEDGER_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps(out: Path) -> int:
    """Steps a trial has logged in its metrics.jsonl."""
    path = out / METRICS_FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


def main_here(*argv: str, cwd: Optional[Path] = None, env: Optional[dict] = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """``python3 main.py *argv`` run in this process (the CLI's own entry: argument checks, Hydra, exit codes),
    as ``subprocess.run(..., capture_output=True, text=True)`` would return it: without the 3-5 s a new Python
    spends importing Hydra and hp_tool. ``cwd`` and ``env`` (variables added) hold for the call only; the
    logging Hydra configures (to this call's stdout) is undone after it, and the warm process a command that
    would launch trials starts (hp_tool/launch/backends/warm.py: a forkserver with this call's environment and
    directory) is ended with it, as it would end with the process. A command still running after ``timeout``
    seconds is stopped with ``subprocess.TimeoutExpired``, as ``subprocess.run`` would (a SIGALRM: call it from
    the main thread, as pytest runs tests)."""
    import contextlib
    import io
    import logging
    import os
    import signal
    import sys
    from multiprocessing import forkserver

    from hydra.core.global_hydra import GlobalHydra

    from hp_tool.cli import main

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    argv0, cwd0, env0 = sys.argv, os.getcwd(), dict(os.environ)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    warm_before = server._forkserver_pid is not None
    code = 0

    expired_at: list[float] = []

    def expired(signum, frame):
        expired_at.append(timeout)
        raise subprocess.TimeoutExpired(["main.py", *argv], timeout, out.getvalue(), err.getvalue())

    alarm = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        sys.argv = ["main.py", *argv]
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:  # what the process would exit with
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        sys.argv = argv0
        os.chdir(cwd0)
        os.environ.clear()
        os.environ.update(env0)
        root.handlers[:] = handlers  # Hydra's dictConfig replaced them
        root.setLevel(level)
        GlobalHydra.instance().clear()
        if not warm_before and server._forkserver_pid is not None:  # killed: a clean stop waits for its imports
            os.kill(server._forkserver_pid, signal.SIGKILL)
            server._stop()
    if expired_at:  # raised inside the command, which may have caught it (Hydra prints it and exits 1)
        raise subprocess.TimeoutExpired(["main.py", *argv], timeout, out.getvalue(), err.getvalue())
    return subprocess.CompletedProcess(["main.py", *argv], code, out.getvalue(), err.getvalue())
