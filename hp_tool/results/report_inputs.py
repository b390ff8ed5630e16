"""What report.md shows, taken from the collected tables (pure), and the one writer of the page.

Training: the collector's table (:func:`hp_tool.results.collect.collect_trials`), ranked by
``RANK_COLUMN``. Inference: the inference summary frame (:func:`hp_tool.inference.report.summary_frame`),
ranked by generated tokens/s per GPU within the latency bound. Every figure on the page is a column
those tables hold; nothing here recomputes one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Optional

import pandas as pd

from hp_tool import dimensions
from hp_tool.dimensions import Dimension, layout_columns, layout_words, regime_of
from hp_tool.fsutil import atomic_write_text
from hp_tool.vocab import INFERENCE_CSV, INFERENCE_PLOT
from hp_tool.vocab import NOT_RUN, SELECTED
from hp_tool.results.collect import CALIBRATION, RANK_BASIS, RANK_COLUMN, successful
from hp_tool.results.plots import CAPTIONS, on_cpu
from hp_tool.results.report_md import (REPORT_FILE, ModelError, Pick, Plot, RankMetric, ReportInputs, Unranked,
                                       render_report)

TRAINING_METRIC = RankMetric(RANK_COLUMN, "full-run step time", "s", RANK_BASIS)
# the ranked table's figures, after the columns of the searched dimensions (``searched``)
REPORT_COLUMNS = (
    RANK_COLUMN, "confirm_step_time_s", "measured_step_time_s", "measured_step_time_mean_s", "predicted_step_time_s",
    "calibrated_step_time_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "peak_tensor_memory_gib",
    "days_to_train",
)
INFERENCE_METRIC = RankMetric("tokens_per_s_per_gpu", "generated tokens/s per GPU", "tokens/s", "median",
                              lower_is_better=False, repeats="timed generations' batch latency",
                              order="configs within the p99 latency bound first")
INFERENCE_COLUMNS = ("config_id", "tp", "pp", "batch_size", "weights", "kv_cache", "num_gpus", "tokens_per_s_per_gpu",
                     "predicted_tokens_per_s_per_gpu", "usd_per_million_tokens", "latency_ms_p50", "predicted_latency_ms",
                     "latency_ms_p99",
                     "time_to_first_token_ms", "predicted_ttft_ms", "predicted_tpot_ms", "meets_latency_bound",
                     "predicted_memory_gib")
IN_SAMPLE = ("Calibrated predictions are fitted to these same measured trials (hp_tool/calibration.py: a compute "
             "and a communication factor, a residual per regime, a memory offset), so their error here is "
             "in-sample: a regime with one measured trial is matched exactly by construction, unless the fit "
             "was clamped at its bounds (then the factors above say so). For a layout "
             "nobody measured, expect an error between the raw and the calibrated column.")


def _value(x: Any) -> Any:
    """A cell for the page: None for a missing value, plain Python numbers otherwise."""
    if x is None or (not isinstance(x, str) and pd.isna(x)):
        return None
    return x.item() if hasattr(x, "item") else x


def _unranked(frame: pd.DataFrame, name: str) -> tuple[Unranked, ...]:
    return tuple(Unranked(r[name], r["status"], _value(r["reason"]) or "") for _, r in frame.iterrows())


def _records(frame: pd.DataFrame, columns: Iterable[str]) -> tuple[dict, ...]:
    columns = list(columns)
    return tuple({c: _value(r[c]) for c in columns} for _, r in frame[columns].iterrows())


def status_counts(df: pd.DataFrame) -> str:
    counts = df["status"].value_counts()
    return ", ".join(f"{counts[s]} {s}" for s in sorted(counts.index))


def searched(df: pd.DataFrame, finetune: bool) -> list[Dimension]:
    """The dimensions a search's table and sentences name (``dimensions.searched`` over its candidates)."""
    return dimensions.searched(df.to_dict("records"), finetune)


def dimension_columns(dims: list[Dimension]) -> tuple[str, ...]:
    """The columns a table shows for these dimensions: theirs (DP after PP), the adapters' rank after a
    method."""
    columns = layout_columns(dims)
    return columns + ("lora_rank",) if "method" in columns else columns


def _pick(row: pd.Series, planned: int, cpu: bool, dims: list[Dimension]) -> Pick:
    # a trial of the confirmation round is ranked by the mean of its two runs (collect.rank_trials)
    value = row["confirmed_step_time_s"] if pd.notna(row.get("confirmed_step_time_s")) else row[RANK_COLUMN]
    return Pick(row["trial_id"], layout_words(row, dims), float(value), _value(row["peak_memory_gib"]),
                _value(row["gpu_memory_gib"]), _value(row["predicted_rank"]), planned,
                "peak RSS per process" if cpu else "peak per GPU")


def _median_abs(values: pd.Series) -> Optional[float]:
    values = values.dropna().abs()
    return float(values.median()) if len(values) else None


def model_errors(ranked: pd.DataFrame, cpu: bool) -> tuple[ModelError, ...]:
    """Median absolute error of each prediction over the ranked trials, from the collector's columns."""
    def error(quantity: str, compared: str, raw: str, calibrated: Optional[str] = None) -> ModelError:
        return ModelError(quantity, compared, int(ranked[raw].notna().sum()), _median_abs(ranked[raw]),
                          _median_abs(ranked[calibrated]) if calibrated else None)

    process = ("process RSS, not comparable: it adds the interpreter and libraries" if cpu
               else "memory per GPU, overhead included")
    step = error("step time", f"{RANK_COLUMN} vs predicted_step_time_s / calibrated_step_time_s",
                 "step_time_error_pct", "calibrated_step_time_error_pct")
    exact = step.calibrated_pct is not None and step.calibrated_pct < 0.01  # a clamped residual is not exact
    measured = ranked[ranked["step_time_error_pct"].notna()]
    per_regime = Counter(regime_of(row) for row in measured.to_dict("records"))
    if step.trials and exact and max(per_regime.values(), default=0) == 1:  # each regime's residual fits its trial
        step = replace(step, calibrated_pct=None, calibrated_note="exact by construction: one trial per regime")
    return (
        step,
        error("tensor memory, analytic", "peak_tensor_memory_gib vs predicted_tensor_memory_gib",
              "tensor_memory_error_pct"),
        error("tensor memory, traced", "peak_tensor_memory_gib vs traced_tensor_memory_gib",
              "traced_tensor_memory_error_pct"),
        error(process, "peak_memory_gib vs predicted_memory_gib / calibrated_memory_gib",
              "memory_error_pct", "calibrated_memory_error_pct"),
    )


def report_columns(dims: list[Dimension], confirmed: bool = True) -> tuple[str, ...]:
    """The ranked table's columns: rank and trial id, the searched dimensions', then REPORT_COLUMNS (the
    confirmation round's second time only when ``confirmed``: some trial has one)."""
    figures = REPORT_COLUMNS if confirmed else tuple(c for c in REPORT_COLUMNS if c != "confirm_step_time_s")
    return ("rank", "trial_id") + dimension_columns(dims) + figures


def _trust_note(df: pd.DataFrame) -> str:
    """The factors the collector fitted (``collect.calibrate``), and how to read the calibrated errors."""
    fitted = df.attrs.get(CALIBRATION)
    return f"{fitted}. {IN_SAMPLE}" if fitted else IN_SAMPLE


def _counts(df: pd.DataFrame) -> str:
    selected = df[df["plan_status"] == SELECTED]
    ranked = int(df["rank"].notna().sum())
    text = f"{ranked} of {len(selected)} selected trials succeeded ({status_counts(selected)})."
    pending = int((selected["status"] == NOT_RUN).sum())
    if pending:
        text += (f" {pending} have not run yet (pending, or never launched): this page is rewritten at every "
                 f"collection, so it stands for the search so far.")
    return text


def training_report_inputs(df: pd.DataFrame, title: str, plots: Iterable[Path], files: Iterable[str] = (),
                           notes: Iterable[str] = (), finetune: bool = False) -> ReportInputs:
    """The page of a training search from the collector's ranked table; ``plots``: the files written."""
    ranked = successful(df)
    cpu = on_cpu(df)
    planned = int(df["predicted_rank"].notna().sum()) or None
    dims = searched(df, finetune)
    picks = [_pick(row, planned, cpu, dims) for _, row in ranked.head(2).iterrows()]
    rest = df[df["rank"].isna()]
    columns = report_columns(dims, bool(ranked["confirm_step_time_s"].notna().any()))
    return ReportInputs(
        title=title, metric=TRAINING_METRIC, columns=columns, ranked=_records(ranked, columns),
        pick=picks[0] if picks else None, runner_up=picks[1] if len(picks) > 1 else None,
        unranked=_unranked(rest, "trial_id"),
        plots=tuple(Plot(p.name, CAPTIONS.get(p.name, p.stem)) for p in plots), counts=_counts(df),
        trust_note=_trust_note(df), errors=model_errors(ranked, cpu), files=tuple(files), notes=tuple(notes))


def _inference_pick(row: pd.Series, bound_ms: float) -> Pick:
    layout = (f"TP={row['tp']}, PP={row['pp']}, batch {row['batch_size']} on {row['num_gpus']} GPU(s), "
              f"p99 batch latency {row['latency_ms_p99']:.4g} ms (bound {bound_ms:g} ms)")
    return Pick(row["config_id"], layout, float(row["tokens_per_s_per_gpu"]))


def prediction_error_line(ok: pd.DataFrame) -> str:
    """How far the serving-time model's predictions were from what ran: the median |predicted / measured - 1| of
    the batch latency and of the tokens/s per GPU (no calibration on these configs: hp_tool/estimate/serving.py)."""
    parts = []
    for what, predicted, measured in (("batch latency", "predicted_latency_ms", "latency_ms_p50"),
                                      ("tokens/s per GPU", "predicted_tokens_per_s_per_gpu", "tokens_per_s_per_gpu")):
        pairs = ok[[predicted, measured]].apply(pd.to_numeric, errors="coerce").dropna()
        if not pairs.empty:
            error = (pairs[predicted] / pairs[measured] - 1).abs().median()
            parts.append(f"{what} {error:.0%} median error over {len(pairs)} configs")
    return ("The serving-time model (hp_tool/estimate/serving.py, fitted on published serving runs, not on these) "
            "predicted " + "; ".join(parts) + "." if parts else "")


def inference_report_inputs(frame: pd.DataFrame, max_latency_ms: float, plot: bool,
                            serve: Optional[str] = None) -> ReportInputs:
    """The page of an inference search from its ranked summary frame (within the bound first); ``serve``: the
    command that serves the pick (``vllm serve ...``), where the checkpoint is known."""
    ok = frame[frame["status"] == "ok"]
    within = ok[ok["meets_latency_bound"].astype(bool)]
    picks = [_inference_pick(row, max_latency_ms) for _, row in within.head(2).iterrows()]
    notes = () if picks or ok.empty else (f"No config that ran meets the {max_latency_ms:g} ms p99 latency "
                                          f"bound; raise inference_settings.max_latency_ms or add smaller batches.",)
    if picks and serve:
        notes += (f"Serve the pick with vLLM: `{serve}`",)
    rest = frame[frame["status"] != "ok"]
    return ReportInputs(
        title="Inference search", metric=INFERENCE_METRIC, columns=INFERENCE_COLUMNS,
        ranked=_records(ok, INFERENCE_COLUMNS), pick=picks[0] if picks else None,
        runner_up=picks[1] if len(picks) > 1 else None,
        unranked=_unranked(rest, "config_id"),
        plots=(Plot(INFERENCE_PLOT, "p99 batch latency against generated tokens/s per GPU, Pareto front"),)
        if plot and not ok.empty else (),
        counts=f"{len(ok)} of {len(frame)} configs ran ({status_counts(frame)}).",
        trust_note=" ".join(filter(None, (prediction_error_line(ok), "Its configs do not measure memory, so "
                                          "predicted_memory_gib (what pruned) is untested here."))),
        files=(INFERENCE_CSV,), notes=notes)


def write_report_md(folder: Path, inputs: ReportInputs) -> Path:
    """``folder``/report.md, written atomically; returns its path."""
    return atomic_write_text(Path(folder) / REPORT_FILE, render_report(inputs))


def write_inference_report(folder: Path, frame: pd.DataFrame, max_latency_ms: float,
                           serve: Optional[str] = None) -> Path:
    """The inference search's report.md beside its final_output.csv and plot."""
    plot = (Path(folder) / INFERENCE_PLOT).is_file()
    return write_report_md(folder, inference_report_inputs(frame, max_latency_ms, plot, serve))
