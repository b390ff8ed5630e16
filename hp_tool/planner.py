"""The whole training plan: model size -> base config -> candidates -> [traced memory] -> trial specs.

Pure, no I/O: the memory trace (hp_tool/memory_check.py) comes in as a callable."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from hp_tool.base_config import (Cluster, ModelChoice, base_spec, choose_model, days_for, finetune_lr,
                                 global_batch_size, model_seq, model_spec, resolve_cluster, schedule, with_lr)
from hp_tool.vocab import INVALID, OVER_LIMIT, PRUNED, SELECTED
from hp_tool.candidates import Candidate, plan_candidates, rank_candidates
from hp_tool.config import AppConfig, training_precision
from hp_tool.errors import ConfigError
from hp_tool.estimate.memory import eager_trace_excess_gib
from hp_tool.contracts.spec import EstimatesSpec, ParallelSpec, RunSpec, TrialSpec, section_values
from hp_tool.dimensions import BY_KEY, DIMENSIONS, trial_id
from hp_tool.sizing import run_days

# how to mend a train_settings key that leaves no valid candidate: each dimension's list, and the other keys
FIXES = {
    **{key: d.fix for key, d in BY_KEY.items()},
    "global_batch_size": "use a global_batch_size (and micro_batch_sizes) with GBS % (MBS*DP) == 0",
    "num_nodes": "use a GPU count divisible by TP*PP",
    "max_model_parallel_size": "widen min_model_parallel_size / max_model_parallel_size",
}


@dataclass
class Plan:
    search_name: str
    results_dir: Path
    model: ModelChoice
    cluster: Cluster
    days_to_train: float
    sentence: str
    base: TrialSpec
    candidates: list[Candidate]
    specs: list[TrialSpec]  # selected candidates, predicted fastest first
    tracer: Optional[Callable] = None  # the memory_check.Tracer that checked the candidates (traced mode)


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused while the grid is planned: tens of thousands of candidates, layouts and
    estimates, none of them in a reference cycle, would set it off over and over (a tenth of a large plan's time);
    reference counting frees them as ever."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def make_plan(app: AppConfig, search_name: str, results_dir: Path, tracer: Optional[Callable] = None) -> Plan:
    """Plan the training search; raises ConfigError (before anything is written) when nothing can run.
    ``tracer`` (memory_check=traced): list of TrialSpecs -> list of memory_check.TraceOutcome."""
    ts = app.search_config.train_settings
    cluster = resolve_cluster(app)
    model = choose_model(app, cluster)
    days = days_for(model, app, cluster)
    base = base_spec(app, model, cluster)
    candidates = []
    with no_cycle_collection():
        for seq in model.seq_lengths or (model.shape.seq_length,):  # several for a fine-tuning search
            gbs = global_batch_size(model.shape.family, ts, model.size_b, seq, app.search_config.finetune)
            for method in model.methods:
                recipe = model.recipe(method, training_precision(app))
                candidates += plan_candidates(model.at(seq), model.size_b, ts, cluster, gbs, recipe)
        name_candidates(model, candidates)
        if len(model.seq_lengths) > 1 or len(model.methods) > 1:
            rank_candidates(candidates, ts.limit_search_runs)
    if tracer is not None:
        check_traced_memory(candidates, lambda c: candidate_spec(base, c, model, app, results_dir), tracer,
                            ts, cluster)
    _require_selection(candidates, ts, cluster)
    selected = sorted((c for c in candidates if c.status == SELECTED), key=lambda c: c.rank)
    specs = [candidate_spec(base, c, model, app, results_dir) for c in selected]
    top = selected[0] if selected else None
    best = None if top is None else (run_days(base.full_run.max_steps, top.step_time_s), top.model_tflops_per_gpu)
    return Plan(search_name, results_dir, model, cluster, days, model.sentence(days, cluster, ts, best), base,
                candidates, specs, tracer)


def check_traced_memory(candidates: list[Candidate], spec_of: Callable[[Candidate], TrialSpec],
                        tracer: Callable, ts, cluster: Cluster) -> None:
    """Trace the fitting candidates, the selected first, predicted fastest first, until ``limit_search_runs`` of them fit by
    the trace (a batch of the missing number at a time, traced in parallel); prune those whose traced peak
    plus the overhead exceeds the usable memory, then rank again; a compiled candidate's trace runs its layers
    eager, and what its compiled layers do not keep is taken off (``memory.eager_trace_excess_gib``). A candidate
    the trace cannot run keeps its analytic verdict, with the reason in ``memory_check``. Candidates beyond the
    limit are not traced."""
    hw, limit = cluster.hw, ts.limit_search_runs
    usable = hw.usable_gib(ts.memory_margin)
    # the selected first (the run limit's choice: each competing regime value's best among them), then the rest
    order = sorted((c for c in candidates if c.status in (SELECTED, OVER_LIMIT)),
                   key=lambda c: (c.status != SELECTED, c.rank))
    kept = done = 0
    while kept < limit and done < len(order):
        batch = order[done:done + limit - kept]
        done += len(batch)
        for c, outcome in zip(batch, tracer([spec_of(c) for c in batch]), strict=True):
            if outcome.tensor_gib is None:
                c.memory_check = f"analytic: {outcome.reason}"
                kept += 1
                continue
            c.memory_check = "traced"
            tensors = outcome.tensor_gib - eager_trace_excess_gib(c.shape, c.trial_layout(), hw)
            c.traced_memory_gib = tensors + hw.memory_overhead_gib
            if c.traced_memory_gib <= usable:
                kept += 1
                continue
            c.reject(PRUNED, "gpu.memory_gib",
                     f"traced {c.traced_memory_gib:.4g} GiB per GPU ({tensors:.4g} GiB of tensors + "
                     f"{hw.memory_overhead_gib:g} GiB overhead) > {usable:.4g} GiB usable ({hw.gpu_memory_gib:g} GiB - "
                     f"{ts.memory_margin:.0%} margin); the analytic estimate was {c.memory_gib:.4g} GiB")
            c.rank = None
    rank_candidates(candidates, limit)


def _require_selection(candidates: list[Candidate], ts, cluster: Cluster) -> None:
    if any(c.status == SELECTED for c in candidates):
        return
    valid = [c for c in candidates if c.status != INVALID]
    if not valid:
        key = Counter(c.reason_key for c in candidates).most_common(1)[0][0]
        name = key.rsplit(".", 1)[-1]
        reasons = Counter(c.reason for c in candidates).most_common(3)
        summary = "; ".join(f"{r} ({n}x)" for r, n in reasons)
        raise ConfigError(key, getattr(ts, name, None),
                          f"no candidate layout is valid for this model and cluster: {summary}",
                          FIXES.get(name, "change the search settings"))
    measured = [c for c in valid if c.memory_gib is not None]
    best = min(measured, key=lambda c: c.traced_memory_gib or max(c.memory_gib, c.full_memory_gib))
    host = best.reason_key == "gpu.host_ram_gib"
    raise ConfigError(best.reason_key, cluster.hw.host_ram_gib if host else cluster.hw.gpu_memory_gib,
                      f"no valid layout fits in {'host RAM' if host else 'memory'}; the smallest is "
                      f"TP={best.tp} PP={best.pp} MBS={best.mbs} act_ckpt={best.act_ckpt_layers} "
                      f"{best.engine} ZeRO-{best.zero_stage} offload {best.offload}: {best.reason}",
                      "allow larger tensor_parallel_sizes / pipeline_parallel_sizes, smaller "
                      "micro_batch_sizes, more act_ckpt_layers, higher zero_stages or offload, "
                      "or use GPUs (nodes) with more memory")


def candidate_dimensions(c: Candidate) -> dict:
    """A candidate's value of every searched dimension (hp_tool/dimensions.py), by name: its layout's fields
    and its sequence length; experts only for a mixture of experts (None for a dense model)."""
    if c.values is None:  # a plan's tables and names read it several times for each of tens of thousands
        fields = c.full.__dict__
        values = {d.name: fields[d.name] for d in DIMENSIONS if d.name in fields}
        values.update(seq_length=c.shape.seq_length, ep=c.ep if c.shape.moe else None)
        c.values = values
    return c.values


def name_candidates(model: ModelChoice, candidates: list[Candidate]) -> None:
    """Give each candidate its trial id, the one place one is made: its dimensions, the sequence length named
    only in a fine-tuning search."""
    for c in candidates:
        values = {**candidate_dimensions(c), "seq_length": model_seq(model, c.shape)}
        c.trial_id = trial_id(model.shape.family, model.label, values, c.full.lora.rank if c.full.lora else 0)


def candidate_spec(base: TrialSpec, c: Candidate, model: ModelChoice, app: AppConfig,
                   results_dir: Path) -> TrialSpec:
    """The benchmark TrialSpec of a selected candidate: its layout on the fewest whole nodes."""
    ts = app.search_config.train_settings
    trial_id, trial = c.trial_id, c.trial_layout()
    gbs, seq = c.full.global_batch_size, c.shape.seq_length
    tokens_b = base.full_run.num_tokens_in_b
    max_steps, warmup, constant = schedule(c.shape.family, tokens_b, seq, gbs, model.hf is not None)
    return dataclasses.replace(
        base,
        trial_id=trial_id,
        model=model_spec(c.shape, model.num_parameters, model.hf, **section_values(trial, "model")),
        parallel=ParallelSpec.of(trial, base.parallel.pipeline_schedule),
        training=dataclasses.replace(base.training if model.hf is None else
                                     with_lr(base.training, finetune_lr(trial.method)),
                                     **section_values(trial, "training"),
                                     warmup_steps=warmup, constant_steps=constant, max_steps=max_steps),
        resources=dataclasses.replace(base.resources, num_nodes=c.trial_nodes,
                                      gpus_per_node=c.trial_gpus_per_node),
        run=RunSpec(mode="benchmark", max_minutes=ts.max_minutes_per_run, max_steps=ts.max_steps_per_run,
                    stable_cv=ts.stable_cv, output_dir=str((results_dir / "training_logs" / trial_id).resolve())),
        full_run=dataclasses.replace(base.full_run, dp=c.dp, global_batch_size=gbs, max_steps=max_steps),
        estimates=EstimatesSpec(round(c.memory_gib, 4), round(c.step_time_s, 6),
                                round(c.tokens_per_s_per_gpu, 3), round(c.model_tflops_per_gpu, 4),
                                None if c.traced_memory_gib is None else round(c.traced_memory_gib, 4)),
    )
