"""submitit executors built from the cluster config: SLURM (`bcm`), this machine (`local`), or `auto`.

A trial is one job of ``num_nodes x gpus_per_node`` tasks (one task per GPU, or per CPU process
locally); inside it, submitit's torch distributed environment feeds the trial engine.
"""

from __future__ import annotations

import functools
import math
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Optional

import submitit

from hp_tool.config import AppConfig, ClusterConfig, GpuConfig
from hp_tool.errors import ConfigError
from hp_tool.trial.spec import TrialSpec

LOCAL_MEMORY_TOLERANCE = 0.9  # nvidia-smi's MiB vs a datasheet's GB; an 80 GB part shows ~79.6 GiB
SIGNAL_DELAY_S = 60  # submitit signals the job this long before its limit; the engine stops earlier


def slurm_reachable() -> bool:
    """True when `sbatch` is on PATH and the controller answers."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def local_gpu_memory_gb() -> list[float]:
    """Memory in GB of each GPU on this machine, from nvidia-smi (no torch import); [] without GPUs."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [float(line) * 2**20 / 1e9 for line in out.stdout.split() if line.strip().isdigit()]


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
    gpus_here = local_gpu_memory_gb() if gpus_here is None else gpus_here
    if not gpus_here:
        return f"gpu={gpu.name} was asked for and this machine has no GPU (nvidia-smi lists none)"
    if procs > len(gpus_here):
        return f"a trial needs {procs} GPUs and this machine has {len(gpus_here)}"
    if min(gpus_here) < LOCAL_MEMORY_TOLERANCE * gpu.memory_gb:
        return (f"its GPUs have {min(gpus_here):.0f} GB, less than the {gpu.memory_gb:g} GB of "
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


def job_name(cluster: ClusterConfig, trial_id: str) -> str:
    return f"{cluster.job_name_prefix}{trial_id}"


def timeout_min(spec: TrialSpec) -> int:
    return max(1, math.ceil(spec.run.max_minutes))


def make_executor(kind: str, folder: Path, spec: TrialSpec, cluster: ClusterConfig) -> submitit.Executor:
    """An executor for one trial's job; its logs go to ``folder``."""
    r = spec.resources
    if kind == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=timeout_min(spec), tasks_per_node=r.gpus_per_node,
                             nodes=1, signal_delay_s=SIGNAL_DELAY_S)
        return ex
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params = dict(
        name=job_name(cluster, spec.trial_id), nodes=r.num_nodes, tasks_per_node=r.gpus_per_node,
        gpus_per_node=r.gpus_per_node, timeout_min=timeout_min(spec),
        slurm_signal_delay_s=min(SIGNAL_DELAY_S, 15 * timeout_min(spec)),
        slurm_setup=list(cluster.setup), slurm_srun_args=_srun_args(cluster),
        slurm_additional_parameters=dict(cluster.additional_sbatch_parameters),
    )
    optional = dict(slurm_partition=cluster.partition, slurm_account=cluster.account,
                    slurm_qos=cluster.qos, slurm_constraint=cluster.constraint,
                    cpus_per_task=cpus_per_task(cluster, r.gpus_per_node), slurm_mem=cluster.mem)
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


@functools.lru_cache(maxsize=None)
def partition_cpus_per_node(partition: Optional[str]) -> Optional[int]:
    """The fewest CPUs of a node in the partition (the default partition when None), from sinfo."""
    cmd = ["sinfo", "-h", "-N", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(c) for c in out.stdout.split() if c.isdigit()]
    return min(counts) if out.returncode == 0 and counts else None


def _srun_args(cluster: ClusterConfig) -> list[str]:
    """Container image and mounts for pyxis/enroot, then the user's own srun arguments."""
    args = []
    if cluster.container_image:
        args.append(f"--container-image={cluster.container_image}")
    if cluster.container_mounts:
        args.append(f"--container-mounts={','.join(cluster.container_mounts)}")
    return args + list(cluster.srun_args)


def check_slurm_target(cluster: ClusterConfig) -> None:
    """Fail before any submission when the partition or account does not exist."""
    if cluster.partition:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
        partitions = sorted(set(out.stdout.split()))
        if out.returncode == 0 and cluster.partition not in partitions:
            raise ConfigError("cluster.partition", cluster.partition, "no such SLURM partition",
                              f"use one of {partitions}")
    if cluster.account and shutil.which("sacctmgr"):
        out = subprocess.run(["sacctmgr", "-n", "-P", "show", "account", cluster.account, "format=account"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and cluster.account not in out.stdout.split():
            raise ConfigError("cluster.account", cluster.account, "no such SLURM account",
                              "use an account from `sacctmgr show account`")
