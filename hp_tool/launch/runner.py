"""Submit trials in the planner's order, throttled; watch them; resume from the ledger; never submit twice.

One poll loop watches every job (submitit's SLURM watcher batches the sacct/squeue calls) with back-off.
Every trial ends with a result.json: the engine's own, or one written here from the job's end state.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import submitit

from hp_tool.config import AppConfig
from hp_tool.launch import job as jobmod
from hp_tool.launch.executors import job_name, make_executor, timeout_min
from hp_tool.launch.ledger import Entry, Ledger
from hp_tool.launch.monitor import Progress
from hp_tool.trial.spec import TrialSpec

log = logging.getLogger(__name__)

GRACE_S = 300.0  # past a job's time limit before it is cancelled and recorded as timeout
POLL_MIN_S, POLL_MAX_S = 1.0, 15.0


class PidJob:
    """A local job started by an earlier orchestrator, followed by its controller's pid."""

    def __init__(self, job_id: str):
        self.job_id = job_id

    def done(self) -> bool:
        try:
            os.kill(int(self.job_id), 0)
        except (ProcessLookupError, ValueError):
            return True
        except PermissionError:
            return False
        return False

    @property
    def state(self) -> str:
        return "FINISHED" if self.done() else "RUNNING"

    def cancel(self) -> None:
        try:
            os.kill(int(self.job_id), 15)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class Active:
    spec: TrialSpec
    job: Any
    folder: Path
    submitted: float
    running_since: Optional[float] = None

    @property
    def out(self) -> Path:
        return Path(self.spec.run.output_dir)


def _pid_alive(job_id: Optional[str]) -> bool:
    return job_id is not None and not PidJob(job_id).done()


def find_slurm_job(name: str) -> Optional[str]:
    """Job id of a job with this name (queued, running or finished in the last week), if any."""
    for cmd in (["squeue", "-h", "-o", "%i", "-n", name],
                ["sacct", "-n", "-X", "-P", "--name", name, "-o", "JobID", "-S", "now-7days"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        ids = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if out.returncode == 0 and ids:
            return ids[-1]
    return None


class Launcher:
    def __init__(self, app: AppConfig, results_dir: Path, specs: list[TrialSpec], kind: str,
                 progress: Progress, on_trial_end: Optional[Callable[[TrialSpec, dict], None]] = None):
        self.app, self.kind, self.progress = app, kind, progress
        self.results_dir = results_dir
        self.specs = specs
        self.ledger = Ledger(results_dir)
        self.on_trial_end = on_trial_end
        self.pending: list[TrialSpec] = []
        self.active: list[Active] = []
        self.submissions = 0

    def spec_path(self, spec: TrialSpec) -> Path:
        return self.results_dir / "candidate_configs" / f"{spec.trial_id}.yaml"

    def folder(self, spec: TrialSpec) -> Path:
        return Path(spec.run.output_dir) / "job"

    # ---- resume ----
    def resume(self) -> None:
        """Sort every trial into done (has a result), re-attached (job alive), or pending."""
        latest = self.ledger.latest()
        for spec in self.specs:
            self.progress.add(spec.trial_id)
            result = jobmod.read_result(Path(spec.run.output_dir))
            if result is not None:
                self.progress.update(spec.trial_id, result.get("status", "failed"), result)
                continue
            attached = self._reattach(spec, latest.get(spec.trial_id))
            if attached:
                self.active.append(attached)
            else:
                self.pending.append(spec)

    def _reattach(self, spec: TrialSpec, entry: Optional[Entry]) -> Optional[Active]:
        if entry is None:
            return None
        job_id = entry.job_id
        if job_id is None and entry.kind == "slurm":  # killed between sbatch and the ledger line
            job_id = find_slurm_job(job_name(self.app.cluster, spec.trial_id))
        if job_id is None:
            return None
        if entry.kind == "slurm":
            job = submitit.SlurmJob(folder=self.folder(spec), job_id=job_id, tasks=range(entry.tasks))
        elif _pid_alive(job_id):
            job = PidJob(job_id)
        else:
            return None  # a local job that died with its orchestrator: run it again
        log.info("re-attached %s to job %s", spec.trial_id, job_id)
        return Active(spec, job, self.folder(spec), entry.time)

    # ---- submit ----
    def submit(self, spec: TrialSpec) -> None:
        folder = self.folder(spec)
        tasks = spec.resources.num_nodes * spec.resources.gpus_per_node
        self.ledger.append(Entry(spec.trial_id, "submitting", kind=self.kind, folder=str(folder), tasks=tasks))
        executor = make_executor(self.kind, folder, spec, self.app.cluster)
        try:
            job = executor.submit(jobmod.trial_job, str(self.spec_path(spec)))
        except Exception as exc:  # sbatch refused it: record, do not retry blindly
            if self.submissions == 0:
                raise
            result = jobmod.write_job_failure(Path(spec.run.output_dir), spec.trial_id, "failed",
                                              f"submission failed: {type(exc).__name__}: {exc}")
            self._ended(spec, None, result)
            return
        self.submissions += 1
        self.ledger.append(Entry(spec.trial_id, "submitted", job_id=str(job.job_id), kind=self.kind,
                                 folder=str(folder), tasks=tasks))
        self.active.append(Active(spec, job, folder, time.time()))
        self.progress.update(spec.trial_id, "pending")

    def submit_all_now(self) -> None:
        while self.pending:
            self.submit(self.pending.pop(0))

    # ---- watch ----
    def run(self) -> None:
        """Submit (throttled by max_parallel_runs) and watch until every trial has ended."""
        delay = POLL_MIN_S
        while self.pending or self.active:
            while self.pending and len(self.active) < self.app.cluster.max_parallel_runs:
                self.submit(self.pending.pop(0))
            changed = self.poll()
            delay = POLL_MIN_S if changed else min(POLL_MAX_S, delay * 1.5)
            if self.active:
                time.sleep(delay)

    def poll(self) -> bool:
        changed = False
        if self.kind == "slurm" and self.active:
            # one sacct call refreshes every job's state; submitit's own refresh can lag by minutes
            self.active[0].job.watcher.update()
        for a in list(self.active):
            if a.job.done():
                self.active.remove(a)
                self._finish(a)
                changed = True
                continue
            state = str(a.job.state)
            if state.startswith("RUNNING") and a.running_since is None:
                a.running_since = time.time()
                self.progress.update(a.spec.trial_id, "running")
                changed = True
            if a.running_since and time.time() - a.running_since > timeout_min(a.spec) * 60 + GRACE_S:
                log.warning("trial %s outlived its limit by %.0f s: cancelling", a.spec.trial_id, GRACE_S)
                a.job.cancel()
                self.active.remove(a)
                result = jobmod.write_job_failure(a.out, a.spec.trial_id, "timeout",
                                                  "job did not end within its time limit plus grace")
                self._ended(a.spec, a, result)
        return changed

    def _finish(self, a: Active) -> None:
        result = jobmod.read_result(a.out)
        if result is None:
            status, reason = self._end_state(a)
            result = jobmod.write_job_failure(a.out, a.spec.trial_id, status, reason)
        self._ended(a.spec, a, result)

    def _end_state(self, a: Active) -> tuple[str, str]:
        if self.kind == "slurm":
            tail = jobmod.log_tail(a.folder, str(a.job.job_id))
            return jobmod.classify_slurm_end(str(a.job.state), tail)
        elapsed = time.time() - (a.running_since or a.submitted)
        if elapsed >= timeout_min(a.spec) * 60 - 1:
            return "timeout", f"local job reached its {timeout_min(a.spec)}-minute limit without a result"
        tail = jobmod.log_tail(a.folder, str(a.job.job_id))
        return "failed", f"local job ended without a result; log tail: {tail}" if tail else \
            "local job ended without a result"

    def _ended(self, spec: TrialSpec, a: Optional[Active], result: dict) -> None:
        job_id = None if a is None else str(a.job.job_id)
        self.ledger.append(Entry(spec.trial_id, result.get("status", "failed"), job_id=job_id, kind=self.kind,
                                 reason=result.get("reason")))
        self.progress.update(spec.trial_id, result.get("status", "failed"), result)
        if self.on_trial_end:
            self.on_trial_end(spec, result)

    # ---- cancel ----
    def cancel_all(self) -> int:
        """Cancel every job of this search that has no result yet; returns how many."""
        n = 0
        for a in self.active:
            a.job.cancel()
            jobmod.write_job_failure(a.out, a.spec.trial_id, "cancelled", "cancelled by the user")
            self.ledger.append(Entry(a.spec.trial_id, "cancelled", job_id=str(a.job.job_id), kind=self.kind))
            n += 1
        self.active.clear()
        return n
