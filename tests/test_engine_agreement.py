"""Planner and engine agree: every layout the planner selects for a shipped preset is one the engine builds.

Each shipped search config is planned (analytic memory, as a dry run) with 1, 2 and 8 GPUs per node; every
selected candidate's TrialSpec is written and read back as a trial reads it (the layout's rules run there),
and the engine's own build check (``validate_build``: the torch engine builds each pipeline end's model on
the meta device over a fake process group of the layout's world size; DeepSpeed checks its config over one)
runs once per distinct build (``build_key``), on the smallest model that has it, cut to two layers per
model chunk. No GPU and no other process: the meta device and the fake process group stand in for the GPUs
and ranks.
"""

from __future__ import annotations

import dataclasses

import pytest

from hp_tool.cli import available_search_configs, compose
from hp_tool.config import to_app_config
from hp_tool.contracts.spec import dump_spec, load_spec
from hp_tool.errors import ConfigError
from hp_tool.planner import make_plan
from hp_tool.trial.engines import validate_build

GPUS_PER_NODE = (1, 2, 8)


def selected_specs(name: str, gpus_per_node: int, tmp_path):
    custom = ["search_config.model.hf_config=llama2_7b"] if name == "finetune/custom" else []
    cfg, search = compose([f"search_config={name}", "cluster=bcm", "cluster.partition=batch",
                           f"search_config.train_settings.gpus_per_node={gpus_per_node}", *custom])
    try:
        return make_plan(to_app_config(cfg), search, tmp_path).specs
    except ConfigError as exc:  # nothing valid or nothing fits at this node size: the planner said so
        assert "no candidate layout is valid" in str(exc) or "fits" in str(exc) or "divisible" in str(exc), exc
        return []


def build_key(spec) -> tuple:
    """What decides how the engine builds a layout: the family, method and experts; the engine, ZeRO stage
    and offload; which parallelisms are on (their degrees' divisibility is the layout's rules, checked for
    every spec); the savers; one process or more; the precision. One build per key keeps the check to a few
    minutes on 2 cores (1,300 distinct model x layout pairs would take an hour)."""
    m, p = spec.model, spec.parallel
    return (m.family, m.method, bool(m.num_experts), p.engine, p.zero_stage, p.offload, p.tp > 1, p.pp > 1,
            p.virtual_stages > 1, p.ep > 1, p.cp > 1, p.sequence_parallel, p.loss, p.activation_offload,
            p.act_ckpt_mode, p.act_ckpt_layers > 0, p.pp * p.dp * p.cp * p.tp == 1, spec.training.precision)


def fewer_layers(spec):
    """The spec with two layers per model chunk (PP x virtual stages x 2), checkpointing as many of each
    stage's as before (at most all): the same build, layer by layer, in a tenth of the time. The spec itself
    when its family counts layers otherwise (T5's two stacks) or the smaller one breaks a rule."""
    par = spec.parallel
    layers = par.pp * par.virtual_stages * 2
    if spec.model.decoder_seq_length is not None or layers >= spec.model.num_layers:
        return spec
    ckpt = min(par.act_ckpt_layers, layers // par.pp)
    try:
        return dataclasses.replace(spec, model=dataclasses.replace(spec.model, num_layers=layers),
                                   parallel=dataclasses.replace(par, act_ckpt_layers=ckpt))
    except ConfigError:
        return spec


@pytest.mark.e2e
def test_every_selected_layout_of_every_shipped_preset_builds_in_its_engine(tmp_path):
    smallest, planned = {}, 0  # build key -> (size, preset, GPUs per node, spec): the smallest model builds it
    for name in available_search_configs():
        for gpn in GPUS_PER_NODE:
            for spec in selected_specs(name, gpn, tmp_path / f"{name.replace('/', '_')}_{gpn}"):
                planned += 1
                size = spec.model.num_layers * spec.model.hidden_size
                key = build_key(spec)
                if key not in smallest or size < smallest[key][0]:
                    smallest[key] = (size, name, gpn, spec)
    refused = []
    for _, name, gpn, spec in smallest.values():
        try:
            spec = load_spec(dump_spec(spec, tmp_path / "specs" / f"{spec.trial_id}.yaml"))  # as a trial reads it
            validate_build(fewer_layers(spec))
        except Exception as exc:  # noqa: BLE001 - every refusal is collected and shown
            refused.append(f"{name} gpus_per_node={gpn} {spec.trial_id}: {type(exc).__name__}: {exc}")
    assert planned > 2000 and len(smallest) > 200, (planned, len(smallest))  # the presets were planned for real
    assert not refused, f"{len(refused)} of {len(smallest)} builds refused:\n" + "\n".join(refused[:20])
