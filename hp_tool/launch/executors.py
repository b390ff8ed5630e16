"""submitit executors built from the cluster config: SLURM (`bcm`), this machine (`local`), or `auto`.

A trial is one job of ``num_nodes x gpus_per_node`` tasks (one task per GPU, or per CPU process
locally); inside it, submitit's torch distributed environment feeds the trial engine.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import submitit

from hp_tool.config import ClusterConfig
from hp_tool.errors import ConfigError
from hp_tool.trial.spec import TrialSpec

SIGNAL_DELAY_S = 60  # submitit signals the job this long before its limit; the engine stops earlier


def slurm_reachable() -> bool:
    """True when `sbatch` is on PATH and the controller answers."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve_kind(cluster: ClusterConfig) -> str:
    """`local` or `slurm`."""
    if cluster.type == "auto":
        return "slurm" if slurm_reachable() else "local"
    return "slurm" if cluster.type == "bcm" else "local"


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
                    cpus_per_task=cluster.cpus_per_task, slurm_mem=cluster.mem)
    params.update({k: v for k, v in optional.items() if v is not None})
    if cluster.exclusive:
        params["slurm_exclusive"] = True
    ex.update_parameters(**params)
    return ex


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
