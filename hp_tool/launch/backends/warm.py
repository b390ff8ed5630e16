"""Local jobs started from a warm process: the tasks of a CPU job fork from one process that has already
imported the trial engine (torch, transformers' model classes, hp_tool's trial code), so a trial no longer
spends seconds importing before its first step.

The layout mirrors submitit's local executor, which the other local jobs use: one controller process per job
(its pid is the job id, which a restarted orchestrator follows), one task process per rank with submitit's
local environment (``SUBMITIT_LOCAL_*``, so the job's ``SubmititEntry`` exports torch.distributed's variables
as under submitit), its output in ``<folder>/<job id>_<rank>_log.out|err``, the time-limit signal
(SIGUSR2) ``signal_delay_s`` before the limit and the tasks killed at it, SIGTERM forwarded to the tasks. The
controllers are forked by a forkserver started once per orchestrator, which imports ``PRELOAD``; each job
takes the orchestrator's environment and working directory of the moment it is submitted.

Only for jobs whose device is the host (``gpu=cpu``): a process must not fork after CUDA's driver was touched.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# what every CPU trial, and every memory-check worker (hp_tool/memory_check.py), imports first
PRELOAD = ("hp_tool.launch.job", "hp_tool.trial.train", "hp_tool.trial.trace.extrapolate")
KILL_GRACE_S = 1.0  # between the interrupt and the kill of a task still running at the limit
POLL_S = 0.05
# torch.distributed's variables a task sets from its job's environment; the submitter's own (left by a trial it
# ran in its process) describe another process group. A MASTER_PORT the user set is kept.
INHERITED_RANKS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")

_context = None


def context():
    """The forkserver context of this orchestrator, preloading the trial engine (started on first use): a
    fresh interpreter, none of the orchestrator's state, whose forks start with the engine imported."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


def forks_trials(gpu_name: str) -> bool:
    """Whether a trial on this machine forks from the warm process: CPU processes do (``gpu=cpu``); GPU trials
    start through submitit, which hands each its GPU."""
    return gpu_name == "cpu"


def start() -> None:
    """Start the forkserver now: its imports of ``PRELOAD`` (seconds) run in the background while the caller
    plans, instead of before the first trial or trace."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


@dataclass(frozen=True)
class WarmSpec:
    """What a warm job's controller needs: the entry and its argument, the tasks, the limits, and the
    orchestrator's environment and working directory at submission."""

    entry: Callable[[str], Any]  # module-level (picklable), e.g. SubmititEntry(trial_job)
    config_path: str
    folder: str  # the job's log folder
    tasks: int
    timeout_s: float
    signal_delay_s: float
    env: dict
    cwd: str


class WarmJob:
    """A warm job as the launcher sees it (submitit's LocalJob: job id, done, state, cancel)."""

    def __init__(self, process):
        self._process = process
        self.job_id = str(process.pid)

    def done(self) -> bool:
        return not self._process.is_alive()

    @property
    def state(self) -> str:
        if not self.done():
            return "RUNNING"
        return "FINISHED" if self._process.exitcode == 0 else "FAILED"

    def cancel(self) -> None:
        try:  # as submitit's local job: the controller interrupts its tasks, then kills what still runs
            os.kill(self._process.pid, signal.SIGINT)
        except ProcessLookupError:
            pass


def submit(spec: WarmSpec) -> WarmJob:
    """Start ``spec``'s controller from the warm process; it outlives this call."""
    process = context().Process(target=_controller, args=(spec,), name="hp_tool-job", daemon=False)
    process.start()
    # a job outlives its orchestrator (Ctrl-C, a killed orchestrator: the next run re-attaches by the pid), so
    # multiprocessing must not join it when this interpreter exits, as it does with the children it tracks
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
    return WarmJob(process)


def _controller(spec: WarmSpec) -> None:
    """One job: fork its tasks, signal them before the limit, kill them at it, forward SIGTERM."""
    os.environ.clear()
    os.environ.update(spec.env)
    os.chdir(spec.cwd)
    job_id = os.getpid()
    folder = Path(spec.folder)
    folder.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    tasks = [_fork_task(spec, job_id, rank, folder) for rank in range(spec.tasks)]

    def forward(signum, _frame) -> None:
        _signal_all(tasks, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C or cancel: the tasks end with it
    start = time.monotonic()
    signalled = False
    try:
        while _alive(tasks):
            elapsed = time.monotonic() - start
            if not signalled and elapsed >= spec.timeout_s - spec.signal_delay_s:
                _signal_all(tasks, signal.SIGUSR2)  # the engine stops after its current step and writes a result
                signalled = True
            if elapsed >= spec.timeout_s:
                break
            time.sleep(POLL_S)
    finally:
        if _alive(tasks):
            _signal_all(tasks, signal.SIGINT)
            time.sleep(KILL_GRACE_S)
            _signal_all(tasks, signal.SIGKILL)
        _alive(tasks)  # reap


def _fork_task(spec: WarmSpec, job_id: int, rank: int, folder: Path) -> dict:
    out = open(folder / f"{job_id}_{rank}_log.out", "a")
    err = open(folder / f"{job_id}_{rank}_log.err", "a")
    pid = os.fork()
    if pid:
        out.close()
        err.close()
        return {"pid": pid, "code": None}
    code = 1
    try:  # the task: never returns
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for key in INHERITED_RANKS:  # the submitter's own process-group variables (a trial it ran in-process)
            os.environ.pop(key, None)
        os.environ.update(SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID=str(job_id),
                          SUBMITIT_LOCAL_NTASKS=str(spec.tasks), SUBMITIT_LOCAL_GLOBALID=str(rank),
                          SUBMITIT_LOCAL_LOCALID=str(rank), SUBMITIT_LOCAL_NODEID="0",
                          SUBMITIT_LOCAL_JOB_NUM_NODES="1")
        spec.entry(spec.config_path)
        code = 0
    except BaseException:  # noqa: BLE001 - the task's end: its traceback goes to its log, its code to the job
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _alive(tasks: list[dict]) -> bool:
    """Reap the tasks that ended; whether any still runs."""
    for task in tasks:
        if task["code"] is None:
            try:
                pid, status = os.waitpid(task["pid"], os.WNOHANG)
            except ChildProcessError:
                task["code"] = -1
                continue
            if pid:
                task["code"] = os.waitstatus_to_exitcode(status)
    return any(task["code"] is None for task in tasks)


def _signal_all(tasks: list[dict], signum: int) -> None:
    for task in tasks:
        if task["code"] is None:
            try:
                os.kill(task["pid"], signum)
            except ProcessLookupError:
                pass
