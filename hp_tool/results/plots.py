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

from hp_tool.words import plural

log = logging.getLogger(__name__)

# every status a selected trial can end in, so the throughput plot leaves none out
STATUS_COLORS = {"ok": "#2a9d8f", "timeout": "#e9c46a", "oom": "#e76f51", "failed": "#9b2226",
                 "cancelled": "#6c757d", "unschedulable": "#495057", "stale": "#8d99ae",
                 "pruned_after_oom": "#f4a261", "skipped": "#a8dadc", "not_run": "#ced4da"}
OTHER_COLOR = "#adb5bd"
DID_NOT_FIT = ("oom", "pruned_after_oom")  # statuses whose layout cannot run: drawn without a speed
MAX_LABELLED_BARS = 60  # beyond this, trial ids no longer fit on the axis


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def full_run_tokens_per_gpu(df: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(full-run tokens/s per GPU, whether it was measured) per row: the measured trial's, extrapolated to the
    full run as the ranking is; else the calibrated prediction's (the plan's figure rescaled by its calibrated
    step time), as a trial the search skipped or never ran would run by the model."""
    measured = df["full_run_tokens_per_s_per_gpu"]
    calibrated = df["predicted_tokens_per_s_per_gpu"] * df["predicted_step_time_s"] / df["calibrated_step_time_s"]
    return measured.fillna(calibrated), measured.notna()


def plot_throughput(df: pd.DataFrame, path: Path) -> Path:
    """Full-run tokens/s per GPU of every trial the planner selected, coloured by status (in ranking order):
    filled bars measured, hollow bars the calibrated prediction of a trial without a measurement (skipped,
    never run, failed), so the chart shows where every selected layout stands."""
    trials = df[df["status"].isin(list(STATUS_COLORS))]
    values, measured = full_run_tokens_per_gpu(trials)
    values = values.where(measured | ~trials["status"].isin(DID_NOT_FIT))  # no speed for what cannot run
    colors = [STATUS_COLORS.get(s, OTHER_COLOR) for s in trials["status"]]
    n = len(trials)
    fig = Figure(figsize=(9, min(2 + 0.28 * max(n, 1), 30)), layout="constrained")
    ax = fig.add_subplot()
    for i, (value, was_measured, color) in enumerate(zip(values.fillna(0.0), measured, colors, strict=True)):
        ax.barh(i, value, color=color if was_measured else "none", edgecolor=color, linewidth=1.5,
                hatch=None if was_measured else "//")
    if n <= MAX_LABELLED_BARS:  # say what a hollow or empty bar is instead of leaving it to the legend
        for i, (status, value, was_measured) in enumerate(zip(trials["status"], values, measured, strict=True)):
            if not was_measured:
                what = ("predicted" if pd.notna(value) else "did not fit" if status in DID_NOT_FIT
                        else "no measurement nor prediction")
                ax.text(0 if pd.isna(value) else value, i, f" {status}: {what}", va="center", fontsize=7,
                        color="#495057")
    ax.invert_yaxis()
    if n <= MAX_LABELLED_BARS:
        ax.set_yticks(range(n), list(trials["trial_id"]), fontsize=8)
    ax.set_xlabel("full-run tokens/s per GPU (filled: measured; hollow: calibrated prediction)")
    ax.set_title(f"Throughput per selected trial ({plural(int(measured.sum()), 'measured trial')} of {n})")
    present = [s for s in STATUS_COLORS if s in set(trials["status"])]
    ax.legend(handles=[Patch(color=STATUS_COLORS[s], label=s) for s in present], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8)
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


def _ranking(ax, df: pd.DataFrame) -> None:
    """The plan's predicted rank against the measured rank of the trials that ran: whether the model
    ordered the layouts as they ran (what a search on CPU processes can compare, where process memory is
    not what the predictions describe)."""
    pts = df[df["rank"].notna() & df["predicted_rank"].notna()]
    ax.set_xlabel("predicted rank (plan)")
    ax.set_ylabel("measured rank")
    if pts.empty:
        ax.text(0.5, 0.5, "no ranked trial", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("Ranking, predicted and measured")
        return
    predicted, measured = pts["predicted_rank"].rank(), pts["rank"].astype(float).rank()
    ax.scatter(predicted, measured, s=26, color=STATUS_COLORS["ok"])
    if len(pts) <= 20:
        for x, y, name in zip(predicted, measured, pts["trial_id"], strict=True):
            ax.annotate(name.split("_", 2)[-1], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    top = len(pts) + 0.5
    ax.plot([0.5, top], [0.5, top], color="black", linewidth=0.8, linestyle="--", label="same order")
    rho = predicted.corr(measured) if len(pts) > 1 else float("nan")
    ax.set_title(f"Ranking of the {plural(len(pts), 'ranked trial')}" +
                 (f": Spearman {rho:.2f}" if rho == rho else ""))
    ax.legend(fontsize=8)


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
    traced predictions without the preset's overhead (the collector's ``*_tensor_memory_gib``). Middle: on
    GPUs the peak per GPU against the raw and the calibrated prediction; on CPU processes, whose RSS is not
    what the predictions describe, the predicted rank against the measured rank of the trials that ran. Step time: the full run's (s) against the
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
        _ranking(proc_ax, df)
    else:
        _scatter(proc_ax, df, [("predicted_memory_gib", "raw"), ("calibrated_memory_gib", "calibrated")],
                 "peak_memory_gib", "peak memory per GPU (GiB)", log=False)
        proc_ax.set_title("Memory per GPU, raw and calibrated")
    _scatter(time_ax, df, [("predicted_step_time_s", "raw"), ("calibrated_step_time_s", "calibrated")],
             "full_run_step_time_s", "full-run step time (s)", log=True)
    time_ax.set_title("Step time, raw and calibrated")
    return _save(fig, path)


PLOTS = (  # file name, plot, caption (report.md's)
    ("throughput.png", plot_throughput,
     "Full-run tokens/s per GPU of every selected trial, by status: measured, or hollow where predicted"),
    ("predicted_vs_measured.png", plot_predicted_vs_measured,
     "Predicted against measured: tensor memory, memory per GPU (on CPU: the ranking), step time (raw and "
     "calibrated)"),
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
