"""What runs inside a trial's job, and what is written when a job dies without writing its own result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from hp_tool.fsutil import atomic_write_json
from hp_tool.trial.result import METRICS_FILE, RESULT_FIELDS, RESULT_FILE

# SLURM end states -> trial status (a job that ends these ways never wrote result.json itself)
SLURM_STATUS = {
    "TIMEOUT": "timeout", "DEADLINE": "timeout", "CANCELLED": "cancelled", "PREEMPTED": "cancelled",
    "OUT_OF_MEMORY": "oom", "NODE_FAIL": "failed", "BOOT_FAIL": "failed", "FAILED": "failed",
    "COMPLETED": "failed", "UNKNOWN": "failed",
}


def trial_job(spec_path: str) -> dict:
    """Entry point of a submitit job: set up torch.distributed's environment from SLURM / the local
    executor, then run the trial engine (torch is imported here, never in the orchestrator)."""
    import submitit

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    from hp_tool.trial.train import run_trial

    return run_trial(spec_path)


def logged_steps(out_dir: Path) -> int:
    path = out_dir / METRICS_FILE
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def write_job_failure(out_dir: Path, trial_id: str, status: str, reason: str) -> dict[str, Any]:
    """A result.json for a job that ended without one (killed, timed out, node failure...).

    Measurements stay null; the collector derives timings from metrics.jsonl when steps were logged.
    """
    steps = logged_steps(out_dir)
    if steps:
        reason = f"{reason}; {steps} steps were logged in {METRICS_FILE}"
    result: dict[str, Any] = {k: None for k in RESULT_FIELDS}
    result.update(trial_id=trial_id, status=status, reason=reason, steps_run=steps, steps_measured=0)
    atomic_write_json(out_dir / RESULT_FILE, result)
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


def classify_slurm_end(state: str, job_tail: str) -> tuple[str, str]:
    """(status, reason) for a SLURM job that ended without a result.json."""
    base = state.split()[0].upper() if state else "UNKNOWN"
    status = SLURM_STATUS.get(base, "failed")
    reason = f"SLURM job ended {base} without a result"
    if job_tail:
        reason += f"; log tail: {job_tail}"
    return status, reason


def log_tail(folder: Path, job_id: str, chars: int = 600) -> str:
    """The end of a job's stderr (submitit names it <job_id>_0_log.err)."""
    for path in sorted(folder.glob(f"{job_id}_*log.err")):
        text = path.read_text(errors="replace").strip()
        if text:
            return " | ".join(text[-chars:].splitlines()[-6:])
    return ""
