"""What SLURM says, asked with its own commands: the partition's nodes, whether a job can ever start
there, pending reasons that mean it never will, and this user's jobs of this search by name.

Checked before the first submission (``check_slurm_target``: partition and account exist, the largest
job fits a node set of the partition) and while polling (``pending_reasons`` + ``never_starts``).
"""

from __future__ import annotations

import functools
import getpass
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterable, Optional

from hp_tool.config import ClusterConfig
from hp_tool.errors import ConfigError

# Pending reasons after which a job can never start as submitted (squeue %r).
NEVER_REASONS = (
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
    "InvalidQOS", "QOSMaxGRESPerJob", "QOSMaxCpuPerJobLimit", "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit",
    "AssocMaxGRESPerJob", "AssocMaxCpuPerJobLimit", "AssocMaxNodePerJobLimit", "AssocMaxWallDurationPerJobLimit",
    "DependencyNeverSatisfied", "JobHeldAdmin",
)
# How squeue words "the nodes this job needs are not available" (a code, or the description of one).
NODES_UNAVAILABLE = ("ReqNodeNotAvail", "Nodes required for job are DOWN, DRAINED")
# Node states (sinfo %T) in which a node takes no new job until an administrator acts.
UNAVAILABLE_STATES = ("drain", "drained", "draining", "down", "fail", "failing", "inval", "maint",
                      "not_responding", "future", "powered_down", "power_down")


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    gpus: int
    state: str  # sinfo %T, lower case, without the trailing flags (*, ~, #, ...)

    @property
    def available(self) -> bool:
        return not any(self.state.startswith(s) for s in UNAVAILABLE_STATES)


def command_output(cmd: list[str], timeout_s: float = 30) -> Optional[str]:
    """stdout of a command (SLURM's, nvidia-smi), or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def default_partition() -> Optional[str]:
    out = command_output(["sinfo", "-h", "-o", "%P"]) or ""
    marked = [p.rstrip("*") for p in out.split() if p.endswith("*")]
    return marked[0] if marked else None


def _gpus(gres: str) -> int:
    """GPUs in a sinfo %G field, e.g. "gpu:2", "gpu:a100:8(S:0-1)", "(null)"."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres))


def partition_nodes(partition: Optional[str]) -> list[Node]:
    """The nodes of ``partition`` (the default partition when None); [] when SLURM does not answer."""
    partition = partition or default_partition()
    out = command_output(["sinfo", "-h", "-N", "-o", "%N|%c|%G|%T"] + (["-p", partition] if partition else []))
    nodes = {}
    for line in (out or "").splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[1].isdigit():
            nodes[parts[0]] = Node(parts[0], int(parts[1]), _gpus(parts[2]), parts[3].lower().rstrip("*~#!%$@^-+"))
    return list(nodes.values())


@functools.lru_cache(maxsize=None)
def partition_cpus_per_node(partition: Optional[str]) -> Optional[int]:
    """The fewest CPUs of a node in the partition (the default partition when None)."""
    counts = [n.cpus for n in partition_nodes(partition)]
    return min(counts) if counts else None


def capacity_problem(nodes: list[Node], num_nodes: int, gpus_per_node: int, cpus_per_node: int) -> Optional[str]:
    """Why no set of these nodes can ever hold a job of ``num_nodes`` x (GPUs, CPUs), or None."""
    fitting = [n for n in nodes if n.gpus >= gpus_per_node and n.cpus >= cpus_per_node]
    if len(fitting) >= num_nodes:
        return None
    have = sorted({(n.gpus, n.cpus) for n in nodes}, reverse=True)
    shapes = ", ".join(f"{g} GPUs and {c} CPUs" for g, c in have) or "no nodes"
    return (f"it asks for {num_nodes} node(s) with {gpus_per_node} GPUs and {cpus_per_node} CPUs each; "
            f"the partition has {len(nodes)} node(s) ({shapes}), {len(fitting)} of them big enough")


def check_slurm_target(cluster: ClusterConfig, jobs: Iterable[tuple[str, int, int, int]]) -> None:
    """Before any submission: the partition and account exist, and every job (name, nodes, GPUs per node,
    CPUs per node) fits the partition's nodes. ConfigError names the job, what it asks and what is there."""
    if cluster.slurm.partition:
        out = command_output(["sinfo", "-h", "-o", "%R"])
        partitions = sorted(set((out or "").split()))
        if out is not None and cluster.slurm.partition not in partitions:
            raise ConfigError("cluster.slurm.partition", cluster.slurm.partition, "no such SLURM partition",
                              f"use one of {partitions}")
    if cluster.slurm.account:
        out = command_output(["sacctmgr", "-n", "-P", "show", "account", cluster.slurm.account, "format=account"])
        if out is not None and cluster.slurm.account not in out.split():
            raise ConfigError("cluster.slurm.account", cluster.slurm.account, "no such SLURM account",
                              "use an account from `sacctmgr show account`")
    nodes = partition_nodes(cluster.slurm.partition)
    if not nodes:
        return  # sinfo gave nothing to check against; SLURM itself will judge
    for name, num_nodes, gpus, cpus in jobs:
        problem = capacity_problem(nodes, num_nodes, gpus, cpus)
        if problem:
            raise ConfigError("cluster.slurm.partition", cluster.slurm.partition or default_partition(),
                              f"can never run {name}: {problem}",
                              "choose a partition with such nodes, or set search_config.train_settings."
                              "gpus_per_node (and tensor/pipeline_parallel_sizes) to what a node has")


def pending_reasons(job_ids: list[str]) -> dict[str, str]:
    """job id -> pending reason (squeue %r) for those of ``job_ids`` that are PENDING."""
    if not job_ids:
        return {}
    out = command_output(["squeue", "-h", "-u", getpass.getuser(), "-j", ",".join(job_ids), "-o", "%i|%T|%r"]) or ""
    reasons = {}
    for line in out.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[1] == "PENDING":
            reasons[parts[0]] = parts[2]
    return reasons


def never_starts(reason: str, partition: Optional[str]) -> bool:
    """True when a pending job with this reason can never start: a reason from NEVER_REASONS, or nodes
    not available (ReqNodeNotAvail) while no node of the partition is available at all."""
    head = reason.split(",")[0].strip()
    if head in NEVER_REASONS:
        return True
    if reason.startswith(NODES_UNAVAILABLE):
        nodes = partition_nodes(partition)
        return bool(nodes) and not any(n.available for n in nodes)
    return False


def find_job(name: str) -> Optional[str]:
    """Id of this user's job with exactly this name (queued, running, or ended in the last week)."""
    user = getpass.getuser()
    for cmd in (["squeue", "-h", "-u", user, "-o", "%i", "-n", name],
                ["sacct", "-n", "-X", "-P", "-u", user, "--name", name, "-o", "JobID", "-S", "now-7days"]):
        out = command_output(cmd)
        ids = [line.strip() for line in (out or "").splitlines() if line.strip()]
        if ids:
            return ids[-1]
    return None


def cancel(job_id: str) -> None:
    command_output(["scancel", job_id])
