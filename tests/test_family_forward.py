"""Families own their forward and parallel plans; training transforms are converters applied at one point.

- A family's stage hooks change the stage forward exactly as their formulas say (an embedding scale, a soft
  cap on the logits, a sliding window per layer), checked on a tiny model built through ``build_stage``
  against hand computations on the same weights and against transformers' own models; Llama's defaults
  leave the forward transformers' model.
- Every registered family's TP, sequence-parallel, context-parallel and expert plans name modules its
  layers have (a tiny stage built on meta).
- The converter list applies LoRA in ``build_stage``: only adapters train; a full spec has none; a converter
  added to the list is applied there, after those before it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hp_tool.contracts.spec import LoraSpec, ModelSpec
from hp_tool.families import family as family_facts
from hp_tool.trial import converters
from hp_tool.trial.causal import DecoderHooks, soft_capped
from hp_tool.trial.families import known_families, torch_family
from hp_tool.trial.families import base as family_base
from hp_tool.trial.families.base import TorchFamily
from hp_tool.trial.loss import chunked_linear_cross_entropy, full_linear_cross_entropy
from hp_tool.trial.methods import is_adapter
from hp_tool.trial.models import build_stage, hf_config, stage_loss_fn
from hp_tool.trial.weights import materialize
from trial_helpers import tiny_spec

CPU = torch.device("cpu")
SCALE = 8.0  # sqrt(hidden_size) of the tiny model, as Gemma scales its embeddings
CAP = 0.5  # the tiny model's scaled logits reach 0.8: the cap bends the largest, saturates none


def with_hooks(monkeypatch, family: str, hooks: DecoderHooks) -> None:
    """``family``'s record with ``hooks`` as its stage hooks, for this test (all else as registered)."""
    hooked = dataclasses.replace(torch_family(family), stage_hooks=hooks)
    monkeypatch.setitem(family_base._FAMILIES._records, family, hooked)


def built(model: ModelSpec, seed: int = 3):
    """``model``'s single stage built by the engine's path and filled with the seed's weights, on the CPU."""
    stage = build_stage(model, 1, 0)
    materialize(stage, CPU, seed, 0.02)
    return stage.eval()


def reference_logits(model: ModelSpec, stage, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of transformers' whole model of ``model`` holding ``stage``'s weights (named by the family's
    checkpoint names)."""
    family = torch_family(model.family)
    whole = family.model_class(hf_config(model)).eval()
    whole.load_state_dict({family.hf_key(name): value for name, value in stage.state_dict().items()})
    with torch.no_grad():
        return whole(tokens).logits


def tokens_of(model: ModelSpec) -> torch.Tensor:
    return torch.randint(0, model.vocab_size, (2, model.seq_length), generator=torch.Generator().manual_seed(0))


def test_llama_defaults_leave_the_forward_transformers_model():
    model = tiny_spec("llama").model
    hooks = torch_family("llama").stage_hooks
    assert hooks.embed_scale(None) is None and hooks.logit_softcap(None) is None
    assert hooks.attention_window(None, 0) is None
    hooked = {name for name in known_families() if torch_family(name).stage_hooks != DecoderHooks()}
    assert hooked == {"gemma2", "gemma3_text"}  # the only families whose stage computes beyond its modules
    stage, tokens = built(model), tokens_of(model)
    with torch.no_grad():
        torch.testing.assert_close(stage(tokens), reference_logits(model, stage, tokens), rtol=1e-5, atol=1e-5)


def test_embedding_scale_and_logit_cap_follow_their_formulas(monkeypatch):
    model = tiny_spec("llama").model
    assert model.hidden_size ** 0.5 == SCALE
    tokens = tokens_of(model)
    plain = built(model)
    with_hooks(monkeypatch, "llama", DecoderHooks(embed_scale=lambda c: c.hidden_size ** 0.5,
                                                  logit_softcap=lambda c: CAP))
    hooked = built(model)
    assert (hooked.embed_scale, hooked.logit_softcap) == (SCALE, CAP)
    with torch.no_grad():
        got, unchanged = hooked(tokens), plain(tokens)
        # by hand on the same weights: scaling the looked-up rows is scaling the table (untied head), then
        # the cap on the plain forward's logits
        plain.embed_tokens.weight.mul_(SCALE)
        expected = CAP * torch.tanh(plain(tokens) / CAP)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert got.abs().max() < CAP  # capped
    assert (got - unchanged).abs().max() > 0.1 * CAP  # and a different model than Llama's


def test_chunked_loss_applies_the_stage_cap(monkeypatch):
    spec = tiny_spec("llama")
    spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, loss="chunked", loss_chunk_tokens=16))
    with_hooks(monkeypatch, "llama", DecoderHooks(logit_softcap=lambda c: CAP))
    stage = built(spec.model)
    tokens, labels = tokens_of(spec.model), tokens_of(spec.model).roll(-1, dims=1)
    with torch.no_grad():
        whole = F.cross_entropy(stage(tokens).flatten(0, 1), labels.flatten())
        loss = stage_loss_fn(stage, spec.parallel)  # the stage now returns hidden states
        chunked = loss(stage(tokens), labels)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_chunked_soft_capped_loss_and_gradients_equal_the_whole_logits_ones():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 20, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 20), generator=gen)
    grads = []
    for fn in (lambda: full_linear_cross_entropy(hidden, weight, labels, softcap=2.0),
               lambda: chunked_linear_cross_entropy(hidden, weight, labels, 7, softcap=2.0)):
        loss = fn()
        grads.append((loss.detach(), *torch.autograd.grad(loss, (hidden, weight))))
    for full, chunked in zip(*grads):
        torch.testing.assert_close(chunked, full, rtol=1e-10, atol=1e-12)
    uncapped = full_linear_cross_entropy(hidden, weight, labels)
    assert abs(float(uncapped.detach()) - float(grads[0][0])) > 0.1  # the cap changes the loss
    assert torch.equal(soft_capped(hidden, None), hidden)


def test_per_layer_sliding_windows_match_transformers(monkeypatch):
    """Qwen2 with sliding attention from layer 2 on (transformers' ``layer_types``), window 8 of 64 tokens: the
    hook's per-layer windows give transformers' own logits; without them the stage attends to every token."""
    base = tiny_spec("qwen2").model
    model = dataclasses.replace(base, hf_config={"model_type": "qwen2", "use_sliding_window": True,
                                                 "sliding_window": 8, "max_window_layers": 2})
    assert hf_config(model).layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    tokens = tokens_of(model)
    plain = built(model)
    with_hooks(monkeypatch, "qwen2", DecoderHooks(attention_window=lambda c, layer: c.sliding_window
                                                  if c.layer_types[layer] == "sliding_attention" else None))
    hooked = built(model)
    assert hooked.windows == {"0": None, "1": None, "2": 8, "3": 8}
    reference = reference_logits(model, hooked, tokens)
    with torch.no_grad():
        torch.testing.assert_close(hooked(tokens), reference, rtol=1e-5, atol=1e-5)
        assert (plain(tokens) - reference).abs().max() > 1e-4


def plan_names(family: TorchFamily, layer: torch.nn.Module) -> set[str]:
    """Every module (or parameter) name one layer's plans name: TP, sequence parallel, CP's attention, EP."""
    names = set(family.layer_plan(layer))
    if family.sequence_plan is not None:
        names |= set(family.sequence_plan.sharded) | set(family.sequence_plan.gathered)
    if family.attention is not None:
        names.add(family.attention)
    return names | set(family.expert_plan or {})


def missing_names(family: TorchFamily, layer: torch.nn.Module) -> set[str]:
    """The names ``family``'s plans give that ``layer`` has no module (nor, for EP, parameter) of."""
    held = {name for name, _ in layer.named_modules()} | {name for name, _ in layer.named_parameters()}
    return plan_names(family, layer) - held


@pytest.mark.parametrize("name", known_families())
def test_every_family_plan_names_modules_of_its_layers(name):
    model = tiny_spec(name).model
    stage = build_stage(model, 1, 0)  # on the meta device
    family = torch_family(name)
    assert stage.layers and all(p.is_meta for p in stage.parameters())
    untensored = family_facts(name).trial.no_tensor_parallel  # the planner refuses TP for it (Phi-3's fused projections)
    for key, layer in stage.layers.items():
        assert bool(family.layer_plan(layer)) != bool(untensored), f"{name} layer {key}: TP plan against the planner"
        assert set(family.layer_plan(layer).values()) <= {"colwise", "rowwise"}
        assert not missing_names(family, layer), f"{name} layer {key} lacks {missing_names(family, layer)}"


def test_a_plan_naming_a_module_the_layer_lacks_is_caught():
    layer = build_stage(tiny_spec("llama").model, 1, 0).layers["0"]
    llama = torch_family("llama")
    fused = dataclasses.replace(llama, layer_plan=lambda layer: {"self_attn.qkv_proj": "colwise"})
    assert missing_names(fused, layer) == {"self_attn.qkv_proj"}
    gemma_norms = dataclasses.replace(llama, sequence_plan=dataclasses.replace(
        llama.sequence_plan, sharded=("input_layernorm", "pre_feedforward_layernorm")))
    assert missing_names(gemma_norms, layer) == {"pre_feedforward_layernorm"}
    assert missing_names(dataclasses.replace(llama, attention="attn"), layer) == {"attn"}


def lora_model(method: str = "lora") -> ModelSpec:
    return dataclasses.replace(tiny_spec("llama").model, method=method,
                               lora=LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"]))


def test_lora_converter_trains_adapters_only_and_full_has_none():
    assert [type(c) for c in converters.converters_for(lora_model())] == [converters.LoraAdapters]
    assert converters.converters_for(tiny_spec("llama").model) == ()
    adapted = build_stage(lora_model(), 1, 0)
    trainable = {name for name, p in adapted.named_parameters() if p.requires_grad}
    adapters = {name for name, _ in adapted.named_parameters() if is_adapter(name)}
    # q and v of each of the 4 layers, A and B each
    assert trainable == adapters and len(adapters) == 4 * 2 * 2
    full = build_stage(tiny_spec("llama").model, 1, 0)
    assert not any(is_adapter(name) for name, _ in full.named_parameters())
    assert all(p.requires_grad for p in full.parameters())


def test_a_converter_added_to_the_list_is_applied_in_order(monkeypatch):
    seen = []

    class Recording(converters.Converter):
        def applies(self, model):
            return True

        def convert(self, stage, model):
            seen.append(sum(is_adapter(name) for name, _ in stage.named_parameters()))

    monkeypatch.setattr(converters, "CONVERTERS", converters.CONVERTERS + (Recording(),))
    build_stage(lora_model(), 1, 0)
    assert seen == [16]  # once, after LoRA's: its adapters are there
    seen.clear()
    build_stage(tiny_spec("llama").model, 1, 0)
    assert seen == [0]  # a full spec: this converter only


def test_qlora_converts_the_base_to_four_bits_before_the_adapters():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    assert [type(c) for c in converters.converters_for(lora_model("qlora"))] == [converters.FourBitBase,
                                                                                   converters.LoraAdapters]
    stage = build_stage(lora_model("qlora"), 1, 0)
    attention = stage.layers["0"].self_attn
    assert isinstance(attention.q_proj.base_layer, bnb.nn.Linear4bit)  # peft wraps the 4-bit linear
    assert type(attention.k_proj) is torch.nn.Linear  # not a target
