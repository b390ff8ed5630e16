"""The adaptive search at launch time: hp_tool/adaptive.py's pure decisions, fed from the results folder.

``plan_options`` gives the decisions the plan's predictions, ``ordered_for_adaptive`` puts the jobs in
their launch order, and ``AdaptiveGate`` is what the ``Launcher`` asks: its ``gate`` before each
submission (skipped, pruned_after_oom) and its ``watch`` on each running trial's metrics.jsonl (losing).
The ended trials come from the collector's table (full-run step times extrapolated as the ranking does).
The decisions stay in adaptive.py, which reads nothing, so the search-cost simulation
(benchmarks/search_cost.py) runs them without a results folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from hp_tool.adaptive import Option, Outcome, launch_order, losing, verdicts
from hp_tool.dimensions import regime_recipe
from hp_tool.launch.job import JobSpec
from hp_tool.planner import Plan
from hp_tool.results.collect import RANK_COLUMN, collect_trials, full_run_columns, full_run_for, read_plan
from hp_tool.contracts.result import step_stats
from hp_tool.results.trial_files import number, read_metrics, timed_step_times
from hp_tool.vocab import METRICS_FILE, SELECTED

log = logging.getLogger(__name__)


def plan_options(plan: Plan) -> list[Option]:
    """The adaptive search's view of the plan's selected candidates (hp_tool/adaptive.py's Option)."""
    return [Option(c.trial_id, c.tp, c.pp, c.compute_time_s, c.comm_time_s, c.memory_gib, regime_recipe(c.full.values()))
            for c in plan.candidates if c.status == SELECTED]


def ordered_for_adaptive(options: list[Option], jobs: list[JobSpec]) -> list[JobSpec]:
    """``jobs`` most promising first, spread over the regimes (adaptive.launch_order)."""
    rank = {name: i for i, name in enumerate(launch_order(options))}
    return sorted(jobs, key=lambda j: rank.get(j.name, len(rank)))


class AdaptiveGate:
    """The adaptive search's decisions as the Launcher asks for them: its ``gate`` (a verdict on a trial
    about to be submitted) and its ``watch`` (stop a running trial that is losing), from the plan's
    predictions and the trials ended so far as the collector tables them (full-run step times
    extrapolated as the ranking does). The ended trials are read again only after a trial ends ok or out
    of memory (``ended``, called after each job), the only outcomes the decisions depend on. A decision
    that cannot be made launches the trial, or lets it run."""

    def __init__(self, options: list[Option], results_dir: Path, skip_margin: float):
        self.options, self.results_dir, self.skip_margin = options, results_dir, skip_margin
        # what a recorded verdict was decided under (launch.runner.Gate): a resume replays it under the same
        self.inputs = {"search_strategy": "adaptive", "skip_margin": skip_margin}
        self.full = full_run_for(results_dir)
        self.plan_rows = {row["trial_id"]: row for row in read_plan(results_dir)}
        self._decided: Optional[tuple[list[Outcome], dict[str, tuple[str, str]]]] = None  # (outcomes, verdicts)
        self._metrics_size: dict[str, int] = {}  # a running trial's metrics.jsonl size when last judged

    def __call__(self, job: JobSpec) -> Optional[tuple[str, str]]:
        """The Launcher's gate: (status, reason) when ``job`` should not be submitted, else None."""
        try:
            return self._decisions()[1].get(job.name)
        except Exception as exc:  # noqa: BLE001 - a decision that cannot be made launches the trial
            log.warning("%s: adaptive decision failed (%s: %s); launching it", job.name, type(exc).__name__, exc)
            return None

    def watch(self, job: JobSpec, submitted: float) -> Optional[tuple[str, str]]:
        """The Launcher's watch: (LOSING, reason) when the running ``job`` should stop early, else None."""
        try:
            return self._losing(job, submitted)
        except Exception as exc:  # noqa: BLE001 - a decision that cannot be made lets the trial run
            log.warning("%s: early-stop decision failed (%s: %s); it runs on", job.name, type(exc).__name__, exc)
            return None

    def ended(self, job: JobSpec, result: dict) -> None:
        """After-job hook: a trial that ended ok or out of memory changes the decisions; read them again."""
        if result.get("status") in ("ok", "oom"):
            self._decided = None

    def _decisions(self) -> tuple[list[Outcome], dict[str, tuple[str, str]]]:
        if self._decided is None:
            df = collect_trials(self.results_dir, full=self.full)
            ended = df[((df["status"] == "ok") & df[RANK_COLUMN].notna()) | (df["status"] == "oom")]
            outcomes = [Outcome(r.trial_id, r.status, getattr(r, RANK_COLUMN)) for r in ended.itertuples()]
            self._decided = outcomes, verdicts(self.options, outcomes, self.skip_margin)
        return self._decided

    def _losing(self, job: JobSpec, submitted: float) -> Optional[tuple[str, str]]:
        path = Path(job.out) / METRICS_FILE
        size = path.stat().st_size if path.is_file() else 0
        if size == self._metrics_size.get(job.name, 0):
            return None  # no new step since it was last judged
        self._metrics_size[job.name] = size
        steps, _ = read_metrics(path)
        fresh = [s for s in steps if (number(s.get("time")) or 0) >= submitted]  # not an earlier run's
        timed = timed_step_times(fresh)
        if not timed:
            return None
        row = dict(self.plan_rows[job.name], measured_step_time_s=step_stats(timed)["median"])
        full_run_s = full_run_columns(row, self.full).get("full_run_step_time_s")
        return losing(job.name, timed, full_run_s, self._decisions()[0], self.skip_margin)


def adaptive_launch(plan: Plan, jobs: list[JobSpec], skip_margin: float) -> tuple[list[JobSpec], AdaptiveGate]:
    """The plan's ``jobs`` in the adaptive launch order, and the gate that decides on each of them."""
    options = plan_options(plan)
    return ordered_for_adaptive(options, jobs), AdaptiveGate(options, plan.results_dir, skip_margin)
