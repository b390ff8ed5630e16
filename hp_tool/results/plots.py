"""Plots of a collected table (PNG, matplotlib's Agg canvas; no display and no pyplot global state)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

log = logging.getLogger(__name__)

# every status a selected trial can end in, so the throughput plot leaves none out
STATUS_COLORS = {"ok": "#2a9d8f", "timeout": "#e9c46a", "oom": "#e76f51", "failed": "#9b2226",
                 "cancelled": "#6c757d", "unschedulable": "#495057", "stale": "#8d99ae",
                 "pruned_after_oom": "#f4a261", "skipped": "#a8dadc", "not_run": "#ced4da"}
OTHER_COLOR = "#adb5bd"
MAX_LABELLED_BARS = 60  # beyond this, trial ids no longer fit on the axis


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def plot_throughput(df: pd.DataFrame, path: Path) -> Path:
    """Measured tokens/s per GPU of every trial the planner selected, coloured by status (fastest at top;
    a trial without a measurement shows as an empty bar in its status colour)."""
    trials = df[df["status"].isin(list(STATUS_COLORS))]
    values = trials["tokens_per_s_per_gpu"].fillna(0.0).to_numpy()
    colors = [STATUS_COLORS.get(s, OTHER_COLOR) for s in trials["status"]]
    n = len(trials)
    fig = Figure(figsize=(9, min(2 + 0.28 * max(n, 1), 30)), layout="constrained")
    ax = fig.add_subplot()
    ax.barh(range(n), values, color=colors, edgecolor=colors)
    if n <= MAX_LABELLED_BARS:  # say why a bar is empty instead of leaving a silent gap
        measured = trials["tokens_per_s_per_gpu"].notna()
        for i, (status, has_value) in enumerate(zip(trials["status"], measured, strict=True)):
            if not has_value:
                ax.text(0, i, f" {status}: no measurement", va="center", fontsize=7, color="#495057")
    ax.invert_yaxis()
    if n <= MAX_LABELLED_BARS:
        ax.set_yticks(range(n), list(trials["trial_id"]), fontsize=8)
    ax.set_xlabel("measured tokens/s per GPU (trial)")
    ax.set_title(f"Throughput per trial ({int((trials['status'] == 'ok').sum())} ok of {n})")
    present = [s for s in STATUS_COLORS if s in set(trials["status"])]
    ax.legend(handles=[Patch(color=STATUS_COLORS[s], label=s) for s in present], loc="lower right")
    if n == 0:
        ax.text(0.5, 0.5, "no trial selected", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


def _scatter(ax, df: pd.DataFrame, predicted: str | list[tuple[str, str]], measured: str, label: str,
             log: bool) -> None:
    """Measured against each predicted column: one column coloured by status, or (column, name) pairs
    each in its own marker (every status alike)."""
    series = [(predicted, "")] if isinstance(predicted, str) else predicted
    points = [df[df[column].notna() & df[measured].notna()] for column, _ in series]
    for (column, name), marker, pts in zip(series, ("o", "x", "^"), points):
        if name:
            ax.scatter(pts[column], pts[measured], s=26, marker=marker, label=name)
            continue
        for status, group in pts.groupby("status", sort=True):
            ax.scatter(group[column], group[measured], s=22, label=status,
                       color=STATUS_COLORS.get(status, OTHER_COLOR))
    ax.set_xlabel(f"predicted {label}")
    ax.set_ylabel(f"measured {label}")
    if all(p.empty for p in points):
        ax.text(0.5, 0.5, "no measurement", ha="center", va="center", transform=ax.transAxes)
        return
    values = [v for (column, _), p in zip(series, points) for v in (p[column].min(), p[column].max(),
                                                                     p[measured].min(), p[measured].max())
              if not p.empty]
    low, high = min(values), max(values)
    use_log = log and low > 0 and high / low > 10
    if use_log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    pad = (high / low) ** 0.05 if use_log else 0.05 * (high - low or abs(high) or 1.0)
    lo, hi = (low / pad, high * pad) if use_log else (low - pad, high + pad)
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, linestyle="--", label="measured = predicted")
    ax.legend(fontsize=8)


def _has(df: pd.DataFrame, *columns: str) -> bool:
    return bool((df[list(columns)].notna().all(axis=1)).any())


def on_cpu(df: pd.DataFrame) -> bool:
    """Whether every trial that recorded a device ran on CPU processes (peak_memory_gib is then the
    process RSS: the interpreter and libraries besides the tensors)."""
    devices = set(df["device"].dropna())
    return bool(devices) and devices <= {"cpu"}


def _process_rss(ax, df: pd.DataFrame) -> None:
    """CPU trials' peak RSS per process, apart from the predictions: it is not what they predict."""
    pts = df[df["peak_memory_gib"].notna()]
    colors = [STATUS_COLORS.get(s, OTHER_COLOR) for s in pts["status"]]
    ax.barh(range(len(pts)), pts["peak_memory_gib"], color=colors)
    ax.invert_yaxis()
    if len(pts) <= MAX_LABELLED_BARS:
        ax.set_yticks(range(len(pts)), list(pts["trial_id"]), fontsize=6)
    ax.set_xlabel("peak RSS per process (GiB): tensors + interpreter + libraries")
    ax.set_title("process RSS (not comparable)")


@dataclass(frozen=True)
class Comparison:
    """One panel's measured column against its predicted (column, name) pairs."""

    measured: str
    predicted: tuple[tuple[str, str], ...]
    label: str
    title: str


TENSOR_MEMORY = Comparison("peak_tensor_memory_gib", (("predicted_tensor_memory_gib", "analytic"),
                                                      ("traced_tensor_memory_gib", "traced")),
                           "tensor peak per GPU (GiB)", "Tensor memory (overhead left out of the predictions)")
PEAK_MEMORY = Comparison("peak_memory_gib", (("predicted_memory_gib", "analytic"), ("traced_memory_gib", "traced")),
                         "peak memory per GPU (GiB)", "Memory (predictions with the overhead)")


def memory_comparison(df: pd.DataFrame) -> Optional[Comparison]:
    """Like with like: the trial's measured tensor peak against the predictions without the overhead when
    the table holds both; else on GPUs the peak per GPU against the predictions with the overhead; else
    None: a CPU process's RSS is set against no prediction."""
    if _has(df, "peak_tensor_memory_gib", "predicted_tensor_memory_gib"):
        return TENSOR_MEMORY
    return None if on_cpu(df) else PEAK_MEMORY


def plot_predicted_vs_measured(df: pd.DataFrame, path: Path) -> Path:
    """Three panels; points on a dashed line were predicted exactly.

    Tensor memory (:func:`memory_comparison`): the trial's measured tensor peak against the analytic and
    traced predictions without the preset's overhead (the collector's ``*_tensor_memory_gib``). Process
    memory: on CPU the peak RSS per process in its own panel, not set against a prediction; on GPUs the
    peak per GPU against the raw and the calibrated prediction. Step time: the full run's (s) against the
    raw and the calibrated prediction."""
    fig = Figure(figsize=(16, 5.2), layout="constrained")
    mem_ax, proc_ax, time_ax = fig.subplots(1, 3)
    memory = memory_comparison(df)
    if memory is None:
        mem_ax.text(0.5, 0.5, "no measured tensor peak to compare", ha="center", va="center",
                    transform=mem_ax.transAxes)
        mem_ax.set_title(TENSOR_MEMORY.title)
    else:
        _scatter(mem_ax, df, list(memory.predicted), memory.measured, memory.label, log=False)
        mem_ax.set_title(memory.title)
    if on_cpu(df):
        _process_rss(proc_ax, df)
    else:
        _scatter(proc_ax, df, [("predicted_memory_gib", "raw"), ("calibrated_memory_gib", "calibrated")],
                 "peak_memory_gib", "peak memory per GPU (GiB)", log=False)
        proc_ax.set_title("Memory per GPU, raw and calibrated")
    _scatter(time_ax, df, [("predicted_step_time_s", "raw"), ("calibrated_step_time_s", "calibrated")],
             "full_run_step_time_s", "full-run step time (s)", log=True)
    time_ax.set_title("Step time, raw and calibrated")
    return _save(fig, path)


PLOTS = (  # file name, plot, caption (report.md's)
    ("throughput.png", plot_throughput, "Measured tokens/s per GPU of every selected trial, by status"),
    ("predicted_vs_measured.png", plot_predicted_vs_measured,
     "Predicted against measured: tensor memory, process memory, step time (raw and calibrated)"),
)
CAPTIONS = {name: caption for name, _, caption in PLOTS}


def write_plots(df: pd.DataFrame, folder: Path) -> list[Path]:
    """Every plot of ``PLOTS`` in ``folder``. A plot that fails is logged with its cause and left out;
    the CSVs and the optimal config never depend on it."""
    paths = []
    for name, plot, _ in PLOTS:
        try:
            paths.append(plot(df, folder / name))
        except Exception as exc:  # noqa: BLE001 - a picture must not cost the user the results
            log.error("Plot %s failed (%s: %s); the CSVs in %s are complete", name, type(exc).__name__, exc, folder)
    return paths
