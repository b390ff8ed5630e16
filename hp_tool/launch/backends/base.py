"""What the launcher asks of a place where jobs run (after submitit's executor plugins): one protocol, a
backend per ``cluster.type`` (slurm.py, local.py, in_process.py; ``backend_for`` picks one).

A backend submits a job and hands back a handle (``job_id``, ``done()``, ``state``, ``cancel()``: what a
submitit Job offers), finds a job by its name and re-attaches to one by its id after the orchestrator
restarted, refreshes every job's state in one call, says which queued jobs can never start, and turns a
job that ended without a result.json into (status, reason). ``preflight`` runs before anything is written
or submitted and raises ConfigError for jobs the backend can never run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence

from hp_tool.config import ClusterConfig
from hp_tool.launch.job import JobSpec, log_tail
from hp_tool.launch.ledger import Entry


class Handle(Protocol):
    """A submitted job, as submitit's Job shows one."""

    job_id: str

    def done(self) -> bool: ...

    @property
    def state(self) -> str: ...

    def cancel(self) -> Any: ...


class Sized(Protocol):
    """What a preflight needs of a job (JobSpec has it)."""

    name: str
    num_nodes: int
    tasks_per_node: int


class JobShape(NamedTuple):
    name: str
    num_nodes: int
    tasks_per_node: int


@dataclass(frozen=True)
class Pending:
    """Why a queued job waits (the scheduler's words); ``never``: why it can never start as submitted, or
    None while it may still start."""

    reason: str
    never: Optional[str] = None


class Backend(ABC):
    """Where jobs run. ``kind`` is written to the ledger with each job; ``detachable``: its jobs outlive
    the command that submitted them (``detach=true`` is refused otherwise); ``max_poll_s``: the longest the
    launcher waits between two looks at its jobs (backing off while nothing changes): a scheduler is asked
    sparingly, a process on this machine costs nothing to look at, and a job's end noticed late leaves its
    GPUs idle until the next one starts; ``min_poll_s``: the wait after something changed."""

    kind: str
    detachable: bool = False
    max_poll_s: float = 15.0
    min_poll_s: float = 1.0

    def __init__(self, cluster: ClusterConfig):
        self.cluster = cluster

    @property
    def parallelism(self) -> int:
        """Jobs queued or running at once (cluster.max_parallel_runs)."""
        return self.cluster.max_parallel_runs

    def preflight(self, jobs: Sequence[Sized]) -> None:
        """ConfigError when a job can never run here; called before any file is written."""

    @abstractmethod
    def submit(self, job: JobSpec, name: str) -> Handle:
        """Start ``job`` (``name``: unique to the search, see executors' job_name)."""

    def find(self, name: str) -> Optional[str]:
        """The id of the job called ``name`` that this user submitted; None when there is none (or the
        backend cannot look jobs up by name)."""
        return None

    @abstractmethod
    def reattach(self, job: JobSpec, entry: Entry, job_id: str) -> Optional[Handle]:
        """A handle on job ``job_id`` an earlier orchestrator submitted (its ledger ``entry``), or None
        when it cannot be followed any more (then it runs again)."""

    def refresh(self, handles: Sequence[Handle]) -> None:
        """Bring every handle's state up to date in one call."""

    def pending(self, handles: Sequence[Handle]) -> dict[str, Pending]:
        """job id -> why it waits, for the queued ones among ``handles`` (one question for all)."""
        return {}

    @abstractmethod
    def end_state(self, handle: Handle, job: JobSpec, ran_s: float, log_tail: str) -> tuple[str, str]:
        """(status, reason) of a job that ended without writing result.json; ``ran_s``: seconds since it
        started (or was submitted), ``log_tail``: the end of its stderr."""

    def cancel(self, handle: Handle) -> None:
        handle.cancel()

    def log_tail(self, handle: Handle, job: JobSpec) -> str:
        """The end of a job's log (its stderr): submitit's files in the job's folder; a backend that keeps its
        jobs' logs elsewhere reads them there."""
        return log_tail(job.folder, str(handle.job_id))
