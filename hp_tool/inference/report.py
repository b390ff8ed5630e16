"""Inference results: the summary CSV and the plot, from the results the worker writes (their contract and
latency statistics: hp_tool/contracts/inference.py, re-exported here for the search). No torch here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from hp_tool.fsutil import atomic_write_text
from hp_tool.launch.job import read_result  # noqa: F401  (one reader of result.json for every job)
from hp_tool.contracts.inference import (RESULT_FIELDS, empty_result, latency_stats, percentile,  # noqa: F401
                                         write_result)
from hp_tool.vocab import INFERENCE_CSV, INFERENCE_PLOT

log = logging.getLogger(__name__)

SUMMARY_COLUMNS = (
    "config_id", "status", "tp", "pp", "batch_size", "weights", "kv_cache", "num_gpus", "latency_ms_p50",
    "latency_ms_p95", "latency_ms_p99", "time_to_first_token_ms", "samples_per_s", "tokens_per_s",
    "tokens_per_s_per_gpu", "usd_per_million_tokens", "meets_latency_bound", "predicted_memory_gib",
    "predicted_ttft_ms", "predicted_tpot_ms", "predicted_latency_ms", "predicted_tokens_per_s_per_gpu",
    "predicted_usd_per_million_tokens", "reason",
)
SUMMARY_DIR = Path("inference") / "final_summary"
SUMMARY_CSV, PLOT_FILE = INFERENCE_CSV, INFERENCE_PLOT


def meets_bound(result: dict, max_latency_ms: float) -> bool:
    """A config meets the bound when it ran (status ok) and its p99 batch latency is within it."""
    p99 = result.get("latency_ms_p99")
    return result.get("status") == "ok" and p99 is not None and p99 <= max_latency_ms


def with_expert_parallel(columns: tuple[str, ...], used: bool) -> tuple[str, ...]:
    """``columns`` with ``expert_parallel`` after PP where some layout of the grid uses it (a mixture of experts); a
    dense model's columns as they were before the dimension. plan.csv's and the summary's."""
    if not used:
        return columns
    at = columns.index("pp") + 1
    return columns[:at] + ("expert_parallel",) + columns[at:]


def summary_frame(rows: list[dict], max_latency_ms: float):
    """One row per config; those meeting the bound first, each group by throughput per GPU, best first."""
    import pandas as pd

    columns = with_expert_parallel(SUMMARY_COLUMNS, any(r.get("expert_parallel") for r in rows))
    frame = pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=list(columns))
    frame["meets_latency_bound"] = [meets_bound(r, max_latency_ms) for r in rows]
    frame["tokens_per_s_per_gpu"] = pd.to_numeric(frame["tokens_per_s_per_gpu"])
    frame = frame.sort_values(["meets_latency_bound", "tokens_per_s_per_gpu", "latency_ms_p99"],
                              ascending=[False, False, True], na_position="last", kind="stable")
    return frame.reset_index(drop=True)


def write_summary_csv(frame, path: Path) -> Path:
    """The summary as CSV; missing values are empty cells."""
    return atomic_write_text(path, frame.to_csv(index=False, na_rep="", float_format="%.6g"))


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of (latency, throughput) points no other point beats on both (lower, higher)."""
    front = []
    for i, (lat, thr) in enumerate(points):
        dominated = any(l2 <= lat and t2 >= thr and (l2 < lat or t2 > thr)
                        for j, (l2, t2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def plot_latency_vs_throughput(frame, max_latency_ms: float, path: Path) -> Optional[Path]:
    """p99 latency against tokens/s per GPU for configs that ran, the Pareto front joined and the bound
    drawn; None when nothing ran."""
    ok = frame[frame["status"] == "ok"].dropna(subset=["latency_ms_p99", "tokens_per_s_per_gpu"])
    if ok.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = list(zip(ok["latency_ms_p99"].astype(float), ok["tokens_per_s_per_gpu"].astype(float)))
    front = sorted(points[i] for i in pareto_front(points))
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], color="tab:blue", label="configs")
    for (lat, thr), label in zip(points, ok["config_id"]):
        ax.annotate(str(label).split("_", 2)[-1], (lat, thr), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.plot([p[0] for p in front], [p[1] for p in front], "o-", color="tab:red", label="Pareto front")
    ax.axvline(max_latency_ms, color="gray", linestyle="--", label=f"bound {max_latency_ms:g} ms")
    ax.set_xlabel("batch latency p99 (ms)")
    ax.set_ylabel("generated tokens/s per GPU")
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def render_top(frame, top_n: int) -> str:
    """The top rows as a fixed-width table for the terminal."""
    cols = ["config_id", "status", "latency_ms_p50", "predicted_latency_ms", "latency_ms_p99", "time_to_first_token_ms",
            "tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu", "meets_latency_bound"]
    return frame[cols].head(top_n).to_string(index=False, na_rep="", float_format=lambda v: f"{v:.2f}")
