"""submitit executors built from the cluster config: SLURM (`bcm`), this machine (`local`), or `auto`.

A job (a training trial or an inference config, see launch/job.py JobSpec) is ``num_nodes x
tasks_per_node`` tasks (one task per GPU, or per CPU process locally); inside a trial's job,
submitit's torch distributed environment feeds the trial engine.
"""

from __future__ import annotations

import math
import shutil
from typing import Iterable, Optional

import submitit

from hp_tool.config import AppConfig, ClusterConfig, GpuConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.job import JobSpec
from hp_tool.launch.slurm import command_output, partition_cpus_per_node

LOCAL_MEMORY_TOLERANCE = 0.9  # nvidia-smi's MiB vs a datasheet's GB; an 80 GiB part shows ~79.6 GiB
SIGNAL_DELAY_S = 60  # submitit signals the job this long before its limit; the engine stops earlier


def slurm_reachable() -> bool:
    """True when `sbatch` is on PATH and the controller answers."""
    return shutil.which("sbatch") is not None and command_output(["sinfo", "-h"], timeout_s=15) is not None


def local_gpu_memory_gib() -> list[float]:
    """Memory in GiB of each GPU on this machine, from nvidia-smi (no torch import); [] without GPUs."""
    out = command_output(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]) or ""
    return [float(line) * 2**20 / 1e9 for line in out.split() if line.isdigit()]


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


def resolve_kind(app: AppConfig, jobs: Iterable[tuple[int, int]]) -> str:
    """`slurm` or `local` for jobs of (nodes, processes per node). `auto` takes SLURM when it answers,
    else this machine only when the jobs fit it; otherwise ConfigError says what to pass."""
    cluster_type = app.cluster.type
    if cluster_type == "bcm" or (cluster_type == "auto" and slurm_reachable()):
        return "slurm"
    problem = local_problem(app.gpu, jobs)
    if problem is None:
        return "local"
    if cluster_type == "auto":
        raise ConfigError("cluster", "auto", f"found no SLURM (sinfo did not answer), and this machine "
                          f"cannot run the search: {problem}",
                          "on a SLURM login node pass cluster=bcm cluster.partition=<partition>; to run "
                          "here, choose presets that fit this machine, e.g. search_config=gpt3/tiny gpu=cpu")
    raise ConfigError("cluster", "local", f"this machine cannot run the search: {problem}",
                      "run on a SLURM cluster (cluster=bcm cluster.partition=<partition>), or choose "
                      "presets that fit this machine, e.g. search_config=gpt3/tiny gpu=cpu")


def job_name(cluster: ClusterConfig, search_id: str, name: str) -> str:
    """<prefix><search id>:<trial or config id>: unique to this results folder, so looking a job up by
    name never finds another search's (or another user's) job."""
    return f"{cluster.job_name_prefix}{search_id}:{name}"


def timeout_min(job: JobSpec) -> int:
    return max(1, math.ceil(job.max_minutes))


def make_executor(kind: str, job: JobSpec, cluster: ClusterConfig, search_id: str) -> submitit.Executor:
    """An executor for one job; submitit's files go to ``job.folder``."""
    if kind == "local":
        ex = submitit.LocalExecutor(folder=job.folder)
        ex.update_parameters(timeout_min=timeout_min(job), tasks_per_node=job.tasks_per_node,
                             nodes=1, signal_delay_s=SIGNAL_DELAY_S)
        return ex
    ex = submitit.AutoExecutor(folder=job.folder, cluster="slurm")
    params = dict(
        name=job_name(cluster, search_id, job.name), nodes=job.num_nodes, tasks_per_node=job.tasks_per_node,
        gpus_per_node=job.tasks_per_node, timeout_min=timeout_min(job),
        slurm_signal_delay_s=min(SIGNAL_DELAY_S, 15 * timeout_min(job)),
        slurm_setup=list(cluster.setup), slurm_srun_args=_srun_args(cluster),
        slurm_additional_parameters=dict(cluster.additional_sbatch_parameters),
    )
    optional = dict(slurm_partition=cluster.partition, slurm_account=cluster.account,
                    slurm_qos=cluster.qos, slurm_constraint=cluster.constraint,
                    cpus_per_task=cpus_per_task(cluster, job.tasks_per_node), slurm_mem=cluster.mem)
    params.update({k: v for k, v in optional.items() if v is not None})
    if cluster.exclusive:
        params["slurm_exclusive"] = True
    ex.update_parameters(**params)
    return ex


def cpus_per_task(cluster: ClusterConfig, tasks_per_node: int) -> Optional[int]:
    """cluster.cpus_per_task, or the partition's CPUs per node shared by the node's tasks (SLURM's own
    default is one CPU per task, which starves data loading and the host side of each rank)."""
    if cluster.cpus_per_task is not None:
        return cluster.cpus_per_task
    cpus = partition_cpus_per_node(cluster.partition)
    return max(1, cpus // tasks_per_node) if cpus else None


def _srun_args(cluster: ClusterConfig) -> list[str]:
    """Container image and mounts for pyxis/enroot, then the user's own srun arguments."""
    args = []
    if cluster.container_image:
        args.append(f"--container-image={cluster.container_image}")
    if cluster.container_mounts:
        args.append(f"--container-mounts={','.join(cluster.container_mounts)}")
    return args + list(cluster.srun_args)
