"""SLURM through submitit's SLURM executor: one sbatch job per trial, ``num_nodes`` x ``tasks_per_node`` tasks
(one per GPU) under srun; jobs found by name (squeue, then sacct), states from one sacct call per poll,
pending reasons that never clear (hp_tool/launch/slurm.py holds what SLURM's commands answer)."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Optional, Sequence

import submitit
from submitit.core.utils import JobPaths

from hp_tool.config import ClusterConfig
from hp_tool.launch import slurm
from hp_tool.launch.backends.base import Backend, Handle, Pending, Sized
from hp_tool.launch.job import JobSpec, SubmititEntry
from hp_tool.launch.ledger import Entry

log = logging.getLogger(__name__)

# SLURM end states -> trial status (a job that ends these ways never wrote result.json itself)
SLURM_STATUS = {
    "TIMEOUT": "timeout", "DEADLINE": "timeout", "CANCELLED": "cancelled", "PREEMPTED": "cancelled",
    "OUT_OF_MEMORY": "oom", "NODE_FAIL": "failed", "BOOT_FAIL": "failed", "FAILED": "failed",
    "COMPLETED": "failed", "UNKNOWN": "failed",
}


def slurm_reachable() -> bool:
    """True when `sbatch` is on PATH and the controller answers."""
    return shutil.which("sbatch") is not None and slurm.command_output(["sinfo", "-h"], timeout_s=15) is not None


def classify_slurm_end(state: str, job_tail: str) -> tuple[str, str]:
    """(status, reason) for a SLURM job that ended without a result.json."""
    base = state.split()[0].upper() if state else "UNKNOWN"
    status = SLURM_STATUS.get(base, "failed")
    reason = f"SLURM job ended {base} without a result"
    if job_tail:
        reason += f"; log tail: {job_tail}"
    return status, reason


def cpus_per_task(cluster: ClusterConfig, tasks_per_node: int) -> Optional[int]:
    """cluster.cpus_per_task, or the partition's CPUs per node shared by the node's tasks (SLURM's own
    default is one CPU per task, which starves data loading and the host side of each rank)."""
    if cluster.cpus_per_task is not None:
        return cluster.cpus_per_task
    cpus = slurm.partition_cpus_per_node(cluster.slurm.partition)
    return max(1, cpus // tasks_per_node) if cpus else None


def srun_args(cluster: ClusterConfig) -> list[str]:
    """Container image and mounts for pyxis/enroot, then the user's own srun arguments."""
    args = []
    if cluster.slurm.container_image:
        args.append(f"--container-image={cluster.slurm.container_image}")
    if cluster.slurm.container_mounts:
        args.append(f"--container-mounts={','.join(cluster.slurm.container_mounts)}")
    return args + list(cluster.slurm.srun_args)


def complete_interrupted_submission(folder: Path, job_id: str) -> bool:
    """Finish what an orchestrator killed between sbatch and submitit's own bookkeeping left undone.

    submitit dumps the job's function to ``<uuid>.pkl``, runs sbatch, then renames the pickle to
    ``<job_id>_submitted.pkl``; the job waits 60 s for that name and then fails. A kill in between
    (more likely on a loaded machine, where the rename comes later) leaves a queued job that can only
    fail. Each job has its own folder, so the one unrenamed pickle there is this job's: rename it.
    Returns True when it did."""
    target = JobPaths(folder, job_id=job_id).submitted_pickle
    orphans = [p for p in Path(folder).glob("*.pkl") if re.fullmatch(r"[0-9a-f]{32}\.pkl", p.name)]
    if target.exists() or len(orphans) != 1:
        return False
    shutil.move(str(orphans[0]), str(target))
    return True


class SlurmBackend(Backend):
    """``cluster=bcm`` (and ``auto`` where SLURM answers)."""

    kind = "slurm"
    detachable = True

    def executor(self, job: JobSpec, name: str) -> submitit.AutoExecutor:
        """submitit's SLURM executor for ``job``, its files in ``job.folder``."""
        cluster = self.cluster
        ex = submitit.AutoExecutor(folder=job.folder, cluster="slurm")
        params = dict(
            name=name, nodes=job.num_nodes, tasks_per_node=job.tasks_per_node, gpus_per_node=job.tasks_per_node,
            timeout_min=job.timeout_min, slurm_signal_delay_s=job.signal_delay_s,
            slurm_setup=list(cluster.slurm.setup), slurm_srun_args=srun_args(cluster),
            slurm_additional_parameters=dict(cluster.slurm.additional_sbatch_parameters),
        )
        optional = dict(slurm_partition=cluster.slurm.partition, slurm_account=cluster.slurm.account,
                        slurm_qos=cluster.slurm.qos, slurm_constraint=cluster.slurm.constraint,
                        cpus_per_task=cpus_per_task(cluster, job.tasks_per_node), slurm_mem=cluster.slurm.mem)
        params.update({k: v for k, v in optional.items() if v is not None})
        if cluster.slurm.exclusive:
            params["slurm_exclusive"] = True
        ex.update_parameters(**params)
        return ex

    def sbatch_script(self, job: JobSpec, name: str) -> str:
        """The batch script ``submit`` hands to sbatch for ``job``, as text."""
        inner = self.executor(job, name)._executor  # submitit renders the script on its SLURM executor
        return inner._make_submission_file_text(inner._submitit_command_str, "uid")

    def preflight(self, jobs: Sequence[Sized]) -> None:
        """The partition and account exist and can ever hold each job (ConfigError otherwise)."""
        per_task = self.cluster.cpus_per_task or 1  # unset: the node's CPUs are shared, at least one each
        slurm.check_slurm_target(self.cluster, [(j.name, j.num_nodes, j.tasks_per_node, j.tasks_per_node * per_task)
                                                for j in jobs])

    def submit(self, job: JobSpec, name: str) -> Handle:
        return self.executor(job, name).submit(SubmititEntry(job.entry), job.config_path)

    def find(self, name: str) -> Optional[str]:
        return slurm.find_job(name)

    def reattach(self, job: JobSpec, entry: Entry, job_id: str) -> Optional[Handle]:
        if entry.state == "submitting" and complete_interrupted_submission(job.folder, job_id):
            log.warning("%s: completed the interrupted submission of job %s (its pickle)", job.name, job_id)
        return submitit.SlurmJob(folder=job.folder, job_id=job_id, tasks=range(entry.tasks))

    def refresh(self, handles: Sequence[Handle]) -> None:
        # one sacct call refreshes every job's state; submitit's own refresh can lag by minutes
        if handles:
            handles[0].watcher.update()

    def pending(self, handles: Sequence[Handle]) -> dict[str, Pending]:
        reasons = slurm.pending_reasons([str(h.job_id) for h in handles])
        return {job_id: Pending(reason, f"SLURM can never start job {job_id}: pending reason {reason}"
                                if slurm.never_starts(reason, self.cluster.slurm.partition) else None)
                for job_id, reason in reasons.items()}

    def end_state(self, handle: Handle, job: JobSpec, ran_s: float, log_tail: str) -> tuple[str, str]:
        return classify_slurm_end(str(handle.state), log_tail)
