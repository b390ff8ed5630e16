"""Multirun comparison: one row per job (e.g. per GPU type), ranked by the cost of the full run.

    python3 main.py -m gpu=a10g,a100_80gb,h100_80gb search_config=gpt3/8b dry_run=true

Each row names every searched dimension of the job's fastest layout (hp_tool/dimensions.py: sequence length,
method, TP, PP, ..., activation offload); a fine-tuning search adds the MFU, tokens per hour and hours and
dollars per epoch: which GPU type is cheapest for a model. The printed table names the dimensions that differ
between the jobs' picks.

Each job plans as usual into ``<sweep dir>/<job number>/<search_config>/``; each row is the job's
predicted fastest layout from its plan (the rank-1 row of its plan.csv) with the days to train and the
cost (hp_tool/cost.py). After the last job, ``<sweep dir>/comparison.csv`` holds the rows, cheapest
full run first (jobs without a price next, by days to train; jobs where nothing fits or the input was
bad last, with the reason), and the table is printed. The multirun exits 2 when no job could plan.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from hp_tool.dimensions import cell, layout_columns, layout_headers, searched
from hp_tool.fsutil import atomic_write_text
from hp_tool.plan_output import plan_rows
from hp_tool.vocab import COMPARISON_FILE

log = logging.getLogger(__name__)

# the best layout's columns: every searched dimension, then the plan's predictions
PLAN_FIELDS = ("model_size_b", *layout_columns(), "lora_rank", "predicted_memory_gib", "predicted_step_time_s",
               "predicted_tokens_per_s_per_gpu", "predicted_days_to_train", "predicted_full_run_cost_usd",
               "predicted_cost_usd_per_million_tokens", "predicted_mfu", "predicted_tokens_per_hour",
               "predicted_hours_per_epoch", "predicted_cost_usd_per_epoch")
COLUMNS = ("rank", "job", "search_config", "gpu", "num_nodes", "num_gpus", "status", "best_trial_id", *PLAN_FIELDS,
           "gpu_memory_gib", "gpu_hour_price_usd", "results_dir", "reason")


def _common(app, search_name: str, job: int) -> dict[str, Any]:
    ts = app.search_config.train_settings
    return {"job": job, "search_config": search_name, "gpu": app.gpu.name, "num_nodes": ts.num_nodes,
            "num_gpus": ts.num_nodes * ts.gpus_per_node, "gpu_memory_gib": app.gpu.memory_gib,
            "gpu_hour_price_usd": app.gpu.price_per_gpu_hour}


def comparison_row(plan, app, job: int, exit_code: int) -> dict[str, Any]:
    """The job's predicted fastest layout, read from the same rows as its plan.csv."""
    best = next(r for r in plan_rows(plan) if r["predicted_rank"] == 1)
    row = _common(app, plan.search_name, job)
    row.update({k: best[k] for k in PLAN_FIELDS})
    row.update(best_trial_id=best["trial_id"], results_dir=str(plan.results_dir),
               status="ok" if exit_code == 0 else f"exit {exit_code}", reason="")
    return row


def error_row(app, search_name: str, job: int, reason: str) -> dict[str, Any]:
    """A job whose plan failed (nothing fits these GPUs, or bad input): shown last, with the reason."""
    return {**_common(app, search_name, job), "status": "error", "reason": reason}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.inf


def rank_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cheapest full run first; then priceless jobs by days to train; errors last. ``rank`` 1-based."""
    def key(r: dict[str, Any]) -> tuple:
        return (r["status"] != "ok", _number(r.get("predicted_full_run_cost_usd")),
                _number(r.get("predicted_days_to_train")), r["job"])

    ranked = sorted(rows, key=key)
    for i, r in enumerate(ranked, 1):
        r["rank"] = i if r["status"] == "ok" else None
    return ranked


def comparison_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})
    return buf.getvalue()


def render(rows: list[dict[str, Any]]) -> str:
    table = Table(title="Comparison (cheapest full run first)")
    for col in ("rank", "gpu", "search_config", "GPUs", "best layout", "mem GiB", "step s", "days",
                "$/GPU-h", "$ per run", "$/M tokens"):
        table.add_column(col, justify="left" if col in ("gpu", "search_config", "best layout") else "right")
    finetune = any(r.get("predicted_hours_per_epoch") is not None for r in rows)
    dims = layout_headers(searched([r for r in rows if r["status"] == "ok"], finetune))
    for r in rows:
        if r["status"] != "ok":
            table.add_row("-", r["gpu"], r["search_config"], str(r["num_gpus"]), r["reason"][:60],
                          "", "", "", _fmt(r.get("gpu_hour_price_usd"), "{:g}"), "", "")
            continue
        layout = " ".join(f"{header} {value}" for column, header in dims if (value := cell(column, r)))
        table.add_row(str(r["rank"]), r["gpu"], r["search_config"], str(r["num_gpus"]), layout,
                      _fmt(r["predicted_memory_gib"], "{:.1f}"), _fmt(r["predicted_step_time_s"], "{:.3g}"),
                      _fmt(r["predicted_days_to_train"], "{:.2f}"), _fmt(r.get("gpu_hour_price_usd"), "{:g}"),
                      _fmt(r.get("predicted_full_run_cost_usd"), "${:,.0f}"),
                      _fmt(r.get("predicted_cost_usd_per_million_tokens"), "${:.4f}"))
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _fmt(value: Optional[float], pattern: str) -> str:
    return "" if value is None else pattern.format(value)


def write_comparison(rows: list[dict[str, Any]], folder: Path) -> Path:
    """Rank the rows, write ``folder/comparison.csv``, print the table; returns the file's path."""
    ranked = rank_rows(rows)
    path = atomic_write_text(Path(folder) / COMPARISON_FILE, comparison_csv(ranked))
    print(render(ranked), flush=True)
    print(f"Comparison of {len(ranked)} job(s) written to {path}", flush=True)
    return path


class ComparisonCallback(Callback):
    """Hydra callback: collects each multirun job's row, writes the comparison after the sweep."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, dict):
            self.rows.append(job_return.return_value)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.rows:
            write_comparison(self.rows, Path(str(config.hydra.sweep.dir)))
        if not any(r["status"] == "ok" for r in self.rows):
            sys.exit(2)  # no job planned: the errors are above, as for a single run
