"""Mixtures of experts (Mixtral, Qwen2-MoE) trained by the trial engines: every layout is the single-process
model, expert parallelism (EP) really splits the experts, a saved EP run holds whole experts, and the memory
trace models EP 1 and names why it cannot model EP > 1.

No GPU and no second node here: each layout runs as 2 CPU processes under torchrun (gloo, fp32), which
exercises the same meshes, wrappers and collectives (the experts' all-to-all included) as GPUs would.

The model is tiny (2 layers, hidden 64, 4 experts of width 32, top-2, 32 tokens, vocabulary 256) and every
layout starts from the same weights, so each router picks the same experts for the same tokens. The runs
repeat one global batch with plain SGD, a larger initial spread (std 0.1) and no clipping, so a step's
update shows in the next loss: the losses and gradient norms of all 3 steps must equal the single-process
run's (rel 1e-4). Leaving the experts' gradients undivided by EP would change the first step's gradient
norm by 14% and the second step's loss by 0.4% here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hp_tool.contracts.spec import DataSpec, TrialSpec
from hp_tool.trial.train import run_trial
from trial_helpers import read_metrics, read_result, tiny_spec, torchrun, write_spec

REL_TOL = 1e-4
STEPS = 3
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def mixtral_config(spec: TrialSpec) -> dict:
    """A Mixtral config.json of the tiny spec's sizes: the Mixtral runs build the model as a fine-tuning run
    does, from its Hugging Face config (Qwen2-MoE from the spec's sizes, as a planned ``moe`` model)."""
    from transformers import MixtralConfig

    m = spec.model
    return MixtralConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_kv_heads, num_local_experts=m.num_experts,
                         num_experts_per_tok=m.top_k, max_position_embeddings=m.seq_length).to_dict()


def moe_spec(family: str, tokens: Path, save_dir: Path | None = None, **layout) -> TrialSpec:
    """The tiny MoE spec of ``family`` in ``layout``, trained on one repeated global batch (``tokens``) with
    SGD; two untimed steps measure the memory peak."""
    spec = tiny_spec(family, max_steps=STEPS, warmup_steps=2, **layout)
    model = dataclasses.replace(spec.model, init_method_std=0.1,
                                hf_config=mixtral_config(spec) if family == "mixtral" else None)
    training = dataclasses.replace(spec.training, optimizer="sgd", lr=1.0, min_lr=0.0, warmup_steps=0,
                                   weight_decay=0.0, grad_clip=0.0, data=DataSpec(source="file", path=str(tokens)))
    run = dataclasses.replace(spec.run, save_dir=str(save_dir) if save_dir else None)
    return dataclasses.replace(spec, model=model, training=training, run=run)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """One global batch of token ids (8 windows of 33), which every step reads again."""
    path = tmp_path_factory.mktemp("tokens") / "batch.bin"
    np.random.default_rng(0).integers(0, 256, 8 * 33).astype(np.uint16).tofile(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokens):
    """Each named run of the module, launched once: (spec, output folder, result, torchrun's stderr)."""
    layouts = {
        "mixtral": ("mixtral", {}),
        "qwen2_moe": ("qwen2_moe", {}),
        "mixtral-ep2-ddp": ("mixtral", {"dp": 2, "ep": 2, "zero_stage": 0}),
        "mixtral-ep2-fsdp2": ("mixtral", {"dp": 2, "ep": 2, "zero_stage": 3}),
        "mixtral-tp2": ("mixtral", {"tp": 2}),
        "qwen2_moe-ep2-zero2": ("qwen2_moe", {"dp": 2, "ep": 2, "zero_stage": 2}),
        "mixtral-deepspeed-zero3": ("mixtral", {"dp": 2, "engine": "deepspeed", "zero_stage": 3}),
        "mixtral-ep2-tp2": ("mixtral", {"dp": 2, "ep": 2, "tp": 2, "zero_stage": 3}),
        "mixtral-ep2-offload": ("mixtral", {"dp": 2, "ep": 2, "zero_stage": 3, "offload": "optimizer_and_params"}),
    }
    saving = {"mixtral", "mixtral-ep2-fsdp2"}
    done = {}

    def run(name: str):
        if name not in done:
            folder = tmp_path_factory.mktemp(name)
            family, layout = layouts[name]
            spec = moe_spec(family, tokens, folder / "model" if name in saving else None, **layout)
            world = spec.parallel.tp * spec.parallel.pp * spec.parallel.dp
            if world == 1:
                result, stderr = run_trial(write_spec(spec, folder), str(folder / "out")), ""
            else:
                proc = torchrun(write_spec(spec, folder), folder / "out", world)
                assert proc.returncode == 0, proc.stderr[-4000:]
                result, stderr = read_result(folder / "out"), proc.stderr
            assert result["status"] == "ok", result["reason"]
            done[name] = (spec, folder, result, stderr)
        return done[name]

    return run


def losses_and_norms(folder: Path) -> tuple[list[float], list[float]]:
    metrics = read_metrics(folder / "out")
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", [
    # the covering set (default run): EP over DDP and over FSDP2, TP, Qwen2-MoE's code path (ZeRO-2), DeepSpeed;
    # each parallelism once per engine, each family once. The combinations are the matrix tier (-m matrix).
    "mixtral-ep2-ddp", "mixtral-ep2-fsdp2", "mixtral-tp2", "qwen2_moe-ep2-zero2", "mixtral-deepspeed-zero3",
    pytest.param("mixtral-ep2-tp2", marks=pytest.mark.matrix),
    pytest.param("mixtral-ep2-offload", marks=pytest.mark.matrix)])
def test_layout_trains_as_one_process(runs, name):
    """EP2 over DDP and over FSDP2 (ZeRO-3), TP2 (the experts whole on both TP ranks), Qwen2-MoE's shared
    expert beside EP2 over ZeRO-2, DeepSpeed's ZeRO-3 sharding the experts as any weight (EP 1), EP2 x TP2
    (4 processes: each TP rank dispatches its slice of the tokens, the experts' gradients summed over TP) and
    EP2 over FSDP2 offloading to host RAM."""
    spec, folder, _, _ = runs(name)
    _, reference, _, _ = runs(spec.model.family)
    losses, norms = losses_and_norms(folder)
    ref_losses, ref_norms = losses_and_norms(reference)
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, rel=REL_TOL)
    assert norms == pytest.approx(ref_norms, rel=REL_TOL)
    assert ref_losses[2] < ref_losses[0] - 0.1  # the repeated batch is being learnt: the steps matter


def expert_elements(spec: TrialSpec) -> int:
    """Parameter elements of all the model's routed experts (the 3-D expert tensors)."""
    from hp_tool.trial.models import build_full_model_on_meta

    return sum(p.numel() for name, p in build_full_model_on_meta(spec.model).named_parameters()
               if name.endswith(EXPERT_TENSORS))


@pytest.mark.e2e
@pytest.mark.slow
def test_an_expert_parallel_rank_holds_half_the_experts(runs):
    """Under EP2 with DDP each rank holds every dense weight and half of the experts."""
    spec, _, _, stderr = runs("mixtral-ep2-ddp")
    held = {int(rank): int(n) for rank, n in re.findall(r"rank (\d): stage 0 holds (\d+) parameter elements", stderr)}
    whole = spec.model.shape()
    from hp_tool.architectures import count_parameters

    assert set(held) == {0, 1}
    assert held[0] == held[1] == count_parameters(whole) - expert_elements(spec) // 2


@pytest.mark.e2e
@pytest.mark.slow
def test_an_expert_parallel_run_saves_whole_experts(runs):
    """The EP2 x FSDP2 run's saved model (every rank gathering its experts) is the single-process run's,
    whole experts included, stored per expert as published Mixtral checkpoints are, and transformers loads
    it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    spec, folder, _, _ = runs("mixtral-ep2-fsdp2")
    _, reference, _, _ = runs("mixtral")
    with safe_open(str(folder / "model" / "model.safetensors"), framework="pt") as fh:
        stored = set(fh.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in stored
    assert not any("gate_up_proj" in key for key in stored)
    split = dict(AutoModelForCausalLM.from_pretrained(str(folder / "model")).named_parameters())
    one = dict(AutoModelForCausalLM.from_pretrained(str(reference / "model")).named_parameters())
    m = spec.model
    assert split["model.layers.1.mlp.experts.gate_up_proj"].shape == (m.num_experts, 2 * m.ffn_hidden_size,
                                                                     m.hidden_size)
    assert split.keys() == one.keys()
    for name, value in one.items():
        torch.testing.assert_close(split[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "mixtral-tp2"])
def test_trace_of_an_unsplit_mixture_matches_the_measured_peak(runs, name):
    """At EP 1 the trace runs the experts' fp32 grouped matmuls (``experts_in_any_float``) and equals the
    real run's measured peak per rank."""
    from hp_tool.trial.trace.replay import trace_stage

    spec, _, result, _ = runs(name)
    assert trace_stage(spec, 0, "cpu").peak_gib == pytest.approx(result["peak_tensor_memory_gib"], rel=0.01)


def test_expert_parallelism_is_untraceable_with_its_reason(tokens):
    from hp_tool.trial.trace.limits import Untraceable, untraceable_reason
    from hp_tool.trial.trace.replay import trace_stage

    spec = moe_spec("mixtral", tokens, dp=2, ep=2, zero_stage=3)
    assert untraceable_reason(moe_spec("mixtral", tokens, dp=2, zero_stage=3)) is None
    reason = untraceable_reason(spec)
    assert reason.startswith("expert parallelism (EP=2)")
    with pytest.raises(Untraceable, match=re.escape(reason)):
        trace_stage(spec, 0, "cpu")


@pytest.mark.e2e
@pytest.mark.slow
def test_tiny_moe_fine_tuning_search_ranks_ep1_and_ep2_trials(tmp_path):
    """finetune/tiny_moe end to end on this machine: the plan searches EP 1 and 2, real trials train the
    Mixtral-shaped model in both, and the summary names each trial's experts, top-k, EP and active
    parameters beside the total."""
    import csv

    from search_helpers import main_here

    # the CLI's entry in this process (its trials are local jobs, processes of their own)
    proc = main_here("search_config=finetune/tiny_moe", "cluster=local", f"base_results_dir={tmp_path}",
                     "search_config.train_settings.search_strategy=exhaustive",
                     "search_config.train_settings.micro_batch_sizes=[4]",
                     "search_config.train_settings.zero_stages=[0]",
                     "search_config.train_settings.max_steps_per_run=6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "finetune" / "tiny_moe" / "final_results" / "final_summary_1nodes.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["ep"] for r in rows) == ["1", "2"]
    ranking = proc.stdout[proc.stdout.index("Fastest"):]  # the ranking printed after the trials, not the plan
    assert "┃ EP ┃" in ranking  # it names the expert-parallel size, as the printed plan does
    for r in rows:
        assert r["status"] == "ok" and f"_ep{r['ep']}_" in r["trial_id"]
        assert (r["experts"], r["top_k"], r["active_parameters"]) == ("4", "2", "263744")
        assert float(r["mfu"]) > 0
