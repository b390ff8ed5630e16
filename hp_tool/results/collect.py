"""Every candidate's plan and measurement in one pandas table, ranked by the full run's step time.

Sources in a results directory (``<base_results_dir>/<search_config>/``):
    candidate_configs/plan.csv              every candidate: layout, plan status, reason, predictions
    base_cfg_<label>.yaml                   the full run: shape, cluster, steps, global batch, price
    training_logs/<trial_id>/result.json    the trial's measurement (or the launcher's verdict)
    training_logs/<trial_id>/metrics.jsonl  per-step log, used when result.json is missing

A trial runs its layout on the fewest whole nodes while each data-parallel replica does the full run's
work, so its step time carries over; ``full_run_step_time_s`` adds the modelled difference in
data-parallel communication (:func:`hp_tool.estimate.speed.extrapolate_step_time_s`). Successful trials
(status ``ok``) are ranked by that column, fastest first. Costs: :mod:`hp_tool.cost`.
"""

from __future__ import annotations

import csv
import functools
import logging
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from hp_tool import dimensions
from hp_tool.calibration import BOUNDS, StepPoint, fit_memory_offset, fit_step_factors
from hp_tool.cost import cost_columns, epoch_columns
from hp_tool.dimensions import REGIME_COLUMNS, regime_of, regime_words_of
from hp_tool.errors import ConfigError
from hp_tool.contracts.spec import TrialSpec, load_spec
from hp_tool.estimate.layout import Layout
from hp_tool.estimate.speed import extrapolate_step_time_s
from hp_tool.results.full_run import FullRun, load_full_run
from hp_tool.fingerprint import STALE
from hp_tool.results.trial_files import OK, number, read_trial
from hp_tool.sizing import run_days
from hp_tool.throughput import throughput
from hp_tool.vocab import CONFIRM_DIR, NOT_RUN, SELECTED
from hp_tool.words import plural

log = logging.getLogger(__name__)

RANK_COLUMN = "full_run_step_time_s"  # the one column trials are ranked by, ascending
CALIBRATION = "calibration"  # the table's attrs key: the fitted factors in words (None: nothing measured)
RANK_BASIS = "median"  # RANK_COLUMN extrapolates measured_step_time_s, the median of the timed steps
NOT_IN_PLAN = "not_in_plan"
# Order of unranked rows in the table: trials that ran, then those that never did, then the plan's verdicts.
STATUS_ORDER = ("ok", "timeout", "oom", "failed", "cancelled", "unschedulable", "skipped", "pruned_after_oom",
                STALE, NOT_RUN, "over_limit",
                "pruned", "invalid")
# the plan's and the table's columns beside the searched dimensions' (hp_tool/dimensions.py), by type
PLAN_INTS = dimensions.INT_COLUMNS + ("lora_rank", "trainable_parameters", "experts", "top_k", "active_parameters",
                                     "global_batch_size", "num_nodes", "trial_num_nodes", "trial_dp",
                                     "trial_global_batch_size", "predicted_rank")
PLAN_TEXT = dimensions.TEXT_COLUMNS + ("trial_id", "model_family", "plan_status", "reason", "note", "fingerprint",
                                       "memory_check")
BOOL_COLUMNS = dimensions.BOOL_COLUMNS  # written True / False

# Every column of the table, in the order the CSVs use; units in the names.
TABLE_COLUMNS = (
    "rank", "trial_id", "status", "reason", "plan_status", "note", "model_family", "model_size_b",
    *dimensions.layout_columns(), "lora_rank",
    "global_batch_size", "num_nodes", "num_gpus", "trial_num_nodes", "trial_dp", "trial_global_batch_size",
    "trial_world_size",
    "full_run_step_time_s", "confirm_step_time_s", "confirmed_step_time_s", "run_to_run_pct", "predicted_step_time_s", "step_time_error_pct", "calibrated_step_time_s",
    "calibrated_step_time_error_pct", "predicted_compute_s", "predicted_comm_s", "measured_step_time_s",
    "measured_step_time_mean_s", "measured_step_time_std_s", "steps_run", "steps_measured",
    "full_run_tokens_per_s", "full_run_tokens_per_s_per_gpu", "tokens_per_s_per_gpu",
    "predicted_tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu",
    "peak_memory_gib", "predicted_memory_gib", "memory_error_pct", "calibrated_memory_gib", "traced_memory_gib",
    "traced_memory_error_pct",
    "memory_check", "peak_tensor_memory_gib", "predicted_tensor_memory_gib", "traced_tensor_memory_gib",
    "tensor_memory_error_pct", "traced_tensor_memory_error_pct", "calibrated_memory_error_pct",
    "predicted_full_memory_gib", "predicted_host_memory_gib",
    "gpu_memory_gib", "peak_memory_pct_of_gpu",
    "days_to_train", "predicted_days_to_train", "full_run_cost_usd", "cost_usd_per_million_tokens",
    "gpu_hour_price_usd", "predicted_rank", "stop_reason", "final_loss", "device", "start_time", "end_time",
    "fingerprint", "tokens_per_hour", "hours_per_epoch", "cost_usd_per_epoch",
    "trainable_parameters", "experts", "top_k", "active_parameters",
)
INT_COLUMNS = PLAN_INTS + ("rank", "num_gpus", "trial_world_size", "steps_run", "steps_measured")
TEXT_COLUMNS = PLAN_TEXT + ("status", "stop_reason", "device", "start_time", "end_time")
FLOAT_COLUMNS = tuple(c for c in TABLE_COLUMNS if c not in INT_COLUMNS + TEXT_COLUMNS + BOOL_COLUMNS)


def _cell(name: str, text: str) -> Any:
    if text is None or text == "":
        return None
    if name in PLAN_TEXT:
        return text
    if name in BOOL_COLUMNS:
        return text == "True"
    return int(float(text)) if name in PLAN_INTS else float(text)


def read_plan(results_dir: Path) -> list[dict]:
    """candidate_configs/plan.csv as dicts (numbers parsed, empty cells None), one per trial id."""
    path = results_dir / "candidate_configs" / "plan.csv"
    if not path.is_file():
        raise ConfigError("results_dir", str(results_dir), f"has no {path.relative_to(results_dir)}",
                          "run the planner first (python3 main.py search_config=... dry_run=true) "
                          "or point at the results directory of a search")
    with open(path, newline="") as fh:
        rows = [{k: _cell(k, v) for k, v in row.items()} for row in csv.DictReader(fh)]
    by_id = {row["trial_id"]: row for row in rows}  # a repeated id keeps its last row, never two
    return list(by_id.values())


def full_run_for(results_dir: Path) -> FullRun:
    """The full run of the search whose plan is in ``results_dir``."""
    return load_full_run(Path(results_dir), tuple(row["trial_id"] for row in read_plan(Path(results_dir))))


def collect_trials(results_dir: Path, time_box_s: Optional[float] = None,
                   full: Optional[FullRun] = None, memory_overhead_gib: Optional[float] = None) -> pd.DataFrame:
    """One row per candidate (and per trial directory the plan does not know), ranked.

    ``time_box_s``: each trial job's time limit in seconds (tells a killed trial's timeout from a
    failure); None when unknown. ``full``: the search's full run (read from the base config if None).
    ``memory_overhead_gib``: the gpu preset's per-GPU overhead the predictions include (GiB); given, the
    tensor columns hold the predictions without it, beside the trial's measured tensor peak.
    """
    results_dir = Path(results_dir)
    plan = read_plan(results_dir)
    full = full or load_full_run(results_dir, tuple(row["trial_id"] for row in plan))
    logs = results_dir / "training_logs"
    on_disk = {p.name for p in logs.iterdir() if p.is_dir()} if logs.is_dir() else set()
    planned = {row["trial_id"] for row in plan}
    rows = [_row(p, logs / p["trial_id"] if p["trial_id"] in on_disk else None, full, time_box_s)
            for p in plan]
    for trial_id in sorted(on_disk - planned):
        log.warning("training_logs/%s is not in plan.csv (an earlier plan?); shown, not ranked", trial_id)
        rows.append(_unplanned_row(trial_id, logs / trial_id, time_box_s))
    return rank_trials(calibrate(tensor_memory(to_frame(rows), memory_overhead_gib)))


def _row(plan: dict, trial_dir: Optional[Path], full: FullRun, time_box_s: Optional[float]) -> dict:
    row = {k: plan.get(k) for k in TABLE_COLUMNS if k in plan}
    row["status"], row["reason"] = plan["plan_status"], plan.get("reason")
    if plan["plan_status"] != SELECTED:
        return row  # pruned / invalid / over_limit keep the planner's verdict and reason
    result = read_trial(trial_dir, time_box_s, plan.get("fingerprint")) if trial_dir is not None else None
    if result is None:
        row.update(status=NOT_RUN, reason="no result.json or metrics.jsonl in training_logs/"
                                          f"{plan['trial_id']} (never ran, or still pending)")
    elif result["status"] == STALE:
        row.update(status=STALE, reason=result["reason"])
        return row  # its numbers belong to another configuration: none of them in the table
    else:
        row.update(_measured(result))
    row.update(full_run_columns(row, full))
    if result is not None and result["status"] == OK and row.get(RANK_COLUMN) is not None:
        row.update(_confirmation(row, trial_dir / CONFIRM_DIR, full, time_box_s, plan.get("fingerprint")))
    return row


def _confirmation(row: dict, confirm_dir: Path, full: FullRun, time_box_s: Optional[float],
                  fingerprint: Optional[str]) -> dict:
    """The confirmation round's second run of a trial (hp_tool/search.py confirmation_jobs), when it ended ok
    with the same fingerprint: its full-run step time extrapolated as the first's, the mean of the two
    (``confirmed_step_time_s``, what the top trials are ranked by among themselves) and how far the second
    moved from the first, in % (``run_to_run_pct``)."""
    again = read_trial(confirm_dir, time_box_s, fingerprint) if confirm_dir.is_dir() else None
    if again is None or again["status"] != OK or again.get("step_time_s_median") is None:
        return {}
    second = full_run_columns(dict(row, measured_step_time_s=again["step_time_s_median"]), full)[RANK_COLUMN]
    first = row[RANK_COLUMN]
    return {"confirm_step_time_s": second, "confirmed_step_time_s": (first + second) / 2,
            "run_to_run_pct": 100 * (second / first - 1)}


def _unplanned_row(trial_id: str, trial_dir: Path, time_box_s: Optional[float]) -> dict:
    result = read_trial(trial_dir, time_box_s) or {"status": NOT_RUN}
    row = {"trial_id": trial_id, "plan_status": NOT_IN_PLAN, **_measured(result)}
    note = "not in candidate_configs/plan.csv, so not ranked"
    row["reason"] = f"{note}; {row['reason']}" if row.get("reason") else note
    return row


def _one_line(reason: Any) -> Optional[str]:
    """A table cell: the first line of a reason; a traceback stays in result.json."""
    if reason is None or reason == "":
        return None
    text = str(reason).strip()
    first = text.splitlines()[0] if text else ""
    return first if first == text else f"{first} (traceback in result.json)"


def _measured(result: dict) -> dict:
    """The table's measured columns from a result dict (seconds, GiB, tokens/s, TFLOPS)."""
    return {
        "status": result.get("status"), "reason": _one_line(result.get("reason")),
        "measured_step_time_s": number(result.get("step_time_s_median")),
        "measured_step_time_mean_s": number(result.get("step_time_s_mean")),
        "measured_step_time_std_s": number(result.get("step_time_s_std")),
        "steps_run": number(result.get("steps_run")), "steps_measured": number(result.get("steps_measured")),
        "tokens_per_s_per_gpu": number(result.get("tokens_per_s_per_gpu")),
        "model_tflops_per_gpu": number(result.get("model_tflops_per_gpu")),
        "mfu": number(result.get("mfu")), "peak_memory_gib": number(result.get("peak_memory_gib")),
        "peak_tensor_memory_gib": number(result.get("peak_tensor_memory_gib")),
        "trial_world_size": number(result.get("world_size")), "stop_reason": result.get("stop_reason"),
        "final_loss": number(result.get("final_loss")), "device": result.get("device"),
        "start_time": result.get("start_time"), "end_time": result.get("end_time"),
    }


def candidate_spec_path(results_dir: Path, trial_id: str) -> Path:
    """Where the planner wrote what a selected trial runs: ``candidate_configs/<trial_id>.yaml``."""
    return Path(results_dir) / "candidate_configs" / f"{trial_id}.yaml"


def planned_spec(full: FullRun, trial_id: str) -> Optional[TrialSpec]:
    """What a planned trial runs, from its candidate spec (None when it is gone)."""
    path = candidate_spec_path(full.path.parent, trial_id)
    if not path.is_file():
        log.warning("%s is missing: %s is shown without its full-run figures", path, trial_id)
        return None
    return _read_spec(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _read_spec(path: str, mtime_ns: int) -> TrialSpec:
    """A candidate spec read once per version of its file: the adaptive gate asks for a running trial's at
    each new step it sees (read only, never changed by its readers)."""
    return load_spec(path)


def full_run_columns(row: dict, full: FullRun) -> dict:
    """Full-run step time (s), throughput, days and cost from a trial's measured step time; the layouts and
    the model are what the trial's spec says it ran and stands for."""
    cols = {"gpu_memory_gib": full.gpu_memory_gib, "gpu_hour_price_usd": full.gpu_hour_price}
    if row.get("peak_memory_gib") is not None:
        cols["peak_memory_pct_of_gpu"] = 100 * row["peak_memory_gib"] / full.gpu_memory_gib
    spec = planned_spec(full, row["trial_id"])
    if spec is None:
        return cols
    trial, whole, shape = spec.layout(), spec.full_layout(), spec.model.shape()
    cols["num_gpus"] = whole.gpus
    if row.get("trial_world_size") is None:
        cols["trial_world_size"] = trial.gpus
    measured = row.get("measured_step_time_s")
    if measured is None:
        return cols
    step_s = extrapolate_step_time_s(measured, shape, trial, whole, full.hw, spec.resources.num_nodes,
                                     spec.full_run.num_nodes)
    gbs = whole.global_batch_size
    tokens_per_s = throughput(shape, gbs, step_s, whole.gpus, full.peak_tflops_per_gpu, whole.lora)["tokens_per_s"]
    days = run_days(full.max_steps, step_s)
    cols.update(full_run_step_time_s=step_s, full_run_tokens_per_s=tokens_per_s,
                full_run_tokens_per_s_per_gpu=tokens_per_s / whole.gpus, days_to_train=days)
    if row.get("model_tflops_per_gpu") is None:  # derived from metrics.jsonl
        cols.update(_trial_throughput(trial, measured, full, shape))
    if full.gpu_hour_price is not None:
        cols.update(cost_columns(full.gpu_hour_price, whole.gpus, tokens_per_s, days))
    cols.update(epoch_columns(full.gpu_hour_price, whole.gpus, tokens_per_s, full.epoch_tokens))
    if row.get("predicted_step_time_s"):
        cols["step_time_error_pct"] = 100 * (step_s / row["predicted_step_time_s"] - 1)
    return cols


def _trial_throughput(trial: Layout, step_time_s: float, full: FullRun, shape) -> dict:
    """tokens/s and model TFLOPS per GPU and MFU of the trial, by the engine's own definition."""
    rate = throughput(shape, trial.global_batch_size, step_time_s, trial.gpus, full.peak_tflops_per_gpu, trial.lora)
    return {k: rate[k] for k in ("tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu")}


def to_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as a DataFrame with every TABLE_COLUMNS column, nullable integer and float dtypes."""
    df = pd.DataFrame.from_records(rows, columns=list(TABLE_COLUMNS))
    for name in INT_COLUMNS:
        df[name] = pd.to_numeric(df[name], errors="coerce").round().astype("Int64")
    for name in FLOAT_COLUMNS:
        df[name] = pd.to_numeric(df[name], errors="coerce").astype("float64")
    for name in TEXT_COLUMNS:
        df[name] = df[name].astype("object").where(df[name].notna(), None)
    for name in BOOL_COLUMNS:
        df[name] = df[name].astype("boolean")
    measured = df["peak_memory_gib"]
    df["memory_error_pct"] = error_pct(measured, df["predicted_memory_gib"])
    df["traced_memory_error_pct"] = error_pct(measured, df["traced_memory_gib"])
    return df


def error_pct(measured: pd.Series, predicted: pd.Series) -> pd.Series:
    """How far ``measured`` lies above the prediction, in % of the prediction (every *_error_pct column)."""
    return 100 * (measured - predicted) / predicted


def tensor_memory(df: pd.DataFrame, overhead_gib: Optional[float]) -> pd.DataFrame:
    """The analytic and traced predictions without the preset's overhead (GiB), what the trial's measured
    ``peak_tensor_memory_gib`` counts (live tensors only; on CPU the process RSS in ``peak_memory_gib`` adds
    the interpreter and libraries), and the errors (%) of each against it. Empty without the overhead."""
    if overhead_gib is None:
        return df
    df["predicted_tensor_memory_gib"] = df["predicted_memory_gib"] - overhead_gib
    df["traced_tensor_memory_gib"] = df["traced_memory_gib"] - overhead_gib
    df["tensor_memory_error_pct"] = error_pct(df["peak_tensor_memory_gib"], df["predicted_tensor_memory_gib"])
    df["traced_tensor_memory_error_pct"] = error_pct(df["peak_tensor_memory_gib"], df["traced_tensor_memory_gib"])
    return df


def calibrate(df: pd.DataFrame) -> pd.DataFrame:
    """Every candidate's prediction again, with the step-time factors and memory offset the measured trials
    give (:mod:`hp_tool.calibration`): ``calibrated_step_time_s`` beside the raw ``predicted_step_time_s``,
    ``calibrated_memory_gib`` beside ``predicted_memory_gib``; the raw figures where nothing was measured.
    The fitted factors in words go to ``df.attrs[CALIBRATION]``."""
    ok = df[(df["status"] == OK) & df[RANK_COLUMN].notna() & df["predicted_compute_s"].notna()]
    # what the adaptive search calibrates apart; a row without its layout (none) has no residual
    layouts = df[[c for c in REGIME_COLUMNS if c in df.columns]].to_dict("records")  # not a whole row each
    regimes = [regime_of(row) if pd.notna(row.get("tp")) and pd.notna(row.get("pp")) else None for row in layouts]
    factors = fit_step_factors([StepPoint(df.at[i, "predicted_compute_s"], df.at[i, "predicted_comm_s"],
                                          df.at[i, RANK_COLUMN], regimes[df.index.get_loc(i)]) for i in ok.index])
    df["calibrated_step_time_s"] = [factors.predict(c, m, regime) for c, m, regime in
                                    zip(df["predicted_compute_s"], df["predicted_comm_s"], regimes)]
    df["calibrated_step_time_error_pct"] = 100 * (df[RANK_COLUMN] / df["calibrated_step_time_s"] - 1)
    measured = df[(df["status"] == OK) & df["peak_memory_gib"].notna() & df["predicted_memory_gib"].notna()]
    offset = fit_memory_offset(list(measured["predicted_memory_gib"]), list(measured["peak_memory_gib"]))
    df["calibrated_memory_gib"] = df["predicted_memory_gib"] + (offset or 0.0)
    df["calibrated_memory_error_pct"] = error_pct(df["peak_memory_gib"], df["calibrated_memory_gib"])
    df.attrs[CALIBRATION] = None
    if factors.points:
        residuals = "; ".join(f"{regime_words_of(regime)} x{r:.3g}"
                              for regime, r in sorted(factors.residuals.items(), key=lambda kv: str(kv[0])))
        df.attrs[CALIBRATION] = (
            f"Calibrated on {plural(factors.points, 'trial')}: compute x{factors.compute:.3g}, communication "
            f"x{factors.comm:.3g}{' (one common factor)' if factors.common else ''}; each measured regime's own "
            f"residual on them: {residuals}; "
            f"memory {offset or 0.0:+.3g} GiB" + (
                f"; clamped at a bound (x{BOUNDS[0]:g}-x{BOUNDS[1]:g}): the model does not explain these trials, "
                f"so their calibrated figures are not exact, and the adaptive search skips nothing on this fit"
                if factors.clamped else ""))
        log.info("%s", df.attrs[CALIBRATION])
    return df


def rank_trials(df: pd.DataFrame) -> pd.DataFrame:
    """Ranked trials first (status ok with a full-run step time, fastest first, 1-based ``rank``),
    then the rest by status, measured then predicted speed, and trial id. Index 0..n-1."""
    ranked = (df["status"] == OK) & df[RANK_COLUMN].notna() & (df["plan_status"] != NOT_IN_PLAN)
    order = {status: i for i, status in enumerate(STATUS_ORDER)}
    keys = pd.DataFrame({
        "unranked": ~ranked,
        "status": df["status"].map(lambda s: order.get(s, len(order))),
        "speed": df[RANK_COLUMN], "predicted": df["predicted_rank"], "trial_id": df["trial_id"],
    })
    keys = keys.sort_values(["unranked", "status", "speed", "predicted", "trial_id"],
                            na_position="last", kind="mergesort")
    order = list(keys.index)
    # the trials of the confirmation round were timed twice: among the places they hold, the mean of their
    # two runs orders them (the others keep their one run's order)
    confirmed = [i for i in order if ranked[i] and pd.notna(df.at[i, "confirmed_step_time_s"])]
    places = [order.index(i) for i in confirmed]
    for place, i in zip(places, sorted(confirmed, key=lambda i: (df.at[i, "confirmed_step_time_s"],
                                                                    df.at[i, "trial_id"]))):
        order[place] = i
    out = df.loc[order].reset_index(drop=True)
    is_ranked = ranked.loc[order].to_numpy()
    out["rank"] = pd.Series(is_ranked.cumsum(), dtype="Int64").where(is_ranked)
    return out


def successful(df: pd.DataFrame) -> pd.DataFrame:
    """The ranked trials, fastest first."""
    return df[df["rank"].notna()].sort_values("rank")
