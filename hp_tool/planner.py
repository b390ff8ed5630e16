"""The whole training plan: model size -> base config -> candidates -> trial specs. Pure, no I/O."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hp_tool.base_config import Cluster, ModelChoice, base_spec, choose_model, days_for, resolve_cluster
from hp_tool.candidates import INVALID, SELECTED, Candidate, plan_candidates
from hp_tool.config import AppConfig
from hp_tool.errors import ConfigError
from hp_tool.trial.spec import EstimatesSpec, FullRunSpec, ParallelSpec, RunSpec, TrialSpec, make_trial_id

FIXES = {
    "tensor_parallel_sizes": "use TP values that divide the (key/value) head count and fit in one node",
    "pipeline_parallel_sizes": "use PP values that divide the layer count (T5/mT5: 1, or an even PP whose half "
                               "divides the layers per stack)",
    "global_batch_size": "use a global_batch_size (and micro_batch_sizes) with GBS % (MBS*DP) == 0",
    "act_ckpt_layers": "use values between 0 and the layers per pipeline stage (num_layers / PP; T5/mT5: "
                       "2 x num_layers / PP)",
    "engines": "use engines=[torch]",
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


def make_plan(app: AppConfig, search_name: str, results_dir: Path) -> Plan:
    """Plan the training search; raises ConfigError (before anything is written) when nothing can run."""
    ts = app.search_config.train_settings
    cluster = resolve_cluster(app)
    model = choose_model(app, cluster)
    days = days_for(model, app, cluster)
    base = base_spec(app, model, cluster)
    gbs = base.training.global_batch_size
    candidates = plan_candidates(model.shape, model.size_b, ts, cluster, gbs)
    _require_selection(candidates, ts, cluster)
    selected = sorted((c for c in candidates if c.status == SELECTED), key=lambda c: c.rank)
    specs = [candidate_spec(base, c, model, app, results_dir) for c in selected]
    return Plan(search_name, results_dir, model, cluster, days, model.sentence(days, cluster, ts), base,
                candidates, specs)


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
    measured = [c for c in valid if c.memory_gb is not None]
    best = min(measured, key=lambda c: max(c.memory_gb, c.full_memory_gb))
    host = best.reason_key == "gpu.host_ram_gb"
    raise ConfigError(best.reason_key, cluster.hw.host_ram_gb if host else cluster.hw.gpu_memory_gb,
                      f"no valid layout fits in {'host RAM' if host else 'memory'}; the smallest is "
                      f"TP={best.tp} PP={best.pp} MBS={best.mbs} act_ckpt={best.act_ckpt_layers} "
                      f"{best.engine} ZeRO-{best.zero_stage} offload {best.offload}: {best.reason}",
                      "allow larger tensor_parallel_sizes / pipeline_parallel_sizes, smaller "
                      "micro_batch_sizes, more act_ckpt_layers, higher zero_stages or offload, "
                      "or use GPUs (nodes) with more memory")


def candidate_trial_id(model: ModelChoice, c: Candidate) -> str:
    return make_trial_id(model.shape.family, model.label, c.tp, c.pp, c.mbs, c.act_ckpt_layers, c.engine,
                         c.zero_stage, c.offload)


def candidate_spec(base: TrialSpec, c: Candidate, model: ModelChoice, app: AppConfig,
                   results_dir: Path) -> TrialSpec:
    """The benchmark TrialSpec of a selected candidate: its layout on the fewest whole nodes."""
    ts = app.search_config.train_settings
    trial_id = candidate_trial_id(model, c)
    gbs = base.training.global_batch_size
    return dataclasses.replace(
        base,
        trial_id=trial_id,
        parallel=ParallelSpec(c.tp, c.pp, c.trial_dp, c.mbs, c.act_ckpt_layers,
                              base.parallel.pipeline_schedule, c.engine, c.zero_stage, c.offload),
        training=dataclasses.replace(base.training, global_batch_size=c.trial_global_batch_size),
        resources=dataclasses.replace(base.resources, num_nodes=c.trial_nodes,
                                      gpus_per_node=c.trial_gpus_per_node),
        run=RunSpec(mode="benchmark", max_minutes=ts.max_minutes_per_run, max_steps=ts.max_steps_per_run,
                    output_dir=str((results_dir / "training_logs" / trial_id).resolve())),
        full_run=FullRunSpec(base.full_run.num_nodes, c.dp, gbs, ts.num_tokens_in_b, base.full_run.max_steps),
        estimates=EstimatesSpec(round(c.memory_gb, 4), round(c.step_time_s, 6),
                                round(c.tokens_per_s_per_gpu, 3), round(c.model_tflops_per_gpu, 4)),
    )
