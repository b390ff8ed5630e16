"""The recommended full-run config: the fastest trial's layout scaled back to the whole cluster.

The trial spec already carries the full run (``full_run``: nodes, DP, global batch, steps); the base
config gives the nodes' shape and the full run's ``run`` section. The result is a TrialSpec in ``full``
mode, written with a comment header (days, cost, how to launch), reloaded with ``load_spec`` and
compared field by field, so a file that does not load or validate is never left as the recommendation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import yaml

from hp_tool.dimensions import layout_words, varied
from hp_tool.engine_facts import engine_facts
from hp_tool.fsutil import atomic_write_text
from hp_tool.launch.backends import ray_driver
from hp_tool.results.collect import candidate_spec_path
from hp_tool.results.full_run import FullRun
from hp_tool.sizing import format_days
from hp_tool.throughput import throughput
from hp_tool.contracts.ds_config import ds_config
from hp_tool.contracts.spec import EstimatesSpec, TrialSpec, load_spec

# The job's time limit gets this margin over the estimated duration (restarts, evaluation, slow nodes).
RUN_TIME_MARGIN = 1.25


def format_usd(dollars: float) -> str:
    """$1,234 for large sums, three significant digits below $100 ($0.326)."""
    return f"${dollars:,.0f}" if dollars >= 100 else f"${dollars:.3g}"


def optimal_path(folder: Path, full: FullRun) -> Path:
    return folder / f"optimal_config_{full.label}_{full.num_nodes}nodes.yaml"


def ds_config_path(folder: Path, full: FullRun) -> Path:
    return folder / f"ds_config_{full.label}_{full.num_nodes}nodes.json"


def optimal_spec(trial: TrialSpec, best: pd.Series, full: FullRun) -> TrialSpec:
    """``trial`` (the fastest candidate's spec) on the full run's nodes, DP, global batch and steps;
    estimates: the trial's measured peak memory per GPU (GiB) and the extrapolated step time (s)."""
    fr, base = trial.full_run, full.base
    step_s = float(best["full_run_step_time_s"])
    gpus = fr.num_nodes * base.resources.gpus_per_node
    minutes = max(base.run.max_minutes, math.ceil(fr.max_steps * step_s / 60 * RUN_TIME_MARGIN))
    rate = throughput(trial.model.shape(), fr.global_batch_size, step_s, gpus, base.resources.peak_tflops_per_gpu,
                      trial.model.adapters)
    peak = best["peak_memory_gib"]
    return dataclasses.replace(
        trial,
        parallel=dataclasses.replace(trial.parallel, dp=fr.dp),
        training=dataclasses.replace(trial.training, global_batch_size=fr.global_batch_size,
                                     max_steps=fr.max_steps),
        resources=dataclasses.replace(trial.resources, num_nodes=fr.num_nodes,
                                      gpus_per_node=base.resources.gpus_per_node),
        run=dataclasses.replace(base.run, mode="full", max_steps=fr.max_steps, max_minutes=float(minutes),
                                output_dir=None),
        estimates=EstimatesSpec(
            memory_gib=None if pd.isna(peak) else round(float(peak), 4),
            step_time_s=round(step_s, 6),
            tokens_per_s_per_gpu=round(rate["tokens_per_s_per_gpu"], 3),
            model_tflops_per_gpu=round(rate["model_tflops_per_gpu"], 4)),
    )


def _header(spec: TrialSpec, best: pd.Series, n_ranked: int, ds_name: str) -> str:
    days = float(best["days_to_train"])
    gpus = spec.resources.num_nodes * spec.resources.gpus_per_node
    cost = ""
    if not pd.isna(best["full_run_cost_usd"]):
        cost = (f"# Cost: {format_usd(best['full_run_cost_usd'])} at ${best['gpu_hour_price_usd']:g} per GPU-hour "
                f"({format_usd(best['cost_usd_per_million_tokens'])} per million tokens = price per GPU-hour x "
                f"GPUs / (tokens per hour / 1e6)).\n")
    return (
        f"# Optimal training config: {spec.trial_id}, fastest of {n_ranked} successful trial(s).\n"
        f"# Full run: {spec.resources.num_nodes} node(s) x {spec.resources.gpus_per_node} GPUs: {pick_words(spec, best)}, "
        f"global batch {spec.training.global_batch_size}.\n"
        f"# Measured {best['measured_step_time_s']:.6g} s per step in the trial; full run "
        f"{best['full_run_step_time_s']:.6g} s per step (plus modelled data-parallel communication).\n"
        f"# Estimated days to train: {days:.4g} ({spec.run.max_steps:,} steps x "
        f"{best['full_run_step_time_s']:.6g} s = {format_days(days)}).\n"
        f"{cost}"
        f"# estimates.memory_gib is the trial's measured peak per GPU (GiB); more data-parallel shards in the\n"
        f"# full run can only lower it under FSDP.\n"
        + train_lines(spec, gpus)
        + ("# DeepSpeed config of this layout (deepspeed.initialize, transformers TrainingArguments(deepspeed=...)):\n"
           f"# {ds_name} beside this file.\n"
           if engine_facts(spec.parallel.engine).config_file else "")
    )


def pick_words(spec: TrialSpec, best: pd.Series) -> str:
    """The pick's layout in the dimension table's words, naming those always named, those it sets off their
    defaults, and for a fine-tuning config its sequence length and method, as the "Recommended:" sentence names
    them (a summary's missing value, such as a dense model's experts, names nothing)."""
    row = {k: None if pd.isna(v) else v for k, v in best.items()}
    return layout_words(row, varied([row], also=("seq_length", "method") if spec.model.hf_config is not None else ()))


def train_lines(spec: TrialSpec, gpus: int) -> str:
    """The header's lines that train the config. A fine-tuning config: ``python3 -m hp_tool.train``, which
    tokenizes the data and loads the checkpoint (on several nodes it writes the run's spec and prints the sbatch
    line that trains it); a pretraining config: torchrun on its nodes, or sbatch."""
    if spec.model.hf_config is not None:
        line = ("# Train: python3 -m hp_tool.train <this file> model.checkpoint=... data.path=... save_dir=...   "
                f"({gpus} processes)\n")
        if spec.resources.num_nodes > 1:
            line += (f"#   on {spec.resources.num_nodes} nodes it prepares the run and prints: "
                     f"{train_sbatch_command(spec, '<output_dir>/run_spec.yaml')}\n"
                     f"# Train on Ray: {ray_job_command(spec, '<output_dir>/run_spec.yaml')}\n")
        return line
    return (f"# Train: torchrun --nnodes {spec.resources.num_nodes} --nproc-per-node "
            f"{spec.resources.gpus_per_node} -m hp_tool.trial.train <this file>   ({gpus} processes)\n"
            f"# Train on SLURM: {train_sbatch_command(spec, '<this file>')}\n"
            f"# Train on Ray: {ray_job_command(spec, '<this file>')}\n")


def ray_job_command(spec: TrialSpec, config: str) -> str:
    """The ``ray job submit`` line that trains ``config`` on a Ray cluster: the trial engine in one Ray Train
    worker per GPU (hp_tool/launch/backends/ray_driver.py), this checkout as the job's working dir."""
    gpus = spec.resources.num_nodes * spec.resources.gpus_per_node
    driver = ray_driver.driver_command("hp_tool.trial.train:run_trial", gpus, ray_driver.worker_resources(1, 1, None),
                                       config)
    return f"ray job submit --address http://<head>:8265 --working-dir . --entrypoint-num-cpus 0 -- {' '.join(driver)}"


def train_sbatch_command(spec: TrialSpec, config: str) -> str:
    """The sbatch line that trains ``config`` with launch_scripts/train.sbatch on the spec's nodes."""
    r = spec.resources
    return (f"sbatch --nodes={r.num_nodes} --ntasks-per-node={r.gpus_per_node} --gpus-per-node={r.gpus_per_node} "
            f"launch_scripts/train.sbatch {config}")


def write_optimal_config(results_dir: Path, best: pd.Series, full: FullRun, n_ranked: int,
                         folder: Path) -> Path:
    """Write optimal_config_<label>_<N>nodes.yaml for the ``best`` table row; returns its path."""
    trial = load_spec(candidate_spec_path(results_dir, best["trial_id"]))
    spec = optimal_spec(trial, best, full)  # dataclasses.replace re-runs every __post_init__ check
    path = optimal_path(folder, full)
    ds_path = ds_config_path(folder, full)
    text = _header(spec, best, n_ranked, ds_path.name) + yaml.safe_dump(spec.to_dict(), sort_keys=False)
    atomic_write_text(path, text)
    reloaded = load_spec(path)
    if reloaded.to_dict() != spec.to_dict():
        path.unlink()
        raise ValueError(f"{path} did not reload as written; removed it. Written: {spec.to_dict()}; "
                         f"reloaded: {reloaded.to_dict()}")
    if engine_facts(spec.parallel.engine).config_file:
        atomic_write_text(ds_path, json.dumps(ds_config(spec), indent=2) + "\n")
    elif ds_path.exists():  # an earlier DeepSpeed pick's config is not this pick's
        ds_path.unlink()
    return path
