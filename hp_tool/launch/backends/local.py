"""This machine through submitit's local executor: one process per task, started by a controller process
whose pid is the job id, so a restarted orchestrator follows a job it did not start by that pid. CPU jobs
(``gpu=cpu``) run the same way from a warm process (warm.py): their tasks fork from one that has already
imported the trial engine."""

from __future__ import annotations

import os
import signal
from typing import Iterable, Optional, Sequence

import submitit

from hp_tool.config import ClusterConfig, GpuConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.backends import warm
from hp_tool.launch.backends.base import Backend, Handle, Sized
from hp_tool.launch.job import JobSpec, SubmititEntry
from hp_tool.launch.ledger import Entry
from hp_tool.launch.slurm import command_output

LOCAL_MEMORY_TOLERANCE = 0.97  # nvidia-smi's total against the preset's (the device's real total, GiB): drivers differ a little
FIX = "choose presets that fit this machine, e.g. search_config=gpt3/tiny gpu=cpu"


def local_gpu_memory_gib() -> list[float]:
    """Memory in GiB of each GPU on this machine, from nvidia-smi (no torch import); [] without GPUs."""
    out = command_output(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]) or ""
    return [float(line) / 1024 for line in out.split() if line.isdigit()]  # MiB


def local_problem(gpu: GpuConfig, jobs: Iterable[tuple[int, int]],
                  gpus_here: Optional[list[float]] = None) -> Optional[str]:
    """Why this machine cannot run jobs of (nodes, processes per node) as the ``gpu`` preset describes
    them, or None when it can. CPU processes (gpu=cpu) always fit on one node."""
    jobs = list(jobs)
    nodes = max((n for n, _ in jobs), default=1)
    procs = max((p for _, p in jobs), default=1)
    if nodes > 1:
        return f"a trial spans {nodes} nodes and this machine is one"
    if gpu.name == "cpu":
        return None
    gpus_here = local_gpu_memory_gib() if gpus_here is None else gpus_here
    if not gpus_here:
        return f"gpu={gpu.name} was asked for and this machine has no GPU (nvidia-smi lists none)"
    if procs > len(gpus_here):
        return f"a trial needs {procs} GPUs and this machine has {len(gpus_here)}"
    if min(gpus_here) < LOCAL_MEMORY_TOLERANCE * gpu.memory_gib:
        return (f"its GPUs have {min(gpus_here):.0f} GiB, less than the {gpu.memory_gib:g} GiB of "
                f"gpu={gpu.name}")
    return None


def visible_gpus(environ: Optional[dict] = None) -> tuple[int, ...]:
    """The GPU indices this process may use: its CUDA_VISIBLE_DEVICES when that lists indices, else () (all)."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
    parts = [v.strip() for v in value.split(",") if v.strip()]
    return tuple(int(v) for v in parts) if parts and all(v.isdigit() for v in parts) else ()


def executor_parameters(timeout_min: int, tasks: int, signal_delay_s: int,
                        environ: Optional[dict] = None) -> dict:
    """submitit LocalExecutor parameters for a GPU job: one GPU per task. Without ``gpus_per_node`` submitit
    sets CUDA_VISIBLE_DEVICES to nothing and every task would train on the CPU."""
    params = dict(timeout_min=timeout_min, tasks_per_node=tasks, nodes=1, signal_delay_s=signal_delay_s,
                  gpus_per_node=tasks)
    if visible := visible_gpus(environ):
        params["visible_gpus"] = visible
    return params


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
            os.kill(int(self.job_id), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass


class LocalBackend(Backend):
    """``cluster=local`` (and ``auto`` where SLURM does not answer; ``fallback`` then says so when the
    search does not fit this machine). Jobs die with the orchestrator's shell: not detachable."""

    kind = "local"
    max_poll_s = 0.3  # a job on this machine: looking costs nothing; the next trial, and the stop of a losing
                      # one (judged on its steps as they come), wait for the look
    min_poll_s = 0.2

    def __init__(self, cluster: ClusterConfig, gpu: GpuConfig, fallback: bool = False):
        super().__init__(cluster)
        self.gpu, self.fallback = gpu, fallback

    def preflight(self, jobs: Sequence[Sized]) -> None:
        problem = local_problem(self.gpu, [(j.num_nodes, j.tasks_per_node) for j in jobs])
        if problem is None:
            return
        if self.fallback:
            raise ConfigError("cluster", self.cluster.type, "found no SLURM (sinfo did not answer), and this "
                              f"machine cannot run the search: {problem}",
                              f"on a SLURM login node pass cluster=bcm cluster.slurm.partition=<partition>; to run here, {FIX}")
        raise ConfigError("cluster", self.cluster.type, f"this machine cannot run the search: {problem}",
                          f"run on a SLURM cluster (cluster=bcm cluster.slurm.partition=<partition>), or {FIX}")

    def submit(self, job: JobSpec, name: str) -> Handle:
        if warm.forks_trials(self.gpu.name):  # forked from a process that has imported the engine
            return warm.submit(warm.WarmSpec(SubmititEntry(job.entry), job.config_path, str(job.folder),
                                             job.tasks_per_node, 60 * job.timeout_min, job.signal_delay_s,
                                             dict(os.environ), os.getcwd()))
        ex = submitit.LocalExecutor(folder=job.folder)
        ex.update_parameters(**executor_parameters(job.timeout_min, job.tasks_per_node, job.signal_delay_s))
        return ex.submit(SubmititEntry(job.entry), job.config_path)

    def reattach(self, job: JobSpec, entry: Entry, job_id: str) -> Optional[Handle]:
        handle = PidJob(job_id)
        return None if handle.done() else handle  # a job that died with its orchestrator runs again

    def end_state(self, handle: Handle, job: JobSpec, ran_s: float, log_tail: str) -> tuple[str, str]:
        if ran_s >= job.timeout_min * 60 - 1:
            return "timeout", f"local job reached its {job.timeout_min}-minute limit without a result"
        return "failed", (f"local job ended without a result; log tail: {log_tail}" if log_tail
                          else "local job ended without a result")
