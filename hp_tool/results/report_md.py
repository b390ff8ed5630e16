"""final_results/report.md: the page a user reads first, rendered from a small record (pure, no I/O).

The page: the pick and why (how far ahead of the runner-up on the ranking column, and whether that column
comes from the median or the mean of the timed steps; the memory headroom), the ranked table, every plot,
what was skipped, pruned or failed and why, and how far the plan's predictions held against the
measurements. Every number is a column the collector wrote; this module only formats and compares them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hp_tool.words import how_much

REPORT_FILE = "report.md"
NEAR_TIE_PCT = 2.0  # below this lead, a rerun's noise could swap the pick and the runner-up
MAX_UNRANKED_ROWS = 100  # a large grid's invalid candidates would bury the trials that failed


@dataclass(frozen=True)
class RankMetric:
    """The column trials are ranked by."""

    column: str  # e.g. full_run_step_time_s
    label: str  # what it measures, e.g. "full-run step time"
    unit: str  # e.g. "s"
    basis: str  # which statistic of the timed repeats it comes from: "median" or "mean"
    lower_is_better: bool = True
    repeats: str = "timed steps"  # what the statistic is taken over
    order: str = ""  # how rows are grouped before the metric orders them ("" : by the metric alone)


@dataclass(frozen=True)
class Pick:
    """One ranked trial as the headline names it."""

    name: str  # trial or config id
    layout: str  # the layout in words
    value: float  # its ranking-column value, in RankMetric.unit
    peak_memory_gib: Optional[float] = None  # measured peak per GPU (process) in GiB
    memory_limit_gib: Optional[float] = None  # memory per GPU in GiB
    predicted_rank: Optional[int] = None  # where the planner had put it, 1 = predicted fastest
    candidates: Optional[int] = None  # how many candidates the planner ranked
    memory_what: str = "peak per GPU"  # what peak_memory_gib measured (on CPU: the process RSS)


@dataclass(frozen=True)
class Unranked:
    """A candidate without a rank: its status (skipped, pruned, oom, failed, not_run, ...) and why."""

    name: str
    status: str
    reason: str


@dataclass(frozen=True)
class ModelError:
    """Median absolute error (%) of one prediction over the measured trials, raw and calibrated."""

    quantity: str  # e.g. "step time (full run)"
    compared: str  # what was set against what, in words
    trials: int
    raw_pct: Optional[float]
    calibrated_pct: Optional[float] = None
    calibrated_note: str = ""  # shown instead of a calibrated error that says nothing (e.g. fitted exactly)


@dataclass(frozen=True)
class Plot:
    file: str  # a file name beside report.md
    caption: str


@dataclass(frozen=True)
class ReportInputs:
    """Everything report.md shows. ``ranked`` rows hold ``columns`` (and the metric's), best first."""

    title: str
    metric: RankMetric
    columns: tuple[str, ...]
    ranked: tuple[dict, ...] = ()
    pick: Optional[Pick] = None
    runner_up: Optional[Pick] = None
    unranked: tuple[Unranked, ...] = ()
    plots: tuple[Plot, ...] = ()
    counts: str = ""  # one sentence: how many ran, succeeded, are pending
    trust_note: Optional[str] = None  # how to read the errors (e.g. calibration is fitted in-sample)
    errors: tuple[ModelError, ...] = ()
    files: tuple[str, ...] = ()  # other files of the folder worth opening (CSVs, the optimal config)
    notes: tuple[str, ...] = field(default_factory=tuple)  # extra headline lines (e.g. a memory warning)


def _number(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def _cell(value: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    return " ".join(_number(value).split()).replace("|", "\\|")


def table(headers: tuple[str, ...] | list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def lead_pct(metric: RankMetric, pick: Pick, runner_up: Pick) -> float:
    """How much better the pick is, in %: for a time, how much faster (runner-up time / pick time - 1); for
    a rate, how much higher (pick / runner-up - 1)."""
    if metric.lower_is_better:
        return 100 * (runner_up.value / pick.value - 1)
    return 100 * (pick.value / runner_up.value - 1)


def _why(inputs: ReportInputs) -> str:
    m, pick, runner = inputs.metric, inputs.pick, inputs.runner_up
    assert pick is not None
    column = f"`{m.column}` ({m.label}, {m.basis}-based)"
    if runner is None:
        return f"the only trial ranked: {_number(pick.value)} {m.unit} on {column}."
    lead = lead_pct(m, pick, runner)
    word = "faster" if m.lower_is_better else "higher"
    text = (f"{how_much(1 + lead / 100, word)} than the runner-up, {runner.name}, on {column}: "
            f"{_number(pick.value)} {m.unit} against {_number(runner.value)} {m.unit}.")
    if lead < NEAR_TIE_PCT:
        text += (f" A lead under {NEAR_TIE_PCT:g}% is within a rerun's noise: either layout will do; "
                 f"the runner-up's layout is {runner.layout}.")
    return text


def _memory(pick: Pick) -> str:
    if pick.peak_memory_gib is None or pick.memory_limit_gib is None:
        return ""
    headroom = pick.memory_limit_gib - pick.peak_memory_gib
    verdict = "fits with" if headroom >= 0 else "does NOT fit: short by"
    return (f"It {verdict} {abs(headroom):.2f} GiB headroom: measured {pick.memory_what} "
            f"{pick.peak_memory_gib:.2f} GiB of {pick.memory_limit_gib:g} GiB per GPU.")


def _planner(pick: Pick) -> str:
    if pick.predicted_rank is None:
        return ""
    of = f" of {pick.candidates}" if pick.candidates else ""
    return f"The planner had predicted it {pick.predicted_rank}{_ordinal(pick.predicted_rank)}{of}."


def _ordinal(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def headline(inputs: ReportInputs) -> list[str]:
    """The pick, its layout and why; or why there is none."""
    lines = [f"# {inputs.title}", ""]
    if inputs.counts:
        lines += [inputs.counts, ""]
    pick = inputs.pick
    if pick is None:
        lines += ["**No pick yet**: no trial has succeeded. The table below says what each one did and why; "
                  "the job logs are in `training_logs/<trial_id>/`.", ""]
        return lines
    lines += [f"**Pick: {pick.name}** — {pick.layout}.", "",
              f"Why: {_why(inputs)}", ""]
    extra = " ".join(s for s in (_memory(pick), _planner(pick)) if s)
    if extra:
        lines += [extra, ""]
    for note in inputs.notes:
        lines += [note, ""]
    return lines


def ranked_section(inputs: ReportInputs) -> list[str]:
    m = inputs.metric
    best = "lowest" if m.lower_is_better else "highest"
    within = f"{m.order}, each group " if m.order else ""
    lines = ["## Ranked trials", "",
             f"Ranked by `{m.column}` ({m.label} in {m.unit}, from the {m.basis} of the {m.repeats}): "
             f"{within}{best} first.", ""]
    if not inputs.ranked:
        return lines + ["No trial is ranked yet.", ""]
    rows = [[r.get(c) for c in inputs.columns] for r in inputs.ranked]
    return lines + [table(inputs.columns, rows), ""]


def plots_section(inputs: ReportInputs) -> list[str]:
    if not inputs.plots:
        return []
    lines = ["## Plots", ""]
    for p in inputs.plots:
        lines += [f"### {p.caption}", "", f"![{p.caption}]({p.file})", ""]
    return lines


def unranked_section(inputs: ReportInputs) -> list[str]:
    lines = ["## Skipped, pruned and failed", ""]
    if not inputs.unranked:
        return lines + ["Every candidate ran and is ranked.", ""]
    counts: dict[str, int] = {}
    for u in inputs.unranked:
        counts[u.status] = counts.get(u.status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    rows = [[u.name, u.status, u.reason] for u in inputs.unranked[:MAX_UNRANKED_ROWS]]
    lines += [f"{len(inputs.unranked)} without a rank ({summary}):", "",
              table(("candidate", "status", "reason"), rows), ""]
    left = len(inputs.unranked) - len(rows)
    if left > 0:
        lines += [f"... and {left} more, each with its reason in the all-trials CSV.", ""]
    return lines


def _pct(value: Optional[float]) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.1f}%"


def trust_section(inputs: ReportInputs) -> list[str]:
    """How far the predictions held: median absolute error, raw and calibrated, per quantity."""
    lines = ["## How far to trust the plan", ""]
    measured = [e for e in inputs.errors if e.trials > 0]
    if measured:
        rows = [[e.quantity, e.compared, e.trials, _pct(e.raw_pct), e.calibrated_note or _pct(e.calibrated_pct)]
                for e in measured]
        lines += ["Median absolute error of each prediction over the measured trials:", "",
                  table(("prediction", "compared", "trials", "raw error", "calibrated error"), rows), ""]
    elif inputs.errors:
        lines += ["Nothing was measured yet, so the predictions are untested.", ""]
    if inputs.trust_note and (measured or not inputs.errors):
        lines += [inputs.trust_note, ""]
    return lines


def files_section(inputs: ReportInputs) -> list[str]:
    if not inputs.files:
        return []
    return ["## Files", ""] + [f"- [{name}]({name})" for name in inputs.files] + [""]


def render_report(inputs: ReportInputs) -> str:
    """report.md's text: headline, ranked table, plots, unranked candidates, trust in the plan, files."""
    parts = (headline(inputs) + ranked_section(inputs) + plots_section(inputs) + unranked_section(inputs)
             + trust_section(inputs) + files_section(inputs))
    return "\n".join(parts).rstrip("\n") + "\n"
