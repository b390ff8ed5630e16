"""Where jobs run: one ``Backend`` per ``cluster.type`` (base.py has the protocol). ``backend_for`` is the
one place that reads the cluster type; everything after it asks the backend.

    slurm       cluster=bcm, and cluster=auto where sinfo answers     submitit's SLURM executor
    local       cluster=local, and cluster=auto without SLURM         submitit's local executor (CPU jobs:
                                                                      forked from a warm process, warm.py)
    in_process  cluster=in_process                                    threads of this process, one process per job
    ray_jobs    cluster=ray                                           Ray jobs on an existing Ray cluster, each
                                                                      trial a Ray Train run (ray_driver.py)
"""

from __future__ import annotations

from hp_tool.config import ClusterConfig, GpuConfig
from hp_tool.launch.backends.base import Backend
from hp_tool.launch.backends.in_process import InProcessBackend
from hp_tool.launch.backends.local import LocalBackend
from hp_tool.launch.backends.slurm import SlurmBackend, slurm_reachable

__all__ = ["Backend", "backend_for"]


def backend_for(cluster: ClusterConfig, gpu: GpuConfig) -> Backend:
    """The backend ``cluster.type`` names; ``auto``: SLURM when sinfo answers, else this machine."""
    if cluster.type == "bcm":
        return SlurmBackend(cluster)
    if cluster.type == "in_process":
        return InProcessBackend(cluster, gpu)
    if cluster.type == "ray":
        from hp_tool.launch.backends.ray_jobs import RayBackend

        return RayBackend(cluster, gpu)
    if cluster.type == "auto":
        return SlurmBackend(cluster) if slurm_reachable() else LocalBackend(cluster, gpu, fallback=True)
    return LocalBackend(cluster, gpu)

