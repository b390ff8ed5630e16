"""A job as the launcher sees it (JobSpec, built alike for training trials and inference configs), what
runs inside a job (its entry; SubmititEntry for the backends that start processes through submitit), and
what is written when a job dies without writing its own result."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import submitit

from hp_tool.contracts import phases
from hp_tool.contracts.rendezvous import rendezvous_port
from hp_tool.fsutil import atomic_write_json
from hp_tool.vocab import METRICS_FILE, RESULT_FILE

SIGNAL_DELAY_S = 60  # submitit signals a job this long before its limit


@dataclass(frozen=True)
class JobSpec:
    """One job to launch: what it reads, where it writes, how big and how long, and what it measures."""

    name: str  # trial_id or config_id: the ledger key and the tail of the SLURM job name
    config_path: str  # the YAML the job's entry reads
    output_dir: str  # result.json (and metrics); submitit's files under <output_dir>/job
    num_nodes: int
    tasks_per_node: int  # one task per GPU (or per CPU process locally)
    max_minutes: float  # the job's time limit, counted from its start
    fingerprint: str  # of what it measures; a result with another fingerprint is stale
    entry: Callable[[str], Any]  # module-level (picklable): called with config_path in each of the job's
    # processes, once torch.distributed's variables (RANK, WORLD_SIZE, ...) are set; none for one process
    blank: dict = field(default_factory=dict, compare=False)  # result.json skeleton: every field, ids set

    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    @property
    def folder(self) -> Path:
        """submitit's folder for this job (pickles, stdout/stderr)."""
        return self.out / "job"

    @property
    def tasks(self) -> int:
        return self.num_nodes * self.tasks_per_node

    @property
    def timeout_min(self) -> int:
        """The job's time limit in whole minutes, as submitit and SLURM take it."""
        return max(1, math.ceil(self.max_minutes))

    @property
    def signal_delay_s(self) -> int:
        """How long before its limit submitit signals the job (the engine stops earlier by itself); at most
        a quarter of a short limit, so the signal never lands at the start."""
        return min(SIGNAL_DELAY_S, 15 * self.timeout_min)


def job_name(prefix: str, search_id: str, name: str) -> str:
    """<prefix><search id>:<trial or config id>: unique to this results folder, so looking a job up by
    name never finds another search's (or another user's) job."""
    return f"{prefix}{search_id}:{name}"


def export_torch_distributed() -> None:
    """torch.distributed's variables from submitit's environment (SLURM's or the local executor's), the
    rendezvous port from ``rendezvous_port`` unless the user set MASTER_PORT."""
    env = submitit.helpers.TorchDistributedEnvironment()
    if "MASTER_PORT" not in os.environ:
        env.master_port = rendezvous_port(submitit.JobEnvironment().job_id)
    os.environ.pop("MASTER_PORT", None)  # export refuses a variable already set; env holds its value
    env.export(set_cuda_visible_devices=False)


@dataclass(frozen=True)
class SubmititEntry:
    """What a submitit job runs: torch.distributed's variables exported from submitit's environment
    (SLURM's or the local executor's), then the job's entry."""

    entry: Callable[[str], Any]

    def __call__(self, config_path: str) -> Any:
        export_torch_distributed()
        return self.entry(config_path)


def trial_job(spec_path: str) -> dict:
    """A training trial's entry: the trial engine (torch is imported here, inside the job, never in the
    orchestrator's own planning)."""
    from hp_tool.trial.train import run_trial

    # a job process of its own (submitit's) counts its start-up; a job in a thread of the orchestrator
    # (in_process) starts now
    own_process = threading.current_thread() is threading.main_thread()
    return run_trial(spec_path, started_unix=phases.process_start_unix() if own_process else None)


def logged_steps(out_dir: Path) -> int:
    path = out_dir / METRICS_FILE
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def write_job_failure(job: JobSpec, status: str, reason: str) -> dict[str, Any]:
    """A result.json for a job that ended without one (killed, timed out, unschedulable, ...), from the
    job's blank result (so it carries the job's fingerprint). Measurements stay null; the collector
    derives timings from metrics.jsonl when steps were logged. The reason leads with how far the job got
    (its phase log, :func:`hp_tool.contracts.phases.summary`) when it started at all."""
    where = phases.summary(job.out, status, job.max_minutes if status == "timeout" else None, time.time())
    if where:
        reason = f"{where}; {reason}"
    steps = logged_steps(job.out)
    if steps:
        reason = f"{reason}; {steps} steps were logged in {METRICS_FILE}"
    result = {**job.blank, "status": status, "reason": reason}
    if "steps_run" in result:
        result.update(steps_run=steps, steps_measured=0)
    atomic_write_json(job.out / RESULT_FILE, result)
    return result


def read_result(out_dir: Path) -> Optional[dict[str, Any]]:
    """A job's result.json (training trial or inference config); None when it has none yet."""
    path = Path(out_dir) / RESULT_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"status": "failed", "reason": f"unreadable {RESULT_FILE}"}


def log_tail(folder: Path, job_id: str, chars: int = 600) -> str:
    """The end of a job's stderr (submitit names it <job_id>_0_log.err)."""
    for path in sorted(folder.glob(f"{job_id}_*log.err")):
        text = path.read_text(errors="replace").strip()
        if text:
            return " | ".join(text[-chars:].splitlines()[-6:])
    return ""
