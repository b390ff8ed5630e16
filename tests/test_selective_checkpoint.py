"""Selective (per-op) activation checkpointing, ``act_ckpt_mode: selective`` (hp_tool/trial/selective_checkpoint.py):
the policy keeps the odd matmuls and the attention, counting the forward's and the recompute's apart; the engine
trains as without checkpointing (one process for each family it checkpoints, 2 CPU ranks under TP with sequence
parallelism and under FSDP2); its traced peak lies between no and full checkpointing; the memory model's kept term
and peak match the trace; its recompute FLOPs are the matmuls the policy does not keep; bad layouts and settings
fail naming the key; trial ids, specs and the CSVs carry the mode."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from hp_tool.architectures import recompute_flops_per_step
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.contracts.spec import TrialSpec, load_spec
from hp_tool.dimensions import trial_id
from hp_tool.errors import ConfigError
from hp_tool.estimate.memory import estimate_memory
from hp_tool.families.shape import Shape
from hp_tool.results.collect import collect_trials, read_plan
from hp_tool.trial.memterms import target_hardware, target_layout, unit_terms, with_layout
from hp_tool.trial.selective_checkpoint import selective_policy
from hp_tool.trial.trace.replay import trace_stage
from hp_tool.trial.train import run_trial
from test_results_helpers import planned, write_ok
from trial_helpers import long_context_spec, read_metrics, read_result, tiny_spec, torchrun, write_spec

REL = 1e-5
aten = torch.ops.aten


def checkpointed(spec: TrialSpec, mode: str, layers: int | None = None) -> TrialSpec:
    """``spec`` with ``layers`` (default: all) of its stage's layers checkpointed in ``mode``."""
    layers = spec.model.num_layers if layers is None else layers
    return dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, act_ckpt_layers=layers,
                                                                  act_ckpt_mode=mode))


def run(spec: TrialSpec, folder) -> tuple[list[dict], dict]:
    """(metrics, result) of ``spec`` trained by the engine, in this process or on 2 CPU ranks."""
    folder.mkdir()
    world = spec.resources.gpus_per_node
    if world == 1:
        run_trial(write_spec(spec, folder), str(folder / "out"))
    else:
        proc = torchrun(write_spec(spec, folder), folder / "out", world)
        assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(folder / "out")
    assert result["status"] == "ok", result["reason"]
    return read_metrics(folder / "out"), result


def first(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics[:2]]


# ---- the policy ----

def test_the_policy_keeps_odd_matmuls_and_the_attention_and_counts_the_recompute_apart():
    """mm and addmm count alike; the 1st and 3rd are kept, the 2nd recomputed; the attention kernel and TP's
    reduce-scatter are kept, anything else recomputed; the recompute numbers its matmuls from 1 again (one count
    for both would make its first matmul the 4th, recomputed)."""
    policy = selective_policy()
    forward, recompute = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    ops = [aten.mm.default, aten.addmm.default, aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
           torch.ops._c10d_functional.reduce_scatter_tensor.default, aten.add.Tensor]
    save, redo = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert [policy(forward, op) for op in ops] == [save, redo, save, save, save, redo]
    assert [policy(recompute, op) for op in (aten.addmm.default, aten.mm.default)] == [save, redo]
    assert policy(forward, aten.mm.default) == redo  # the forward's count went on: its 4th


# ---- training ----

@pytest.mark.e2e
@pytest.mark.parametrize("family, lower", [
    # the covering set: each family's code path once (the mixtures of experts' through ``moe``); the rest matrix
    ("gpt3", True), ("llama", True), ("moe", False),
    pytest.param("qwen2_moe", False, marks=pytest.mark.matrix)])
def test_selective_checkpointing_trains_as_no_checkpointing_does(tmp_path, family, lower):
    """One process: the first losses and gradient norms equal those without checkpointing; the measured tensor
    peak is lower where activations decide it (the tiny mixtures of experts peak in their optimizer step)."""
    spec = tiny_spec(family, max_steps=2, warmup_steps=2)
    plain, plain_result = run(spec, tmp_path / "none")
    selective, selective_result = run(checkpointed(spec, "selective"), tmp_path / "selective")
    assert first(selective, "loss") == pytest.approx(first(plain, "loss"), rel=REL)
    assert first(selective, "grad_norm") == pytest.approx(first(plain, "grad_norm"), rel=REL)
    assert (selective_result["peak_tensor_memory_gib"] < plain_result["peak_tensor_memory_gib"]) == lower


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2, zero_stage=0), dict(dp=2, zero_stage=3)], ids=["tp2-sp", "dp2-fsdp2"])
def test_selective_checkpointing_on_two_ranks_trains_as_without_checkpointing(tmp_path, layout):
    """On 2 gloo ranks, against the same layout without checkpointing: TP with sequence parallelism (DTensor; the
    reduce-scatters among the kept ops) and FSDP2."""
    spec = tiny_spec("llama", max_steps=2, warmup_steps=1, **layout)
    if spec.parallel.tp > 1:
        spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, sequence_parallel=True))
    plain, _ = run(spec, tmp_path / "none")
    selective, _ = run(checkpointed(spec, "selective"), tmp_path / "selective")
    assert first(selective, "loss") == pytest.approx(first(plain, "loss"), rel=REL)
    assert first(selective, "grad_norm") == pytest.approx(first(plain, "grad_norm"), rel=REL)


# ---- memory: the trace and the model ----

@pytest.mark.e2e
@pytest.mark.parametrize("family", ["gpt3", "llama", "moe"])
def test_the_traced_peak_of_selective_lies_between_none_and_full(family):
    spec = tiny_spec(family)
    none, full, selective = (trace_stage(s).peak_bytes for s in
                             (spec, checkpointed(spec, "full"), checkpointed(spec, "selective")))
    assert none > selective > full


def matrix(*values):
    return pytest.param(*values, marks=pytest.mark.matrix)


@pytest.mark.e2e
@pytest.mark.parametrize("family, device, layout", [
    # the covering set: each family's code path once, each device once, each layout once (one process, TP with
    # sequence parallelism, DDP, FSDP2); the rest of the product is the matrix tier
    ("gpt3", "cpu", {}), ("llama", "cpu", {"tp": 2, "sequence_parallel": True}),
    ("llama", "cuda", {"dp": 2, "zero_stage": 0}), ("moe", "cpu", {}),
    # fused q/k/v and gate/up: the policy counts 4 matmuls a layer, not 7
    ("phi3", "cuda", {"dp": 2, "zero_stage": 3}),
    matrix("gpt3", "cuda", {"dp": 2, "zero_stage": 3}), matrix("llama", "cpu", {"tp": 2}),
    matrix("qwen2_moe", "cuda", {"tp": 2, "dp": 2}), matrix("phi3", "cpu", {}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()) or "one")
def test_the_models_kept_term_of_a_selective_layer_matches_the_trace(family, device, layout):
    """Per layer, what one micro-batch keeps until its backward (the layer's input and what the policy keeps: the
    odd matmuls' outputs, whole-width partial sums for TP's row-split ones, the attention's output and log-sum-exp,
    SP's reduce-scatters), traced on CPU in fp32 and for a bf16 GPU, against memory.selective_kept_bytes."""
    spec = with_layout(tiny_spec(family), act_ckpt_layers=tiny_spec(family).model.num_layers,
                       act_ckpt_mode="selective", **layout)
    terms = unit_terms(spec, device)
    assert terms.kept == pytest.approx(terms.analytic_kept, rel=0.01)


def long_llama(mode: str, layers: int, **layout) -> TrialSpec:
    """A 2-layer Llama (hidden 512, 8 heads, 2 kv heads, FFN 1408) at 4096 tokens over 8192 words, 4 micro-batches
    of 2: activations and logits, not weights, decide the peak (tests/test_long_context_memory.py's shape)."""
    spec = long_context_spec(**layout)
    model = dataclasses.replace(spec.model, hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                                ffn_hidden_size=1408, num_layers=2, vocab_size=8192, seq_length=4096)
    return checkpointed(dataclasses.replace(spec, model=model), mode, layers)


MODEL_LAYOUTS = {"cpu": ("cpu", {}), "cuda-fsdp2": ("cuda", {"dp": 2, "zero_stage": 3}),
                 "cpu-tp2-sp": ("cpu", {"tp": 2, "sequence_parallel": True})}
# the covering set: each mode once, each layout once (selective on one CPU process and under TP with sequence
# parallelism, full under FSDP2 for a GPU); the other cells of mode x layout are the matrix tier
MODEL_COVERING = {("selective", "cpu"), ("full", "cuda-fsdp2"), ("selective", "cpu-tp2-sp")}


@pytest.mark.e2e
@pytest.mark.parametrize("mode, device, layout", [
    pytest.param(mode, *MODEL_LAYOUTS[name], id=f"{mode}-{name}",
                 marks=() if (mode, name) in MODEL_COVERING else pytest.mark.matrix)
    for name in MODEL_LAYOUTS for mode in ("full", "selective")])
def test_the_memory_model_matches_the_traced_peak_of_checkpointed_layers(device, layout, mode):
    """The whole peak within 3%: the checkpointed layers' inputs and kept outputs, and the recompute of one layer in
    backward, which starts once the loss has freed its logits (counting both overshot full checkpointing by 18-29%
    here)."""
    spec = long_llama(mode, 2, **layout)
    traced = trace_stage(spec, 0, device).peak_bytes
    predicted = estimate_memory(spec.model.shape(), target_layout(spec, device), target_hardware(device)).total_gib * 2**30
    assert predicted == pytest.approx(traced, rel=0.03)


# ---- recompute FLOPs ----

def test_selective_recomputes_the_matmuls_it_does_not_keep():
    """By hand, per checkpointed layer and sample: Llama-3 8B's k, o and up (of q, k, v, o, gate, up, down), not the
    attention; GPT-3's k, out and fc2 (of q, k, v, out, fc1, fc2); a mixture of experts' k and o (the router, 5th, is
    kept) and its top-2 experts, whose grouped matmuls the policy neither counts nor keeps."""
    s, h, kv, f, gbs = 8192, 4096, 1024, 14336, 4
    llama = Shape("llama", 32, h, 32, 8, f, 128256, s)
    per_layer = s * 2 * (h * kv + h * h + h * f)
    whole = s * (2 * h * (h + 2 * kv) + 2 * 2 * s * h + 2 * h * h + 3 * 2 * h * f)  # attention: Q.K^T and scores.V
    assert recompute_flops_per_step(llama, gbs, 32, 1, "selective") == gbs * 32 * per_layer
    assert recompute_flops_per_step(llama, gbs, 16, 2, "selective") == gbs * 32 * per_layer  # 16 per stage, 2 stages
    assert recompute_flops_per_step(llama, gbs, 32, 1) == gbs * 32 * whole
    # selective recomputes 27.9% of what whole-layer checkpointing recomputes
    assert recompute_flops_per_step(llama, gbs, 32, 1, "selective") / recompute_flops_per_step(llama, gbs, 32, 1) == \
        pytest.approx(0.279, abs=0.001)
    gpt = Shape("gpt3", 24, 2048, 16, 16, 8192, 51200, 2048)
    assert recompute_flops_per_step(gpt, 1, 24, 1, "selective") == 24 * 2048 * 2 * (2048 * 2048 * 2 + 8192 * 2048)
    moe = Shape("moe", 32, h, 32, 8, f, 32000, s, num_experts=8, top_k=2)
    experts = s * 2 * 2 * 3 * h * f
    assert recompute_flops_per_step(moe, 1, 1, 1, "selective") == s * 2 * (h * kv + h * h) + experts


# ---- bad input ----

@pytest.mark.parametrize("family, change, says", [
    ("llama", dict(engine="deepspeed"), "deepspeed"),
    ("llama", dict(act_ckpt_layers=0), "act_ckpt_layers=0"),
    ("t5", {}, "t5"),
    ("llama", dict(cp=2, dp=1), "CP=2"),
])
def test_a_spec_selective_cannot_run_fails_naming_the_key_value_and_fix(family, change, says):
    spec = checkpointed(tiny_spec(family), "full", 2)
    parallel = dataclasses.replace(spec.parallel, **change)
    resources = dataclasses.replace(spec.resources, gpus_per_node=parallel.tp * parallel.pp * parallel.cp * parallel.dp)
    dataclasses.replace(spec, parallel=parallel, resources=resources)  # whole layers run this way
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(spec, parallel=dataclasses.replace(parallel, act_ckpt_mode="selective"), resources=resources)
    assert (err.value.key, err.value.value) == ("parallel.act_ckpt_mode", "selective")
    assert says in err.value.problem and "act_ckpt_mode full" in err.value.fix


def test_an_unknown_mode_in_a_spec_file_fails_on_load(tmp_path):
    path = write_spec(tiny_spec("llama"), tmp_path)
    path.write_text(path.read_text().replace("act_ckpt_mode: full", "act_ckpt_mode: partial"))
    with pytest.raises(ConfigError, match=r"parallel.act_ckpt_mode='partial': is not a known act_ckpt_mode"):
        load_spec(path)


@pytest.mark.parametrize("settings, says", [
    (["engines=[deepspeed]"], "DeepSpeed runs its own activation checkpointing"),
    (["act_ckpt_layers=[0]"], "act_ckpt_layers=0"),
])
def test_a_search_asking_only_for_selective_where_it_cannot_run_fails_before_planning(settings, says):
    overrides = [f"search_config.train_settings.{s}" for s in ("act_ckpt_modes=[selective]", *settings)]
    cfg, _ = compose(["search_config=gpt3/tiny", *overrides])
    with pytest.raises(ConfigError) as err:
        to_app_config(cfg)
    assert err.value.key == "search_config.train_settings.act_ckpt_modes" and says in err.value.problem


# ---- the grid, trial ids and the CSVs ----

def test_trial_ids_name_selective_and_leave_other_layouts_as_they_were():
    assert trial_id("gpt3", "5b", dict(tp=2, pp=1, mbs=4, act_ckpt_layers=24)) == "gpt3_5b_tp2_pp1_mbs4_ac24_torch_z3_noff"
    assert trial_id("llama", "8.03b", dict(tp=1, pp=1, mbs=1, act_ckpt_layers=32, seq_length=32768, loss="chunked",
                                     act_ckpt_mode="selective")) == \
        "llama_8.03b_s32768_tp1_pp1_mbs1_ac32_torch_z3_noff_sac_lchunk"
    spec = checkpointed(tiny_spec("llama"), "full")
    assert checkpointed(spec, "selective").fingerprint() != spec.fingerprint()


def test_the_plan_and_the_collected_table_carry_the_mode(tmp_path):
    """gpt3/tiny's heuristic searches selective beside full for each layout checkpointing every layer of its
    stage, and only those; plan.csv, the specs and the collector's table say which, as the trial id does."""
    _, out, plan = planned(tmp_path)
    rows = read_plan(out)
    sac = [r for r in rows if r["act_ckpt_mode"] == "selective"]
    assert sac and all(r["trial_id"].endswith("_sac") == (r["act_ckpt_mode"] == "selective") for r in rows)
    every_layer = [r for r in rows if r["act_ckpt_mode"] == "full" and r["act_ckpt_layers"] == 4 // r["pp"]]
    assert sorted(r["trial_id"] + "_sac" for r in every_layer) == sorted(r["trial_id"] for r in sac)
    chosen = next(s for s in plan.specs if s.parallel.act_ckpt_mode == "selective")
    assert load_spec(out / "candidate_configs" / f"{chosen.trial_id}.yaml").parallel.act_ckpt_mode == "selective"
    write_ok(out, chosen.trial_id, 0.2)
    table = collect_trials(out).set_index("trial_id")
    assert table.loc[chosen.trial_id, "act_ckpt_mode"] == "selective"
    assert table.loc[chosen.trial_id, "status"] == "ok" and table.loc[chosen.trial_id, "full_run_step_time_s"] > 0
