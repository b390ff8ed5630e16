"""What the user reads at the end of a search: CSVs, the optimal YAML, plots and a printed summary.

In ``<results_dir>/final_results/`` (N = nodes of the full run):
    final_summary_<N>nodes.csv                 the top ``output_top_n`` successful trials, fastest first
    all_trials_<N>nodes.csv                    every candidate: status, reason, predicted vs measured
    optimal_config_<label>_<N>nodes.yaml       the fastest trial as a full-run TrialSpec
    ds_config_<label>_<N>nodes.json            its DeepSpeed config, when the fastest trial ran DeepSpeed
    throughput.png, predicted_vs_measured.png
    report.md                                  the page to read first: the pick and why, the ranked table,
                                               the plots, what did not run and why, how far the plan held
Both CSVs are ranked by ``full_run_step_time_s`` (see collect.py for the cost formulas); empty cells
mean "not measured" or "not applicable".
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd
from rich.console import Console
from rich.table import Table

from hp_tool.config import AppConfig
from hp_tool.fsutil import atomic_write_text
from hp_tool.results.collect import (FLOAT_COLUMNS, RANK_COLUMN, TABLE_COLUMNS, collect_trials,
                                     full_run_for, successful)
from hp_tool.plan_output import console_for
from hp_tool.results.full_run import FullRun
from hp_tool.results.optimal import ds_config_path, format_usd, optimal_path, write_optimal_config
from hp_tool.results.plots import write_plots
from hp_tool.dimensions import Dimension, cell as dimension_cell, layout_headers, layout_words
from hp_tool.results.report_inputs import (dimension_columns, searched, status_counts, training_report_inputs,
                                           write_report_md)
from hp_tool.sizing import format_days
from hp_tool.vocab import LOSING, NOT_LAUNCHED, NOT_RUN, SELECTED
from hp_tool.words import plural, processes

log = logging.getLogger(__name__)

FINAL_DIR = "final_results"
MEMORY_LIMIT_PCT = 98.0  # above this share of GPU memory a full run is one allocation away from OOM
SIGNIFICANT_DIGITS = 6
ALL_TRIALS_COLUMNS = TABLE_COLUMNS
# the summary's figures, after the columns of the searched dimensions (report_inputs.searched)
SUMMARY_FIGURES = (
    "global_batch_size", "num_nodes", "num_gpus", RANK_COLUMN, "predicted_step_time_s", "measured_step_time_s",
    "full_run_tokens_per_s_per_gpu", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu",
    "peak_memory_gib", "predicted_memory_gib", "peak_memory_pct_of_gpu", "days_to_train",
    "full_run_cost_usd", "cost_usd_per_million_tokens", "status",
)
# a fine-tuning search's summary adds the cookbook's columns: tokens/hour, hours and $ per epoch
FINETUNE_FIGURES = ("trainable_parameters",) + SUMMARY_FIGURES + ("tokens_per_hour", "hours_per_epoch",
                                                                   "cost_usd_per_epoch")
# a mixture of experts' summary names its experts and the experts per token, and the parameters a token runs
# through beside the total (model_size_b); its MFU counts the active FLOPs only
MOE_FIGURES = ("experts", "top_k", "active_parameters")


def summary_columns(df: pd.DataFrame, full: FullRun) -> tuple[str, ...]:
    """The summary CSV's columns: rank and trial id, every dimension the search named (varied, or always
    named), then the figures (a fine-tuning run's and a mixture of experts' added)."""
    finetune = full.epoch_tokens is not None
    figures = FINETUNE_FIGURES if finetune else SUMMARY_FIGURES
    moe = MOE_FIGURES if full.shape.moe else ()
    return ("rank", "trial_id") + dimension_columns(searched(df, finetune)) + moe + figures


def csv_text(df: pd.DataFrame, columns: tuple[str, ...]) -> str:
    """The named columns in this order; floats to 6 significant digits, missing values empty."""
    out = df[list(columns)].copy()
    for name in set(columns) & set(FLOAT_COLUMNS):
        out[name] = out[name].map(lambda x: float(f"{x:.{SIGNIFICANT_DIGITS}g}"), na_action="ignore")
    return out.to_csv(index=False, na_rep="", lineterminator="\n")


def report_paths(results_dir: Path, full: FullRun) -> dict[str, Path]:
    folder = Path(results_dir) / FINAL_DIR
    n = full.num_nodes
    return {"summary": folder / f"final_summary_{n}nodes.csv", "all": folder / f"all_trials_{n}nodes.csv",
            "optimal": optimal_path(folder, full), "ds_config": ds_config_path(folder, full), "folder": folder}


def trial_gpu_hours(trials: pd.DataFrame) -> pd.Series:
    """GPU-hours each trial held its processes, start to end (NaN for a trial that never ran)."""
    start = pd.to_datetime(trials["start_time"], errors="coerce", utc=True)
    end = pd.to_datetime(trials["end_time"], errors="coerce", utc=True)
    return (end - start).dt.total_seconds() / 3600 * trials["trial_world_size"]


def search_cost_line(selected: pd.DataFrame) -> Optional[str]:
    """GPU-hours the trials spent (start to end, times their processes), and about what launching every
    selected candidate and running each to its own stop would have spent: a trial stopped early as losing
    scaled to the mean steps of the trials that ran to their stop, one not launched at their mean hours.
    None when nothing was skipped, pruned or stopped early."""
    not_launched = selected["status"].isin(NOT_LAUNCHED)
    stopped = selected["stop_reason"] == LOSING
    if not (not_launched.any() or stopped.any()):
        return None
    hours = trial_gpu_hours(selected)
    ran = int(hours.notna().sum())
    spent = float(hours.sum())
    if not ran:
        return None
    whole = hours.notna() & ~stopped
    if whole.any():
        steps = float(selected.loc[whole, "steps_run"].mean())
        scaled = hours[stopped] * steps / selected.loc[stopped, "steps_run"]
        estimate = float(hours[whole].sum() + scaled.sum() + hours[whole].mean() * int(not_launched.sum()))
    else:
        estimate = spent / ran * (ran + int(not_launched.sum()))
    early = f" ({int(stopped.sum())} stopped early as losing)" if stopped.any() else ""
    skipped = (f"; {int(not_launched.sum())} not launched ({status_counts(selected[not_launched])})"
               if not_launched.any() else "")
    return (f"Adaptive search: {plural(ran, 'trial')} ran{early} for {spent:.3g} GPU-hours{skipped}; launching every selected "
            f"candidate and running each to its stop would have spent about {estimate:.3g} GPU-hours "
            f"({spent / estimate:.0%} of it spent).")


def _memory_note(ranked: pd.DataFrame) -> str:
    best = ranked.iloc[0]
    pct = best["peak_memory_pct_of_gpu"]
    if pd.isna(pct) or pct <= MEMORY_LIMIT_PCT:
        return ""
    note = (f" Its peak memory, {best['peak_memory_gib']:.2f} GiB, is {pct:.1f}% of the "
            f"{best['gpu_memory_gib']:g} GiB per GPU, above {MEMORY_LIMIT_PCT:g}%: the full run may run "
            f"out of memory.")
    safe = ranked[ranked["peak_memory_pct_of_gpu"] <= MEMORY_LIMIT_PCT]
    if safe.empty:
        return note + f" No successful trial stays below {MEMORY_LIMIT_PCT:g}%."
    alt = safe.iloc[0]
    return note + (f" The fastest trial below that line is {alt['trial_id']} (rank {alt['rank']}, "
                   f"{alt[RANK_COLUMN]:.4g} s per step, {alt['peak_memory_pct_of_gpu']:.1f}% of memory, "
                   f"{format_days(alt['days_to_train'])}).")


def recommendation(ranked: pd.DataFrame, full: FullRun, optimal: Path, dims: list[Dimension]) -> str:
    """One sentence naming the fastest trial, its layout (every dimension of ``dims``), duration and cost
    (plus a memory warning)."""
    best = ranked.iloc[0]
    cost = ""
    if not pd.isna(best["full_run_cost_usd"]):
        cost = (f", about {format_usd(best['full_run_cost_usd'])} "
                f"({format_usd(best['cost_usd_per_million_tokens'])} per million tokens)")
    ran_on = processes(int(best["num_gpus"]), best.get("device") == "cpu")
    return (f"Recommended: {best['trial_id']} ({layout_words(best, dims)}) on {plural(full.num_nodes, 'node')}, "
            f"{ran_on}: {best[RANK_COLUMN]:.4g} s per step, "
            f"{best['full_run_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU; {full.max_steps:,} steps take "
            f"about {format_days(best['days_to_train'])}{cost}. Config: {optimal}."
            + _memory_note(ranked))


def render_summary(df: pd.DataFrame, top_n: int, full: FullRun, paths: dict[str, Path]) -> str:
    """The printed summary: counts, the top-N table and the recommendation (or why there is none)."""
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    ranked = successful(df)
    selected = df[df["plan_status"] == SELECTED]
    console.print(f"{len(ranked)} of {len(selected)} selected trials succeeded ({status_counts(selected)}); "
                  f"every candidate with its reason: {paths['all']}")
    cost = search_cost_line(selected)
    if cost:
        console.print(cost)
    if ranked.empty:
        pending = " No selected trial has left any output yet." if (selected["status"] == NOT_RUN).all() else ""
        console.print(f"No trial succeeded, so there is no recommendation.{pending} Read the status and reason "
                      f"columns of {paths['all']} and the job logs in training_logs/<trial_id>/.")
        return console.file.getvalue()  # type: ignore[attr-defined]
    table = Table(title=f"Fastest {min(top_n, len(ranked))} of {len(ranked)} on {full.num_nodes} node(s)")
    finetune = full.epoch_tokens is not None
    named = searched(df, finetune)
    dims = layout_headers(named)
    figures = ["step s", "tok/s/GPU", "MFU", "mem GiB", "days", "$ / M tok"]
    if finetune:
        figures += ["M tok/h", "h/epoch", "$/epoch"]
    for h in ["rank", "trial_id", *(header for _, header in dims), *figures]:
        table.add_column(h, justify="left" if h == "trial_id" else "right", no_wrap=h == "trial_id")

    def cell(x: Any, fmt: str) -> str:
        return "" if pd.isna(x) else format(x, fmt)

    for _, r in ranked.head(top_n).iterrows():
        cells = [str(r["rank"]), r["trial_id"], *(dimension_cell(c, r) for c, _ in dims),
                 f"{r[RANK_COLUMN]:.4g}", f"{r['full_run_tokens_per_s_per_gpu']:,.0f}",
                 cell(100 * r["mfu"], ".1f") + ("%" if not pd.isna(r["mfu"]) else ""),
                 cell(r["peak_memory_gib"], ".2f"), f"{r['days_to_train']:.3g}",
                 cell(r["cost_usd_per_million_tokens"], ".3g")]
        if finetune:
            cells += [cell(r["tokens_per_hour"] / 1e6, ",.3g"), cell(r["hours_per_epoch"], ".3g"),
                      cell(r["cost_usd_per_epoch"], ",.2f")]
        table.add_row(*cells)
    head = console.file.getvalue()  # type: ignore[attr-defined]
    console = console_for(table, 160)
    console.print(table)
    raw, calibrated = ranked["step_time_error_pct"].abs(), ranked["calibrated_step_time_error_pct"].abs()
    if raw.notna().any() and calibrated.notna().any():
        console.print(f"Step-time model on the {int(raw.notna().sum())} measured trials: median error "
                      f"{raw.median():.0f}% raw, {calibrated.median():.0f}% calibrated on them "
                      f"(calibrated_step_time_s in {paths['all'].name})")
    console.print(recommendation(ranked, full, paths["optimal"], named))
    noise = noise_line(ranked)
    if noise:
        console.print(noise)
    return head + console.file.getvalue()  # type: ignore[attr-defined]


def write_reports(results_dir: Path, df: pd.DataFrame, full: FullRun, top_n: int) -> dict[str, Path]:
    """Write the CSVs, the optimal YAML (when a trial succeeded) and the plots; returns their paths."""
    paths = report_paths(results_dir, full)
    ranked = successful(df)
    atomic_write_text(paths["all"], csv_text(df, ALL_TRIALS_COLUMNS))
    atomic_write_text(paths["summary"], csv_text(ranked.head(top_n), summary_columns(df, full)))
    if ranked.empty:
        for stale in (paths["optimal"], paths["ds_config"]):
            if stale.exists():  # an earlier collection's pick is no longer backed by a success
                log.warning("Removing %s: no trial succeeded in this collection", stale)
                stale.unlink()
    else:
        write_optimal_config(results_dir, ranked.iloc[0], full, len(ranked), paths["folder"])
    paths["plots"] = write_plots(df, paths["folder"])  # type: ignore[assignment]
    paths["report"] = write_report_md(paths["folder"], training_report_inputs(
        df, f"{full.base.model.family} {full.label} on {full.num_nodes} node(s)", paths["plots"],
        [paths[k].name for k in ("summary", "all", "optimal", "ds_config") if paths[k].exists()], _notes(df),
        finetune=full.epoch_tokens is not None))
    log.info("Wrote %s, %s, plots and %s in %s", paths["summary"].name, paths["all"].name, paths["report"].name,
             paths["folder"])
    return paths


def confirmation_line(ranked: pd.DataFrame) -> Optional[str]:
    """What the confirmation round (hp_tool/search.py confirmation_jobs) found, or None when it did not run:
    each top trial's two full-run step times, how far a time moved between runs, and whether the top two
    (ranked by the mean of their two runs) are apart by more than that."""
    confirmed = ranked[ranked["confirmed_step_time_s"].notna()]
    if confirmed.empty:
        return None
    runs = "; ".join(f"{r['trial_id']} {r[RANK_COLUMN]:.4g} s, then {r['confirm_step_time_s']:.4g} s "
                     f"({r['run_to_run_pct']:+.1f}%)" for _, r in confirmed.iterrows())
    spread = float(confirmed["run_to_run_pct"].abs().max())
    text = (f"Confirmation round: the {plural(len(confirmed), 'fastest trial')} timed again: {runs}; "
            f"between runs a time moved by up to {spread:.1f}%.")
    if len(confirmed) < 2:
        return text
    best, second = confirmed.iloc[0], confirmed.iloc[1]
    gap = 100 * (second["confirmed_step_time_s"] / best["confirmed_step_time_s"] - 1)
    if gap <= spread:
        return text + (f" The top two are tied within noise: {gap:.1f}% apart on the mean of their two runs, "
                       f"+-{spread:.1f}% between runs; either layout will do.")
    return text + (f" {best['trial_id']} leads by {gap:.1f}% on the mean of two runs each, beyond the "
                   f"{spread:.1f}% between runs.")


def noise_line(ranked: pd.DataFrame) -> Optional[str]:
    """The noise the ranking stands on: the confirmation round's (``confirmation_line``) where it ran; else each
    trial's timed steps' own spread (standard deviation over the median step) and whether the top two are apart
    by more than their medians are known to from those steps (twice the standard error of their difference,
    each trial's standard deviation over the square root of its timed steps), and that a run-to-run spread is
    not in it. None when no trial has two timed steps."""
    confirmed = confirmation_line(ranked)
    if confirmed:
        return confirmed
    std, median, n = (ranked[c] for c in ("measured_step_time_std_s", "measured_step_time_s", "steps_measured"))
    timed = std.notna() & (median > 0) & (n >= 2)
    if not timed.any():
        return None
    cv = 100 * std[timed] / median[timed]
    text = (f"Noise: no confirmation round (train_settings.confirm_top=0): each trial is ranked on one run. Within "
            f"its run a trial's timed steps varied by {cv.median():.1f}% (their standard deviation over the median "
            f"step; the median of {plural(int(timed.sum()), 'trial')}, up to {cv.max():.1f}%).")
    if len(ranked) >= 2 and timed.iloc[:2].all():
        best, second = ranked.iloc[0], ranked.iloc[1]
        gap = 100 * (second[RANK_COLUMN] / best[RANK_COLUMN] - 1)
        errors = [100 * r["measured_step_time_std_s"] / r["measured_step_time_s"] / math.sqrt(r["steps_measured"])
                  for r in (best, second)]
        band = 2 * math.hypot(*errors)
        text += (f" The top two are {gap:.1f}% apart, within the +-{band:.1f}% their timed steps pin the difference "
                 f"to: another run may swap them." if gap <= band else
                 f" The top two are {gap:.1f}% apart, beyond the +-{band:.1f}% their timed steps pin the difference "
                 f"to.")
    return text + (" A time moves more between runs than within one (the machine's other load, a cold start), "
                   "which this does not measure: train_settings.confirm_top=2 times the two fastest again.")


def _notes(df: pd.DataFrame) -> list[str]:
    """report.md's lines under the pick: the memory warning, the noise it ranked under (``noise_line``) and the
    adaptive search's savings."""
    ranked = successful(df)
    notes = [_memory_note(ranked).strip(), noise_line(ranked) or ""] if not ranked.empty else []
    notes.append(search_cost_line(df[df["plan_status"] == SELECTED]) or "")
    return [n for n in notes if n]


@dataclass
class FinalResults:
    """What collecting a training search gave: the ranked table, the full run it was ranked for and the
    files written. The caller logs the table to W&B when enabled (tracking.log_summary)."""

    table: pd.DataFrame  # every candidate, ranked (collect.collect_trials)
    full: FullRun
    paths: dict[str, Path]  # report_paths, plus the plots

    def exit_code(self) -> int:
        """0 when at least one trial succeeded; else 1, and the log says why none did."""
        if successful(self.table).empty:
            log.error("No trial succeeded (%s); see %s", status_counts(self.table), self.paths["all"])
            return 1
        return 0


def collect_and_report(results_dir: Path, app: AppConfig) -> FinalResults:
    """Collect every trial, write final_results/* and print the summary; returns the ranked table."""
    results_dir = Path(results_dir)
    ts = app.search_config.train_settings
    full = full_run_for(results_dir)
    df = collect_trials(results_dir, time_box_s=ts.max_minutes_per_run * 60, full=full,
                        memory_overhead_gib=app.gpu.memory_overhead_gib)
    paths = write_reports(results_dir, df, full, ts.output_top_n)
    print(render_summary(df, ts.output_top_n, full, paths), flush=True)
    return FinalResults(df, full, paths)
