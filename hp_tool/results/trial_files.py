"""Read one trial's outputs (``result.json``, else ``metrics.jsonl``) into a result dict.

Whatever is on disk, the answer is a dict with every field of the result contract
(:data:`hp_tool.contracts.result.RESULT_FIELDS`) and a status: a corrupt or partial ``result.json``
becomes ``failed`` with the reason, a trial killed before writing one is derived from its logged steps,
and a trial with no files at all is ``None`` (the caller marks it ``not_run``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from hp_tool.fingerprint import STALE, stale_reason
from hp_tool.vocab import METRICS_FILE, RESULT_FILE, STATUSES
from hp_tool.contracts import phases
from hp_tool.contracts.result import FIRST_LOSSES, RESULT_FIELDS, blank_result, step_stats

OK = "ok"
# A killed trial whose log spans this fraction of its time box most likely hit the limit.
TIMEOUT_SPAN_FRACTION = 0.9
# Measurements filled from metrics.jsonl when result.json (e.g. the launcher's) leaves them empty.
TIMING_FIELDS = ("steps_run", "steps_measured", "step_time_s_median", "step_time_s_mean",
                 "step_time_s_std", "peak_memory_gib", "final_loss")


def number(value: Any) -> Optional[float]:
    """A finite float, or None (for null, text, booleans, NaN and infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_trial(trial_dir: Path, time_box_s: Optional[float] = None,
               fingerprint: Optional[str] = None) -> Optional[dict]:
    """The trial's result (every contract field), or None when it left no result and no metrics.

    ``time_box_s``: the trial job's time limit in seconds, used to tell a killed trial's timeout
    from another failure. ``fingerprint``: the plan's TrialSpec.fingerprint(); a readable result.json
    with another one (or none) is status ``stale``.
    """
    result_path, metrics_path = trial_dir / RESULT_FILE, trial_dir / METRICS_FILE
    has_result, has_metrics = result_path.is_file(), metrics_path.is_file()
    if not has_result and not has_metrics:
        return None
    steps, bad_lines = read_metrics(metrics_path) if has_metrics else ([], 0)
    if not has_result:
        return result_from_metrics(trial_dir.name, steps, bad_lines, time_box_s, trial_dir)
    result = _read_result_json(result_path, trial_dir.name, fingerprint)
    if result["status"] == STALE:
        return result
    if steps and result.get("step_time_s_median") is None:
        _fill_timing(result, steps)  # e.g. the launcher's verdict on a job SLURM killed
    return result


def _blank(trial_id: str) -> dict:
    return blank_result(RESULT_FIELDS, trial_id=trial_id, first_losses=[])


def _read_result_json(path: Path, trial_id: str, fingerprint: Optional[str] = None) -> dict:
    """result.json checked against the contract; anything unusable becomes status failed + reason, and
    a usable one of another fingerprint than ``fingerprint`` (when given) status stale."""
    result = _blank(trial_id)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        result.update(status="failed", reason=f"{path.name} is unreadable ({type(exc).__name__}: {exc})")
        return result
    if not isinstance(data, dict):
        result.update(status="failed", reason=f"{path.name} holds a {type(data).__name__}, not an object")
        return result
    result.update({k: data[k] for k in RESULT_FIELDS if k in data})
    result["trial_id"] = trial_id  # the directory name is the id every other file uses
    problem = _contract_problem(result)
    if problem:
        earlier = f"; it said: {result['reason']}" if result.get("reason") else ""
        result.update(status="failed", reason=f"{path.name} {problem}{earlier}")
    elif fingerprint is not None and result.get("fingerprint") != fingerprint:
        result.update(status=STALE, reason=stale_reason(result.get("fingerprint"), fingerprint))
    return result


def _contract_problem(result: dict) -> Optional[str]:
    status = result.get("status")
    if status not in STATUSES:
        return f"has no valid status (got {status!r}; expected one of {list(STATUSES)})"
    if status == OK:
        median = number(result.get("step_time_s_median"))
        if median is None or median <= 0:
            return (f"says ok but has no positive step_time_s_median "
                    f"(got {result.get('step_time_s_median')!r})")
    return None


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The logged steps (dicts with a positive step_time_s) and the number of unusable lines.

    A hard kill can cut the last line short, so bad lines are counted, not fatal.
    """
    steps, bad = [], 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [], 1
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict) and (number(row.get("step_time_s")) or 0) > 0:
            steps.append(row)
        else:
            bad += 1
    return steps, bad


def _fill_timing(result: dict, steps: list[dict]) -> None:
    timing = timing_of(steps)
    for key in TIMING_FIELDS:
        if result.get(key) is None:
            result[key] = timing[key]


def timed_step_times(steps: list[dict]) -> list[float]:
    """The timed steps' times (seconds) of metrics.jsonl rows, as ``read_metrics`` returns them."""
    return [float(s["step_time_s"]) for s in steps if s.get("timed") is True]


def timing_of(steps: list[dict]) -> dict:
    """Step-time statistics (seconds) over the timed steps; peak memory (GiB) over all steps (metrics.jsonl
    rows, as ``read_metrics`` returns them)."""
    timed = timed_step_times(steps)
    memory = [m for m in (number(s.get("memory_gib")) for s in steps) if m is not None]
    losses = [x for x in (number(s.get("loss")) for s in steps) if x is not None]
    stats = step_stats(timed)
    return {
        "steps_run": len(steps), "steps_measured": stats["count"], "step_time_s_median": stats["median"],
        "step_time_s_mean": stats["mean"], "step_time_s_std": stats["std"],
        "peak_memory_gib": max(memory) if memory else None,
        "first_losses": losses[:FIRST_LOSSES], "final_loss": losses[-1] if losses else None,
    }


def result_from_metrics(trial_id: str, steps: list[dict], bad_lines: int,
                        time_box_s: Optional[float], trial_dir: Optional[Path] = None) -> dict:
    """A result for a trial killed before it wrote result.json: status timeout when its log spans
    most of the time box (``time_box_s``, seconds), else failed; timing from the timed steps; with its
    folder's phase logs the reason says where it was (:func:`hp_tool.contracts.phases.summary`)."""
    result = _blank(trial_id)
    result.update(timing_of(steps))
    times = [t for t in (number(s.get("time")) for s in steps) if t is not None]
    span_s = (max(times) - min(times) + float(steps[0]["step_time_s"])) if times else 0.0
    timed_out = time_box_s is not None and span_s >= TIMEOUT_SPAN_FRACTION * time_box_s
    note = f", {bad_lines} unreadable line(s)" if bad_lines else ""
    status = "timeout" if timed_out else "failed"
    where = None if trial_dir is None else \
        phases.summary(trial_dir, status, time_box_s / 60 if timed_out and time_box_s else None)
    result.update(status=status, reason=f"killed without a result; derived from {len(steps)} logged steps{note}"
                  + (f"; {where}" if where else ""))
    return result
