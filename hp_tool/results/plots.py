"""Plots of a collected table (PNG, matplotlib's Agg canvas; no display and no pyplot global state)."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

log = logging.getLogger(__name__)

STATUS_COLORS = {"ok": "#2a9d8f", "timeout": "#e9c46a", "oom": "#e76f51", "failed": "#9b2226",
                 "cancelled": "#6c757d", "not_run": "#ced4da"}
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


def plot_predicted_vs_measured(df: pd.DataFrame, path: Path) -> Path:
    """Two panels: peak memory per GPU in the trial (GiB), measured against the analytic estimate and the
    trace (both with the overhead constant), and full-run step time (s) against the planner's prediction;
    points on the dashed line were predicted exactly."""
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    mem_ax, time_ax = fig.subplots(1, 2)
    _scatter(mem_ax, df, [("predicted_memory_gib", "analytic"), ("traced_memory_gib", "traced")], "peak_memory_gib",
             "peak memory per GPU (GiB)", log=False)
    _scatter(time_ax, df, "predicted_step_time_s", "full_run_step_time_s", "full-run step time (s)",
             log=True)
    mem_ax.set_title("Memory")
    time_ax.set_title("Step time")
    return _save(fig, path)


def write_plots(df: pd.DataFrame, folder: Path) -> list[Path]:
    """throughput.png and predicted_vs_measured.png in ``folder``. A plot that fails is logged with its
    cause and left out; the CSVs and the optimal config never depend on it."""
    paths = []
    for name, plot in (("throughput.png", plot_throughput), ("predicted_vs_measured.png", plot_predicted_vs_measured)):
        try:
            paths.append(plot(df, folder / name))
        except Exception as exc:  # noqa: BLE001 - a picture must not cost the user the results
            log.error("Plot %s failed (%s: %s); the CSVs in %s are complete", name, type(exc).__name__, exc, folder)
    return paths

