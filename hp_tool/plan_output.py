"""Writing and showing a plan: base config, candidate TrialSpecs, plan.csv, the printed table."""

from __future__ import annotations

import csv
import dataclasses
import io
import logging
from pathlib import Path
from typing import Any, Iterable

from hp_tool.architectures import active_parameters
from hp_tool.candidates import Candidate
from hp_tool.cost import cost_columns, epoch_columns
from hp_tool.dimensions import cell, layout_columns, layout_headers, searched
from hp_tool.families.methods import trainable_parameters
from hp_tool.fsutil import atomic_write_text
from hp_tool.planner import Plan, candidate_dimensions
from hp_tool.sizing import run_days
from hp_tool.contracts.spec import dump_spec
from hp_tool.vocab import INVALID, OVER_LIMIT, PRUNED, SELECTED, TRACE_CACHE_FILE
from hp_tool.words import plural

log = logging.getLogger(__name__)


def plan_columns() -> tuple[str, ...]:
    """plan.csv's columns: the dimension table's (read as the plan is written) among the plan's own."""
    return (
        "trial_id", "model_family", "model_size_b", *layout_columns(), "lora_rank",
        "global_batch_size", "num_nodes", "trial_num_nodes", "trial_dp", "trial_global_batch_size",
        "fingerprint", "predicted_memory_gib", "traced_memory_gib", "memory_check",
        "predicted_full_memory_gib", "predicted_host_memory_gib", "predicted_step_time_s", "predicted_compute_s",
        "predicted_comm_s", "predicted_tokens_per_s_per_gpu",
        "predicted_model_tflops_per_gpu", "predicted_days_to_train", "predicted_full_run_cost_usd",
        "predicted_cost_usd_per_million_tokens", "predicted_rank", "plan_status", "reason", "note",
        "predicted_mfu", "predicted_tokens_per_hour", "predicted_hours_per_epoch",
        "predicted_cost_usd_per_epoch", "predicted_rank0_host_memory_gib",
        "trainable_parameters", "experts", "top_k", "active_parameters",
    )


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def plan_rows(plan: Plan) -> Iterable[dict[str, Any]]:
    """One row per candidate, in grid order; units in the column names."""
    m, full = plan.model, plan.base.full_run
    price, gpus = plan.cluster.gpu_hour_price, plan.cluster.gpus
    specs = {s.trial_id: s for s in plan.specs}  # what each selected trial runs, as its YAML says
    epoch_tokens = full.epoch_tokens
    counts: dict[tuple, tuple[int, int]] = {}  # (shape, adapters) -> (trainable, active) parameters: few of them
    for c in plan.candidates:
        trial_id = c.trial_id
        spec = specs.get(trial_id)
        days = None if c.step_time_s is None else run_days(full.max_steps, c.step_time_s)
        key = (c.shape, c.full.lora)
        if key not in counts:
            counts[key] = (trainable_parameters(c.shape, c.full.lora, m.num_parameters), active_parameters(c.shape))
        trainable, active = counts[key]
        cost, epoch = {}, {}
        if days is not None and price is not None:
            cost = cost_columns(price, gpus, c.tokens_per_s_per_gpu * gpus, days)
        if c.step_time_s is not None:
            epoch = epoch_columns(price, gpus, c.tokens_per_s_per_gpu * gpus, epoch_tokens)
        yield {
            "trial_id": trial_id,
            "model_family": m.shape.family, "model_size_b": round(m.num_parameters / 1e9, 6),
            **candidate_dimensions(c),  # every searched dimension, as the trial's spec runs it
            "dp": c.dp, "global_batch_size": c.full.global_batch_size, "num_nodes": full.num_nodes,
            "trial_num_nodes": spec.resources.num_nodes if spec else c.trial_nodes or None,
            "trial_dp": spec.parallel.dp if spec else c.trial_dp or None,
            "trial_global_batch_size": spec.training.global_batch_size if spec else None,
            "fingerprint": spec.fingerprint() if spec else None,
            "predicted_memory_gib": _round(c.memory_gib, 3),
            "traced_memory_gib": _round(c.traced_memory_gib, 3), "memory_check": c.memory_check,
            "predicted_full_memory_gib": _round(c.full_memory_gib, 3),
            "predicted_host_memory_gib": _round(c.host_memory_gib, 2),
            "predicted_step_time_s": _round(c.step_time_s, 6),
            "predicted_compute_s": _round(c.compute_time_s, 6), "predicted_comm_s": _round(c.comm_time_s, 6),
            "predicted_tokens_per_s_per_gpu": _round(c.tokens_per_s_per_gpu, 2),
            "predicted_model_tflops_per_gpu": _round(c.model_tflops_per_gpu, 3),
            "predicted_days_to_train": _round(days, 3),
            "predicted_full_run_cost_usd": _round(cost.get("full_run_cost_usd"), 2),
            "predicted_cost_usd_per_million_tokens": _round(cost.get("cost_usd_per_million_tokens"), 6),
            "predicted_rank": c.rank,
            "plan_status": c.status, "reason": c.reason, "note": c.note or None,
            "predicted_mfu": None if c.model_tflops_per_gpu is None else round(
                c.model_tflops_per_gpu / plan.cluster.hw.peak_tflops, 4),
            "predicted_tokens_per_hour": _round(epoch.get("tokens_per_hour"), 0),
            "predicted_hours_per_epoch": _round(epoch.get("hours_per_epoch"), 4),
            "predicted_cost_usd_per_epoch": _round(epoch.get("cost_usd_per_epoch"), 2),
            "predicted_rank0_host_memory_gib": _round(c.rank0_host_memory_gib, 2),
            "lora_rank": c.full.lora.rank if c.full.lora else None,
            "trainable_parameters": trainable,
            "experts": c.shape.num_experts or None, "top_k": c.shape.top_k or None,
            "active_parameters": active,
        }



def plan_csv_text(plan: Plan) -> str:
    """plan.csv: ``plan_columns``, one line per candidate (``plan_rows``), a missing value empty."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = plan_columns()
    writer.writerow(columns)
    writer.writerows([("" if (v := row.get(k)) is None else v) for k in columns] for row in plan_rows(plan))
    return buf.getvalue()


def write_plan(plan: Plan) -> Path:
    """Write base_cfg_<size>.yaml, candidate_configs/<trial_id>.yaml and candidate_configs/plan.csv."""
    out = plan.results_dir
    dump_spec(plan.base, out / f"base_cfg_{plan.model.label}.yaml")
    cand_dir = out / "candidate_configs"
    for spec in plan.specs:
        dump_spec(spec, cand_dir / f"{spec.trial_id}.yaml")
    if plan.tracer is not None:
        atomic_write_text(cand_dir / TRACE_CACHE_FILE, plan.tracer.text())
    atomic_write_text(cand_dir / "plan.csv", plan_csv_text(plan))
    log.info("Wrote the plan to %s (%d trial configs)", cand_dir, len(plan.specs))
    return cand_dir


def _counts(cands: list[Candidate]) -> str:
    counts: dict[str, int] = {}
    for c in cands:
        counts[c.status] = counts.get(c.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def funnel_line(cands: list[Candidate]) -> str:
    """What each stage of planning removed: validity (by config key), the GPU-memory and host-RAM prunes,
    the run limit; and how many candidates the memory model estimated (the step time those that fit)."""
    invalid: dict[str, int] = {}
    for c in cands:
        if c.status == INVALID:
            key = c.reason_key.rsplit(".", 1)[-1]
            invalid[key] = invalid.get(key, 0) + 1
    estimated = sum(c.full_memory_gib is not None for c in cands)
    gpu = sum(c.status == PRUNED and c.reason_key == "gpu.memory_gib" for c in cands)
    host = sum(c.status == PRUNED and c.reason_key == "gpu.host_ram_gib" for c in cands)
    rules = ", ".join(f"{n} {k}" for k, n in sorted(invalid.items(), key=lambda kv: -kv[1]))
    return (f"Plan: {plural(len(cands), 'candidate')}; {sum(invalid.values())} invalid" + (f" ({rules})" if rules else "")
            + f"; {estimated} estimated; {gpu} pruned on GPU memory, {host} on host RAM; "
            f"{sum(c.status == OVER_LIMIT for c in cands)} over the run limit; "
            f"{sum(c.status == SELECTED for c in cands)} selected.")


def _rank0_line(plan: Plan) -> str:
    """When saving the model (gathered on rank 0) needs more host RAM than a node has: what rank 0 needs.
    Such layouts stay selected; the other nodes need only what they train with."""
    host = plan.cluster.hw.host_ram_gib
    selected = [c for c in plan.candidates if c.status == SELECTED]
    short = [c for c in selected if host is not None and c.rank0_host_memory_gib > host]
    if not short:
        return ""
    need = max(c.rank0_host_memory_gib for c in short)
    return (f"Saving: rank 0 gathers the whole model to write the checkpoint and needs up to {need:.0f} GiB of host "
            f"RAM ({len(short)} of {len(selected)} selected layouts; see predicted_rank0_host_memory_gib), more than "
            f"the {host:g} GiB of gpu.host_ram_gib: run rank 0 on a node with at least {need:.0f} GiB, the others on "
            "nodes of the preset.")


def _memory_line(plan: Plan) -> str:
    """How the candidates' memory was checked: the analytic formula, or traced (how many, how long)."""
    if plan.tracer is None:
        return ("Memory: analytic estimate (GPU GiB); memory_check=traced traces the engine's model per rank "
                "before launch.")
    traced = [c for c in plan.candidates if c.memory_check == "traced"]
    pruned = sum(c.status == PRUNED for c in traced)  # only candidates that fit by the formula are traced
    untraced = sum(c.memory_check.startswith("analytic:") for c in plan.candidates)
    seconds = plan.tracer.seconds
    timing = (f"; {len(seconds)} traced now, at most {max(seconds):.1f} s each on one core" if seconds
              else "; all from the cache")
    return (f"Memory: traced per rank under fake tensors for {plural(len(traced), 'candidate')} (traced GiB includes the "
            f"{plan.cluster.hw.memory_overhead_gib:g} GiB overhead){timing}; {pruned} pruned by the trace"
            + (f", {untraced} kept the analytic figure (see memory_check in plan.csv)" if untraced else "") + ".")


def console_for(table, minimum: int = 160):
    """A text console wide enough for ``table`` at its natural width (none of its cells cut), at least
    ``minimum`` columns for the sentences around it."""
    from rich.console import Console
    from rich.measure import Measurement

    probe = Console(file=io.StringIO(), width=10_000, force_terminal=False)
    width = Measurement.get(probe, probe.options, table).maximum
    return Console(file=io.StringIO(), width=max(minimum, width), force_terminal=False)


def _money(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def render_plan(plan: Plan, max_rows: int = 25) -> str:
    """The plan as text: the sentence, then the selected candidates, predicted fastest first."""
    from rich.table import Table

    table = Table(title=f"Training candidates for {plan.search_name} ({_counts(plan.candidates)})")
    finetune = plan.base.full_run.epoch_tokens is not None
    # the dimensions shown: those that varied among the candidates that could exist (``searched``, by their
    # dimensions alone); the figures are the selected ones' rows
    dims = layout_headers(searched((candidate_dimensions(c) for c in plan.candidates if c.status != INVALID),
                                   finetune))
    rows = list(plan_rows(dataclasses.replace(plan, candidates=[c for c in plan.candidates if c.status == SELECTED])))
    figures = ["GPU GiB", "traced GiB", "host GiB", "step s", "tok/s/GPU"]
    if finetune:  # the fine-tuning table: context length x batch per device -> tokens/hour, MFU, cost
        figures += ["MFU", "M tok/h", "$/M tok", "h/epoch", "$/epoch"]
    for col in ["rank", "trial_id", *(header for _, header in dims), *figures]:
        table.add_column(col, justify="left" if col in ("trial_id", "engine", "offload") else "right",
                         no_wrap=col == "trial_id")
    by_id = {r["trial_id"]: r for r in rows if r["plan_status"] == SELECTED}
    for c, spec in zip(sorted((c for c in plan.candidates if c.status == SELECTED), key=lambda c: c.rank),
                       plan.specs[:max_rows]):
        r = by_id[spec.trial_id]
        cells = [str(c.rank), spec.trial_id, *(cell(column, r) for column, _ in dims),
                 f"{max(c.memory_gib, c.full_memory_gib):.2f}",
                 "-" if c.traced_memory_gib is None else f"{c.traced_memory_gib:.2f}", f"{c.host_memory_gib:.1f}",
                 f"{c.step_time_s:.4g}", f"{c.tokens_per_s_per_gpu:,.0f}"]
        if finetune:
            cells += [f"{r['predicted_mfu']:.2f}", f"{r['predicted_tokens_per_hour'] / 1e6:,.3g}",
                      _money(r["predicted_cost_usd_per_million_tokens"]), f"{r['predicted_hours_per_epoch']:.3g}",
                      _money(r["predicted_cost_usd_per_epoch"])]
        table.add_row(*cells)
    console = console_for(table, 190)
    console.print(plan.sentence, soft_wrap=True)
    console.print(table)
    console.print(funnel_line(plan.candidates), soft_wrap=True)
    save = _rank0_line(plan)
    if save:
        console.print(save, soft_wrap=True)
    console.print(_memory_line(plan), soft_wrap=True)
    hidden = len(plan.specs) - max_rows
    if hidden > 0:
        console.print(f"... {hidden} more selected; all candidates with reasons in "
                      f"{plan.results_dir / 'candidate_configs' / 'plan.csv'}")
    return console.file.getvalue()  # type: ignore[attr-defined]
