"""Names kept at this path; the backends (hp_tool/launch/backends/) define them."""

from hp_tool.launch.backends import resolve_kind
from hp_tool.launch.backends.local import local_gpu_memory_gib, local_problem
from hp_tool.launch.backends.slurm import cpus_per_task, slurm_reachable

__all__ = ["cpus_per_task", "local_gpu_memory_gib", "local_problem", "resolve_kind", "slurm_reachable"]
