"""The one launcher, for training trials and inference configs alike (both described by JobSpec): submit in
the given order, throttled; watch every job in one poll loop; resume from the ledger; never submit twice.

Where jobs run is the backend's business (hp_tool/launch/backends/); the launcher only asks it.

Every job ends with a result.json: its own, or one written here from the job's end state (the backend's
end state, a time limit counted from the job's start, a pending reason that means it can never start,
``cluster.max_queue_minutes``, or the user's cancel). Results and ledger lines carry the job's
fingerprint: on resume, a result or a queued job of a different configuration is set aside (kept in
``<output_dir>/stale-<time>/``) or cancelled, and the job runs again.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

from hp_tool.config import ClusterConfig
from hp_tool.contracts.result import request_stop
from hp_tool.launch import job as jobmod
from hp_tool.launch.backends.base import Backend, Handle
from hp_tool.launch.job import JobSpec, job_name
from hp_tool.launch.ledger import Entry, Ledger
from hp_tool.launch.monitor import Progress
from hp_tool.contracts import phases
from hp_tool.vocab import FAILURE_DIR, METRICS_FILE, NOT_LAUNCHED, RESULT_FILE, STOP_REQUEST_FILE

log = logging.getLogger(__name__)

GRACE_S = 300.0  # past a job's time limit (from its start) before it is cancelled and recorded as timeout
RESULT_FILES = (RESULT_FILE, METRICS_FILE, FAILURE_DIR, STOP_REQUEST_FILE)  # what a stale result consists of


@dataclass
class Active:
    job: JobSpec
    handle: Handle
    submitted: float
    running_since: Optional[float] = None
    stop_requested: bool = False

    @property
    def job_id(self) -> str:
        return str(self.handle.job_id)


class Gate(Protocol):
    """Asked before a submission: (status, reason) to not submit the job, that verdict its result. ``inputs``:
    the settings its decisions depend on beside the trials' outcomes (JSON values); a resumed search keeps
    a verdict recorded under the same inputs, and asks again only about jobs never decided, or decided
    under other inputs."""

    inputs: dict

    def __call__(self, job: JobSpec) -> Optional[tuple[str, str]]: ...


def next_poll_delay(delay: float, changed: bool, ceiling: float, floor: float) -> float:
    """Seconds until the next look at the jobs: back to ``floor`` (the backend's ``min_poll_s``) after a
    change, else 1.5x longer, at most ``ceiling`` (its ``max_poll_s``)."""
    return floor if changed else min(ceiling, delay * 1.5)


def set_aside(out: Path) -> Optional[Path]:
    """Move a stale result (result.json, metrics.jsonl, rank failures, phase logs) to <out>/stale-<time>/;
    kept, never deleted. Returns the new folder, or None when there was nothing to move."""
    present = [out / name for name in RESULT_FILES if (out / name).exists()] + sorted(out.glob(phases.FILE_GLOB))
    if not present:
        return None
    target = out / f"stale-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}"
    target.mkdir(parents=True)
    for path in present:
        shutil.move(str(path), str(target / path.name))
    return target


class Launcher:
    """Launch ``jobs`` on ``backend`` (hp_tool/launch/backends/) as ``cluster`` limits them; the ledger lives
    in ``ledger_dir``. ``on_end(job, result)`` runs after each job ends; its failures are logged and listed in
    ``hook_failures``, never stopping the search. ``gate(job)``, asked just before each submission, may
    return (status, reason) instead: the job is not submitted and that verdict is its result (the adaptive
    search's skipped and pruned_after_oom), recorded in the ledger with the gate's ``inputs``; a resumed
    search keeps it under the same inputs and asks again only about jobs never decided. ``watch(job, submitted)``, asked
    about each running job as it is polled, may return (stop_reason, reason): the job is asked to stop after
    its current step (contracts.result.request_stop) and ends with its measurement (the adaptive search's
    losing trials); ``submitted``: when the job was submitted (older metrics belong to an earlier run)."""

    def __init__(self, cluster: ClusterConfig, backend: Backend, ledger_dir: Path, jobs: list[JobSpec],
                 progress: Progress, search_id: str, on_end: Optional[Callable[[JobSpec, dict], None]] = None,
                 gate: Optional[Gate] = None,
                 watch: Optional[Callable[[JobSpec, float], Optional[tuple[str, str]]]] = None):
        self.cluster, self.backend, self.progress = cluster, backend, progress
        self.gate, self.watch = gate, watch
        self.jobs = jobs
        self.ledger = Ledger(ledger_dir)
        self.search_id = search_id
        self.on_end = on_end
        self.pending: list[JobSpec] = []
        self.active: list[Active] = []
        self.submissions = 0
        self.hook_failures: list[tuple[str, str]] = []

    def name(self, job: JobSpec) -> str:
        return job_name(self.cluster.job_name_prefix, self.search_id, job.name)

    # ---- resume ----
    def resume(self) -> None:
        """Sort every job into done (a result of its own fingerprint), re-attached (its job is alive), or
        pending. Results and jobs of another configuration are set aside or cancelled first."""
        latest = self.ledger.latest()
        for job in self.jobs:
            self.progress.add(job.name)
            result = jobmod.read_result(job.out)
            if result is not None and result.get("fingerprint") != job.fingerprint:
                moved = set_aside(job.out)
                log.warning("%s: the result on disk measured another configuration (fingerprint %s, now %s); "
                            "kept in %s, running it again", job.name, result.get("fingerprint"),
                            job.fingerprint, moved)
                result = None
            entry = latest.get(job.name)
            if entry is not None and entry.fingerprint != job.fingerprint:
                self._cancel_superseded(job, entry)
                entry = None
            if result is not None and (result.get("status") not in NOT_LAUNCHED or self._replayed(entry, result)):
                self.progress.update(job.name, result.get("status", "failed"), result)
                continue
            attached = self._reattach(job, entry)
            if attached:
                self.active.append(attached)
            else:
                self.pending.append(job)

    def _replayed(self, entry: Optional[Entry], result: dict) -> bool:
        """Whether a job's recorded verdict (a result that ran nothing: skipped, pruned_after_oom) stands on
        resume: the gate that made it is asking now, under the same inputs. The outcomes it weighed may have
        changed since (trials that ended after it); a decision is made once. Without a gate (exhaustive), or
        under other inputs (a changed skip_margin), the job is decided again."""
        return (self.gate is not None and entry is not None and entry.state == result.get("status")
                and entry.inputs == self.gate.inputs)

    def _job_id(self, job: JobSpec, entry: Entry) -> Optional[str]:
        """The id of the job an unfinished ledger entry of this backend stands for; a job whose submission
        the last orchestrator did not live to record is looked up by its (search-unique) name."""
        if entry.state not in ("submitting", "submitted"):
            return None
        if entry.kind != self.backend.kind:
            log.warning("%s: job %s was submitted by the %s backend and this search runs on %s; it is not "
                        "followed, and runs again here", job.name, entry.job_id, entry.kind, self.backend.kind)
            return None
        if entry.job_id is None:
            return self.backend.find(self.name(job))
        return entry.job_id

    def _cancel_superseded(self, job: JobSpec, entry: Entry) -> None:
        """A job submitted for an earlier configuration of this name: cancel it if it may still run."""
        job_id = self._job_id(job, entry)
        handle = None if job_id is None else self.backend.reattach(job, entry, job_id)
        if handle is None:
            return
        log.warning("%s: job %s ran an earlier configuration (fingerprint %s); cancelling it", job.name,
                    job_id, entry.fingerprint)
        self.backend.cancel(handle)
        self.ledger.append(Entry(job.name, "cancelled", job_id=job_id, kind=entry.kind,
                                 fingerprint=entry.fingerprint, reason="superseded by a changed configuration"))

    def _reattach(self, job: JobSpec, entry: Optional[Entry]) -> Optional[Active]:
        job_id = None if entry is None else self._job_id(job, entry)
        handle = None if job_id is None else self.backend.reattach(job, entry, job_id)
        if handle is None:
            return None
        log.info("re-attached %s to job %s", job.name, job_id)
        return Active(job, handle, entry.time)

    # ---- submit ----
    def _entry(self, job: JobSpec, state: str, job_id: Optional[str] = None, reason: Optional[str] = None,
               inputs: Optional[dict] = None) -> Entry:
        return Entry(job.name, state, job_id=job_id, fingerprint=job.fingerprint, kind=self.backend.kind,
                     folder=str(job.folder), tasks=job.tasks, reason=reason, inputs=inputs)

    def submit(self, job: JobSpec) -> None:
        verdict = self.gate(job) if self.gate is not None else None
        if verdict is not None:
            status, reason = verdict  # the progress log says it, once, with its whole reason
            self._ended(job, None, jobmod.write_job_failure(job, status, reason), inputs=self.gate.inputs)
            return
        if (jobmod.read_result(job.out) or {}).get("status") in NOT_LAUNCHED:
            set_aside(job.out)  # an earlier search's verdict, decided otherwise now
        self.ledger.append(self._entry(job, "submitting"))
        try:
            handle = self.backend.submit(job, self.name(job))
        except Exception as exc:  # noqa: BLE001 - sbatch refused it: record, do not retry blindly
            if self.submissions == 0:
                raise
            result = jobmod.write_job_failure(job, "failed", f"submission failed: {type(exc).__name__}: {exc}")
            self._ended(job, None, result)
            return
        self.submissions += 1
        self.ledger.append(self._entry(job, "submitted", job_id=str(handle.job_id)))
        self.active.append(Active(job, handle, time.time()))
        self.progress.update(job.name, "pending")

    def submit_all_now(self) -> None:
        while self.pending:
            self.submit(self.pending.pop(0))

    # ---- watch ----
    def run(self, max_parallel: Optional[int] = None) -> None:
        """Submit (at most ``max_parallel`` at once, default the backend's parallelism) and watch until
        every job has ended."""
        limit = max_parallel or self.backend.parallelism
        delay = self.backend.min_poll_s
        while self.pending or self.active:
            while self.pending and len(self.active) < limit:
                self.submit(self.pending.pop(0))
            changed = self.poll()
            delay = next_poll_delay(delay, changed, self.backend.max_poll_s, self.backend.min_poll_s)
            if self.active:
                time.sleep(delay)

    def poll(self) -> bool:
        changed = False
        if self.active:
            self.backend.refresh([a.handle for a in self.active])
            changed = self._drop_unschedulable()
        for a in list(self.active):
            if a.handle.done():
                self.active.remove(a)
                self._finish(a)
                changed = True
                continue
            state = str(a.handle.state)
            if state.startswith("RUNNING") and a.running_since is None:
                a.running_since = time.time()
                self.progress.update(a.job.name, "running")
                changed = True
            if a.running_since and self.watch is not None and not a.stop_requested:
                changed |= self._ask_to_stop(a)
            if a.running_since and time.time() - a.running_since > a.job.timeout_min * 60 + GRACE_S:
                log.warning("%s outlived its limit by %.0f s: cancelling", a.job.name, GRACE_S)
                self._stop(a, "timeout", "job did not end within its time limit plus grace")
                changed = True
        return changed

    def _ask_to_stop(self, a: Active) -> bool:
        """Ask ``watch`` about a running job; leave it a stop request if it says so."""
        verdict = self.watch(a.job, a.submitted)
        if verdict is None:
            return False
        stop_reason, reason = verdict
        log.info("%s: asking it to stop after its current step (%s: %s)", a.job.name, stop_reason, reason)
        request_stop(Path(a.job.out), stop_reason, reason)
        a.stop_requested = True
        return True

    def _drop_unschedulable(self) -> bool:
        """Cancel queued jobs the backend can never start (or that waited past cluster.max_queue_minutes)."""
        queued = {a.job_id: a for a in self.active if a.running_since is None}
        limit = self.cluster.max_queue_minutes
        dropped = False
        for job_id, waiting in self.backend.pending([a.handle for a in queued.values()]).items():
            a, reason = queued[job_id], waiting.reason
            waited_min = (time.time() - a.submitted) / 60
            if waiting.never:
                why = waiting.never
            elif limit is not None and waited_min > limit:
                why = (f"job {job_id} was pending {waited_min:.1f} min, more than cluster.max_queue_minutes="
                       f"{limit:g} (the scheduler's reason: {reason})")
            else:
                continue
            log.warning("%s: %s; cancelling it", a.job.name, why)
            self._stop(a, "unschedulable", why)
            dropped = True
        return dropped

    def _stop(self, a: Active, status: str, reason: str) -> None:
        self.backend.cancel(a.handle)
        self.active.remove(a)
        self._ended(a.job, a, jobmod.write_job_failure(a.job, status, reason))

    def _finish(self, a: Active) -> None:
        result = jobmod.read_result(a.job.out)
        if result is None:
            status, reason = self._end_state(a)
            result = jobmod.write_job_failure(a.job, status, reason)
        self._ended(a.job, a, result)

    def _end_state(self, a: Active) -> tuple[str, str]:
        ran_s = time.time() - (a.running_since or a.submitted)
        return self.backend.end_state(a.handle, a.job, ran_s, self.backend.log_tail(a.handle, a.job))

    def _ended(self, job: JobSpec, a: Optional[Active], result: dict, inputs: Optional[dict] = None) -> None:
        """Record how ``job`` ended (with the gate's ``inputs`` where the gate decided it) and tell the hooks."""
        self.ledger.append(self._entry(job, result.get("status", "failed"), None if a is None else a.job_id,
                                       reason=result.get("reason"), inputs=inputs))
        self.progress.update(job.name, result.get("status", "failed"), result)
        if self.on_end is None:
            return
        try:
            self.on_end(job, result)
        except Exception as exc:  # noqa: BLE001 - tracking is a copy of the result files; the search goes on
            cause = f"{type(exc).__name__}: {exc}"
            log.error("%s: after-job hook failed (%s); the search goes on", job.name, cause)
            self.hook_failures.append((job.name, cause))

    # ---- cancel ----
    def cancel_all(self) -> int:
        """Cancel every job of this search that has no result yet; returns how many."""
        n = 0
        for a in list(self.active):
            self.backend.cancel(a.handle)
            jobmod.write_job_failure(a.job, "cancelled", "cancelled by the user")
            self.ledger.append(self._entry(a.job, "cancelled", job_id=a.job_id))
            n += 1
        self.active.clear()
        return n
