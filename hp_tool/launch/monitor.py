"""Progress of a search: a live table on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger(__name__)

STATES = ("pending", "running", "ok", "oom", "failed", "timeout", "cancelled")


@dataclass
class TrialState:
    trial_id: str
    state: str = "pending"
    started: Optional[float] = None
    ended: Optional[float] = None
    step_time_s: Optional[float] = None
    tokens_per_s_per_gpu: Optional[float] = None
    reason: str = ""


@dataclass
class Progress:
    trials: dict[str, TrialState] = field(default_factory=dict)
    live: bool = field(default_factory=lambda: sys.stdout.isatty())
    _live_obj: object = None

    def add(self, trial_id: str) -> None:
        self.trials.setdefault(trial_id, TrialState(trial_id))

    def update(self, trial_id: str, state: str, result: Optional[dict] = None) -> None:
        t = self.trials[trial_id]
        if t.state == state and result is None:
            return
        now = time.time()
        if state == "running" and t.started is None:
            t.started = now
        if state not in ("pending", "running"):
            t.ended = now
        t.state = state
        if result:
            t.step_time_s = result.get("step_time_s_median")
            t.tokens_per_s_per_gpu = result.get("tokens_per_s_per_gpu")
            t.reason = result.get("reason") or ""
        if not self.live:
            extra = f" ({t.reason})" if t.reason else ""
            timing = f" step {t.step_time_s:.4g} s" if t.step_time_s else ""
            log.info("trial %s: %s%s%s [%s]", trial_id, state, timing, extra, self.counts())
        self.refresh()

    def counts(self) -> str:
        n = {s: 0 for s in STATES}
        for t in self.trials.values():
            n[t.state] = n.get(t.state, 0) + 1
        return ", ".join(f"{k} {v}" for k, v in n.items() if v)

    def best(self) -> Optional[TrialState]:
        ok = [t for t in self.trials.values() if t.state == "ok" and t.step_time_s]
        return min(ok, key=lambda t: t.step_time_s) if ok else None

    def table(self):
        from rich.table import Table

        best = self.best()
        title = f"hp_tool search: {self.counts()}"
        if best:
            title += f" | best so far {best.trial_id} ({best.step_time_s:.4g} s/step)"
        table = Table(title=title)
        for col in ("trial", "state", "elapsed s", "step s", "tok/s/GPU"):
            table.add_column(col)
        now = time.time()
        for t in self.trials.values():
            elapsed = "" if t.started is None else f"{(t.ended or now) - t.started:.0f}"
            table.add_row(t.trial_id, t.state, elapsed, f"{t.step_time_s:.4g}" if t.step_time_s else "",
                          f"{t.tokens_per_s_per_gpu:,.0f}" if t.tokens_per_s_per_gpu else "")
        return table

    def __enter__(self) -> "Progress":
        if self.live:
            from rich.live import Live

            self._live_obj = Live(self.table(), refresh_per_second=2)
            self._live_obj.__enter__()
        return self

    def refresh(self) -> None:
        if self._live_obj is not None:
            self._live_obj.update(self.table())

    def __exit__(self, *exc) -> None:
        if self._live_obj is not None:
            self._live_obj.__exit__(*exc)
            self._live_obj = None
