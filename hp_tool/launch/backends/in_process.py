"""Jobs run in the orchestrator's own process, one at a time, each in a thread while the launcher polls
(so the adaptive search can watch a running trial as it does on a cluster). One-process jobs only: no
process group, no submitit, no second Python. For tests and quick experiments on one machine; its timings
share the orchestrator's process and are no benchmark."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import traceback
from typing import Optional, Sequence

from hp_tool.config import ClusterConfig, GpuConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.backends.base import Backend, Handle, Sized
from hp_tool.launch.backends.local import local_problem
from hp_tool.launch.job import JobSpec
from hp_tool.launch.ledger import Entry

log = logging.getLogger(__name__)

ONE_PROCESS_FIX = ("use cluster=local (or cluster=bcm), or search one-process layouts: "
                   "search_config.train_settings.gpus_per_node=1 tensor_parallel_sizes=[1] pipeline_parallel_sizes=[1]"
                   " (inference: search_config.inference_settings.tensor_parallel_sizes=[1])")
_ids = itertools.count(1)


class ThreadJob:
    """A job's entry running in a thread of this process; its exception, if any, kept for the result."""

    def __init__(self, job: JobSpec):
        self.job_id = f"{os.getpid()}-{next(_ids)}"
        self.error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"job-{job.name}", daemon=True)
        self._thread.start()

    def _run(self, job: JobSpec) -> None:
        try:
            job.entry(job.config_path)
        except BaseException as exc:  # noqa: BLE001 - the launcher turns it into the job's result
            self.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()

    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def state(self) -> str:
        if not self.done():
            return "RUNNING"
        return "FAILED" if self.error else "FINISHED"

    def cancel(self) -> None:
        # a thread cannot be stopped from outside: the job ends at its own time box (the engine stops
        # itself before max_minutes), and the process with it
        log.warning("job %s runs in this process and cannot be stopped; it ends within its time limit", self.job_id)


class InProcessBackend(Backend):
    """``cluster=in_process``."""

    kind = "in_process"
    max_poll_s = 0.3  # a job on this machine: looking costs nothing; the next trial, and the stop of a losing
                      # one (judged on its steps as they come), wait for the look
    min_poll_s = 0.2

    def __init__(self, cluster: ClusterConfig, gpu: GpuConfig):
        super().__init__(cluster)
        self.gpu = gpu

    @property
    def parallelism(self) -> int:
        return 1

    def preflight(self, jobs: Sequence[Sized]) -> None:
        """Every job is one process, and this machine holds it (as for cluster=local)."""
        if self.cluster.max_parallel_runs > 1:
            raise ConfigError("cluster.max_parallel_runs", self.cluster.max_parallel_runs,
                              "in-process jobs run one at a time in this process", "drop the override (1)")
        for job in jobs:
            processes = job.num_nodes * job.tasks_per_node
            if processes > 1:
                raise ConfigError("cluster.type", self.cluster.type,
                                  f"{job.name} needs {processes} processes ({job.num_nodes} node(s) x "
                                  f"{job.tasks_per_node}) and in-process jobs are one process", ONE_PROCESS_FIX)
        problem = local_problem(self.gpu, [(1, 1)]) if jobs else None
        if problem:
            raise ConfigError("cluster.type", self.cluster.type, f"this machine cannot run the search: {problem}",
                              "choose presets that fit this machine, e.g. gpu=cpu")

    def submit(self, job: JobSpec, name: str) -> Handle:
        return ThreadJob(job)

    def reattach(self, job: JobSpec, entry: Entry, job_id: str) -> Optional[Handle]:
        return None  # it ran in an orchestrator that has ended: it runs again

    def end_state(self, handle: Handle, job: JobSpec, ran_s: float, log_tail: str) -> tuple[str, str]:
        error = getattr(handle, "error", None)
        if error:
            return "failed", f"in-process job ended without a result: it raised {error}"
        return "failed", "in-process job ended without a result"
