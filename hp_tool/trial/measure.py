"""Timing, memory and the stopping rule of a trial.

A trial stops at whichever comes first: ``run.max_steps``; the time budget (``run.max_minutes`` minus a
margin for start-up and write-out, and never starting a step that would overrun it); a stable step time
(the last ``run.stable_window`` timed steps with a coefficient of variation below ``run.stable_cv``); a
signal (SIGUSR2/SIGTERM, sent by SLURM and submitit before their limit); or the search's request
(``stop_request.json``: the adaptive search stops a losing trial).
"""

from __future__ import annotations

import json
import logging
import resource
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from hp_tool.contracts.spec import RunSpec
from hp_tool.estimate.layout import GIB

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def budget_margin_s(max_minutes: float) -> float:
    """Seconds kept back from the job's limit for start-up and writing results: 10%, at most 60 s."""
    return min(60.0, 0.1 * max_minutes * 60.0)


def time_budget_s(run: RunSpec) -> float:
    """Seconds the training loop may use, counted from the start of the trial."""
    return run.max_minutes * 60.0 - budget_margin_s(run.max_minutes)


def effective_warmup(run: RunSpec) -> int:
    """Untimed warm-up steps, leaving at least one timed step when max_steps is reached."""
    warmup = min(run.warmup_steps, run.max_steps - 1)
    if warmup < run.warmup_steps:
        log.warning("run.warmup_steps=%d leaves no timed step within run.max_steps=%d; timing from "
                    "step %d", run.warmup_steps, run.max_steps, warmup + 1)
    return warmup


def coefficient_of_variation(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else float("inf")


@dataclass
class StopRule:
    """Decides after each step whether the run is over, and why."""

    run: RunSpec
    budget_s: float
    warmup: int

    def reason(self, steps_done: int, elapsed_s: float, last_step_s: float,
               timed: list[float], signalled: bool, requested: Optional[str] = None) -> Optional[str]:
        """The stop reason after ``steps_done`` steps ("max_steps", "time_budget", "stable", "signal", or
        ``requested``: the stop reason of the search's request, honoured once a step is timed)."""
        if signalled:
            return "signal"
        if requested is not None and timed:
            return requested
        if steps_done >= self.run.max_steps:
            return "max_steps"
        if elapsed_s + last_step_s > self.budget_s:
            return "time_budget"
        window = self.run.stable_window
        if self.run.stable_cv > 0 and window > 1 and len(timed) >= window:
            if coefficient_of_variation(timed[-window:]) < self.run.stable_cv:
                return "stable"
        return None


@dataclass
class SignalFlag:
    """Records SIGUSR2/SIGTERM instead of dying, so the loop can write results and exit cleanly."""

    received: Optional[int] = None
    _previous: dict = field(default_factory=dict)

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a test harness): rely on the time box
                log.warning("cannot install a handler for %s outside the main thread", sig.name)

    def _handle(self, signum, frame) -> None:
        self.received = signum
        log.warning("received %s: finishing this step, then writing results", signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> tuple[float, Optional[float]]:
    """(peak allocated, peak reserved) of this process in GiB; on CPU the peak RSS and None."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / GIB,
                torch.cuda.max_memory_reserved(device) / GIB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, None  # ru_maxrss is KiB


class MetricsWriter:
    """Appends one JSON line per optimizer step to ``metrics.jsonl`` and flushes it (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool):
        self.file = open(path, "a", encoding="utf-8") if enabled else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def now_s() -> float:
    """Monotonic seconds, for durations."""
    return time.perf_counter()
