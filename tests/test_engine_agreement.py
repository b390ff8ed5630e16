"""Planner and engine agree: every layout the planner selects for a shipped preset is one the engine builds.

Each shipped search config is planned (analytic memory, as a dry run) with its own GPUs per node and with 1,
2 and 8; every selected candidate's TrialSpec is written and read back as a trial reads it (the layout's
rules run there), and the engine's own build check (``validate_build``: the torch engine builds each
pipeline end's model on the meta device over a fake process group of the layout's world size; DeepSpeed
checks its config over one) runs once per distinct build (``build_key``), on the selected spec that builds
fastest (``build_cost``: the fewest layers built, then the smallest model), cut to two layers per model
chunk (``fewer_layers``). No GPU and no other process: the meta device and the fake process group stand
in for the GPUs and ranks.

The default run (the covering set) plans every preset at its own ``gpus_per_node`` (the plans
tests/test_config_surface.py and tests/test_preset_equivalence.py read as well: tests/plan_cache.py plans
each once a session) and builds every build key of those plans, one test per preset folder (each under the
per-test budget), an interleaved layout over two model chunks per rank. The matrix tier (``-m matrix``)
builds the rest of the 1/2/8 product and the exact chunk counts: one test per node size plans every preset
at it and builds the keys the default plans lack, and one builds the default run's interleaved builds with
all their model chunks. So every key of the product is built in one tier or the other.
"""

from __future__ import annotations

import dataclasses

import pytest

import plan_cache
from hp_tool.cli import available_search_configs
from hp_tool.contracts.spec import dump_spec, load_spec
from hp_tool.errors import ConfigError
from hp_tool.trial.engines import validate_build

GPUS_PER_NODE = (1, 2, 8)
# the default run builds an interleaved layout with two model chunks per rank (the matrix tier with all of them)
MOST_VIRTUAL_STAGES = 2
PRESETS = available_search_configs()
GROUPS = ("finetune", "gpt3", "llama", "moe", "mt5", "t5")  # the presets' folders, one default-run test each
AS_A_DRY_RUN = "memory_check=analytic"  # what the CLI plans with in a dry run (tests/preset_snapshot.py too)


def selected_specs(name: str, *overrides: str) -> list:
    """The selected specs of the preset's plan (shared: never change them), or none where the planner says
    that nothing is valid or nothing fits at this node size."""
    try:
        return plan_cache.plan(name, AS_A_DRY_RUN, *overrides).specs
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


def _stacks(spec) -> int:
    """Layer stacks the pipeline splits: T5's encoder and decoder (each over half the stages), else one."""
    return 1 if spec.model.decoder_seq_length is None else 2


def cut_layers(spec) -> int:
    """The layers per stack of ``fewer_layers``' cut at the spec's own virtual stages: two per model chunk
    (PP x virtual stages x 2); T5/mT5, whose encoder and decoder each take half the stages, two of its stack
    per stage."""
    par = spec.parallel
    return max(par.pp // _stacks(spec), 1) * par.virtual_stages * 2


def fewer_layers(spec, most_virtual_stages: int | None = None):
    """The spec cut to two layers per model chunk (``cut_layers``), checkpointing as many of each stage's as
    before (at most all): the same build, layer by layer, in a tenth of the time. With
    ``most_virtual_stages``, an interleaved layout with more model chunks per rank keeps that many (the same
    build, chunk by chunk; one layer per chunk where two would be more than the model has), each chunk
    checkpointing as many layers. The spec itself when it has no more layers than the cut, or the cut breaks
    a rule or changes its build key."""
    par, stacks = spec.parallel, _stacks(spec)
    vp = par.virtual_stages if most_virtual_stages is None else min(par.virtual_stages, most_virtual_stages)
    for per_chunk in (2, 1) if vp < par.virtual_stages else (2,):
        layers = max(par.pp // stacks, 1) * vp * per_chunk
        if layers > spec.model.num_layers or (layers == spec.model.num_layers and vp == par.virtual_stages):
            continue
        ckpt = min(par.act_ckpt_layers, stacks * layers // par.pp)
        if ckpt % vp:  # fewer chunks: each recomputes as many layers (at least one, as before)
            ckpt = vp * max(1, ckpt // vp)
        try:
            cut = dataclasses.replace(spec, model=dataclasses.replace(spec.model, num_layers=layers),
                                      parallel=dataclasses.replace(par, act_ckpt_layers=ckpt, virtual_stages=vp))
        except ConfigError:
            continue
        if build_key(cut) == build_key(spec):
            return cut
    return spec


def build_cost(spec) -> tuple:
    """How long the build check of the spec takes, as an order: the layers it builds (the first and the last
    pipeline stage's, after ``fewer_layers``' cut), then the model's size."""
    par = spec.parallel
    layers = min(spec.model.num_layers, cut_layers(spec))
    return _stacks(spec) * layers // par.pp * min(par.pp, 2), spec.model.num_layers * spec.model.hidden_size


def cheapest_builds(plans) -> dict:
    """build key -> (preset, spec) that builds it fastest, over (preset, selected specs) pairs (the first
    preset's on a tie)."""
    out: dict = {}
    for name, specs in plans:
        for spec in specs:
            key = build_key(spec)
            if key not in out or build_cost(spec) < build_cost(out[key][1]):
                out[key] = (name, spec)
    return out


def refused_builds(builds: dict, tmp_path, what: str, most_virtual_stages: int | None = None) -> list[str]:
    """Each build's spec written and read back as a trial reads it, then built by its engine (``fewer_layers``'
    cut): the refusals."""
    refused = []
    for name, spec in builds.values():
        try:
            spec = load_spec(dump_spec(spec, tmp_path / "specs" / f"{spec.trial_id}.yaml"))  # as a trial reads it
            validate_build(fewer_layers(spec, most_virtual_stages))
        except Exception as exc:  # noqa: BLE001 - every refusal is collected and shown
            refused.append(f"{name} {what} {spec.trial_id}: {type(exc).__name__}: {exc}")
    return refused


@pytest.fixture(scope="module")
def default_plans() -> list:
    """(preset, selected specs) of every shipped preset at its own node size (a preset must plan there)."""
    return [(name, plan_cache.plan(name, AS_A_DRY_RUN).specs) for name in PRESETS]


@pytest.fixture(scope="module")
def default_builds(default_plans) -> dict:
    return cheapest_builds(default_plans)


@pytest.mark.e2e
def test_every_shipped_preset_plans_at_its_own_node_size(default_plans, default_builds):
    assert {name.split("/")[0] for name in PRESETS} == set(GROUPS)
    assert all(specs for _, specs in default_plans), [name for name, specs in default_plans if not specs]
    planned = sum(len(specs) for _, specs in default_plans)
    assert planned > 1000 and len(default_builds) > 200, (planned, len(default_builds))  # planned for real


@pytest.mark.e2e
@pytest.mark.parametrize("group", GROUPS)
def test_every_selected_layout_of_every_shipped_preset_builds_in_its_engine(tmp_path, group, default_builds):
    """The build keys of the default plans whose fastest build is a preset of ``group``'s."""
    builds = {key: b for key, b in default_builds.items() if b[0].split("/")[0] == group}
    assert builds, f"no build key's fastest build is a {group} preset"
    refused = refused_builds(builds, tmp_path, "at its own gpus_per_node", MOST_VIRTUAL_STAGES)
    assert not refused, f"{len(refused)} of {len(builds)} builds refused:\n" + "\n".join(refused[:20])


@pytest.mark.matrix
def test_every_interleaved_layout_of_the_default_plans_builds_with_all_its_virtual_stages(tmp_path, default_builds):
    """The default run's builds that it interleaves over fewer model chunks (MOST_VIRTUAL_STAGES), with all
    of their own."""
    builds = {key: b for key, b in default_builds.items() if b[1].parallel.virtual_stages > MOST_VIRTUAL_STAGES}
    assert len(builds) > 5, len(builds)
    refused = refused_builds(builds, tmp_path, "at its own gpus_per_node, all virtual stages")
    assert not refused, f"{len(refused)} of {len(builds)} builds refused:\n" + "\n".join(refused[:20])


# (specs planned, build keys the default plans lack) at least, at each node size: the presets were planned
MATRIX_COUNTS = {1: (500, 60), 2: (700, 40), 8: (900, 5)}


@pytest.mark.matrix
@pytest.mark.parametrize("gpus_per_node", GPUS_PER_NODE)
def test_every_selected_layout_at_another_node_size_builds_in_its_engine(tmp_path, gpus_per_node, default_builds):
    """Every preset planned with ``gpus_per_node`` GPUs per node; the build keys the default plans lack built."""
    plans = [(name, selected_specs(name, f"search_config.train_settings.gpus_per_node={gpus_per_node}"))
             for name in PRESETS]
    builds = {key: b for key, b in cheapest_builds(plans).items() if key not in default_builds}
    planned = sum(len(specs) for _, specs in plans)
    least_planned, least_new = MATRIX_COUNTS[gpus_per_node]
    assert planned > least_planned and len(builds) > least_new, (planned, len(builds))
    refused = refused_builds(builds, tmp_path, f"gpus_per_node={gpus_per_node}")
    assert not refused, f"{len(refused)} of {len(builds)} builds refused:\n" + "\n".join(refused[:20])
