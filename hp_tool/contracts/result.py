"""The trial's output contract: ``metrics.jsonl`` lines and ``result.json``, and how they are filled.

The results collector reads exactly these names; :data:`METRIC_FIELDS` and :data:`RESULT_FIELDS` are
the single place they are defined. Values that could not be measured are JSON ``null``.

``metrics.jsonl`` (one line per optimizer step, appended and flushed by rank 0):
    step (1-based), step_time_s, loss, grad_norm (the whole model's gradient norm before clipping; null
    where the engine does not report it: DeepSpeed at ZeRO-0), lr, tokens (global, this step), memory_gib
    (rank 0's peak so far, GiB = 1e9 bytes), timed (false for warm-up steps), time (unix seconds).

``result.json`` (written atomically by rank 0; by a failing rank too, so a status is always left):
    fingerprint: TrialSpec.fingerprint() of the spec that ran (the collector ranks only matching ones);
    status: ok (at least one timed step), timeout (time budget or signal before any timed step),
    oom, failed, cancelled; reason; stop_reason: max_steps, time_budget, stable, signal, losing (the
    search asked it to stop: ``stop_request.json``, its reason kept as the result's), or null on failure;
    step-time statistics over the timed steps (seconds); throughput of one optimizer step of the spec's
    global batch on the spec's layout; peak memory per GPU (max over ranks, GiB); versions;
    start and end times (ISO 8601 UTC).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import statistics
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

from hp_tool.fsutil import atomic_write_json
from hp_tool.throughput import throughput as step_throughput
from hp_tool.contracts.spec import TrialSpec
from hp_tool.vocab import (FAILURE_DIR, LOSING, METRICS_FILE, NOT_LAUNCHED, PRUNED_AFTER_OOM, REQUESTED_STOPS, RESULT_FILE,
                           SKIPPED, STATUSES, STOP_REASONS, STOP_REQUEST_FILE)

METRIC_FIELDS = ("step", "step_time_s", "loss", "grad_norm", "lr", "tokens", "memory_gib", "timed", "time")
RESULT_FIELDS = (
    "trial_id", "fingerprint", "status", "reason", "stop_reason", "steps_run", "steps_measured",
    "step_time_s_median", "step_time_s_mean", "step_time_s_std", "samples_per_s", "tokens_per_s",
    "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu", "peak_memory_gib",
    "peak_memory_reserved_gib", "peak_tensor_memory_gib", "world_size", "device", "backend", "first_losses", "final_loss",
    "versions", "start_time", "end_time",
)
FIRST_LOSSES = 5  # losses of the first steps kept in result.json (layout-equivalence checks)
TRACEBACK_TAIL_CHARS = 2000


def iso_utc(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).isoformat()


def versions() -> dict:
    """Versions of python, torch, transformers and hp_tool (None where not installed)."""
    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "hp_tool"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def throughput(spec: TrialSpec, median_step_s: Optional[float], world_size: int) -> dict:
    """samples/s, tokens/s (all and per GPU), model TFLOPS per GPU and MFU from the median step time."""
    keys = ("samples_per_s", "tokens_per_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu")
    if not median_step_s:
        return dict.fromkeys(keys)
    return step_throughput(spec.model.shape(), spec.training.global_batch_size, median_step_s, world_size,
                           spec.resources.peak_tflops_per_gpu, spec.model.adapters)


def step_stats(timed: list[float]) -> dict:
    """Median, mean, sample standard deviation (seconds) and count of the timed steps; None where not
    measurable. The engine (result.json) and the collector (a killed trial's metrics.jsonl) both use it."""
    if not timed:
        return {"median": None, "mean": None, "std": None, "count": 0}
    return {"median": statistics.median(timed), "mean": statistics.fmean(timed),
            "std": statistics.stdev(timed) if len(timed) > 1 else None, "count": len(timed)}


def is_oom(exc: BaseException) -> bool:
    """Out of memory on GPU (torch.OutOfMemoryError) or CPU (MemoryError, failed allocation)."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return oom_text(str(exc))


def oom_text(text: str) -> bool:
    """Whether an error's text says it ran out of memory (torch's, the C++ allocator's, the kernel's)."""
    text = text.lower()
    return any(s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory",
                                   "std::bad_alloc"))


def describe_failure(exc: BaseException, rank: int, where: Optional[str] = None) -> dict:
    """status (oom/failed) and a reason naming the rank, where it was (``where``: the phase log's "in first
    forward after 12 s; imports 8 s, ..."), the exception type and its traceback tail."""
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    tail = tail[-TRACEBACK_TAIL_CHARS:]
    status = "oom" if is_oom(exc) else "failed"
    at = ""
    if where:
        head, _, spent = where.partition("; ")
        at = f" {head}" + (f" ({spent})" if spent else "")
    return {"status": status, "reason": f"rank {rank}{at}: {type(exc).__name__}: {exc}\n{tail}"}


def blank_result(fields: tuple[str, ...], **values: Any) -> dict:
    """The one blank-result builder (training trials and inference configs): every field of the
    contract ``fields`` null, then ``values`` (ids, fingerprint, zero counts)."""
    result = dict.fromkeys(fields)
    result.update(values)
    return result


def empty_result(trial_id: str, fingerprint: Optional[str] = None) -> dict:
    """Every contract field, unmeasured (null); ``fingerprint``: TrialSpec.fingerprint() of what runs."""
    return blank_result(RESULT_FIELDS, trial_id=trial_id, fingerprint=fingerprint, steps_run=0,
                        steps_measured=0, first_losses=[], versions=versions())


def write_result(output_dir: Path, result: dict) -> Path:
    """Write ``result.json`` atomically, fields in contract order."""
    missing = set(RESULT_FIELDS) - set(result)
    if missing:
        raise ValueError(f"result is missing contract fields {sorted(missing)}")
    return atomic_write_json(output_dir / RESULT_FILE, {k: result[k] for k in RESULT_FIELDS})


def request_stop(output_dir: Path, stop_reason: str, reason: str) -> Path:
    """Ask the trial writing to ``output_dir`` to stop after its current step, as ``stop_reason``
    (one of REQUESTED_STOPS), its measurement kept; ``reason`` becomes the result's."""
    if stop_reason not in REQUESTED_STOPS:
        raise ValueError(f"stop_reason {stop_reason!r} is not one of {REQUESTED_STOPS}")
    return atomic_write_json(Path(output_dir) / STOP_REQUEST_FILE, {"stop_reason": stop_reason, "reason": reason})


def read_stop_request(output_dir: Path) -> Optional[dict]:
    """The stop request left for this trial ({"stop_reason", "reason"}), or None (also when unreadable)."""
    try:
        data = json.loads((Path(output_dir) / STOP_REQUEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("stop_reason") not in REQUESTED_STOPS:
        return None
    return data


def write_rank_failure(output_dir: Path, rank: int, failure: dict, unix_s: float) -> None:
    """Leave this rank's failure where rank 0 can find it."""
    atomic_write_json(output_dir / FAILURE_DIR / f"rank{rank}.json", {**failure, "time": unix_s})


def earliest_rank_failure(output_dir: Path) -> Optional[dict]:
    """The first failure any rank recorded (the root cause; later ones are usually its echo)."""
    notes = []
    for path in sorted((output_dir / FAILURE_DIR).glob("rank*.json")):
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return min(notes, key=lambda n: n.get("time", float("inf")), default=None)


FAILURE_GRACE_S = 1.0  # rank 0 waits this long for other ranks' failure notes before writing


def record_failure(exc: BaseException, output_dir: Path, rank: int, world_size: int, label: str,
                   where: Optional[str] = None) -> dict:
    """Log and note this rank's failure (``where``: the phase it was in, see ``describe_failure``); return the
    root failure (the earliest of any rank).

    Rank 0 of a multi-process run first waits FAILURE_GRACE_S for the other ranks' notes."""
    failure = describe_failure(exc, rank, where)
    logging.getLogger(__name__).error("%s failed on rank %d: %s", label, rank, failure["reason"])
    write_rank_failure(output_dir, rank, failure, time.time())
    if world_size > 1 and rank == 0:
        time.sleep(FAILURE_GRACE_S)
    return earliest_rank_failure(output_dir) or failure


def write_and_leave(output_dir: Path, rank: int, world_size: int, write: Callable[[], object]) -> None:
    """Write the failed result (a non-zero rank too, in case rank 0 is gone); in a multi-process run,
    exit at once, skipping collectives and atexit hooks that could wait on dead peers."""
    if rank == 0 or not (output_dir / RESULT_FILE).exists():
        write()
    if world_size > 1:
        logging.shutdown()
        os._exit(1)
