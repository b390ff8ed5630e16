"""Llama on the trial engine: transformers' Llama (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no
biases, untied head), and ``decoder_family``, which builds the record of any model with Llama's module layout
(Mistral, Qwen2: ``mistral.py``, ``qwen2.py``).

A fine-tuned model's spec carries its Hugging Face config (``model.hf_config``): the transformers config is
built from it, so the trial runs exactly the architecture the config describes (RoPE base and scaling, norm
epsilon, biases, head dim, tied embeddings); the spec's shape fields override the sizes, so the memory tracer
can build the same model with fewer layers.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hp_tool.contracts.spec import ModelSpec
from hp_tool.trial.causal import CausalParts, DecoderHooks, causal_fake_batch, cut_causal_stage
from hp_tool.trial.families.base import SequencePlan, TorchFamily, TPStyle, register

# Megatron's split: q/k/v and both SwiGLU inputs (gate, up) by columns, the attention output and the MLP's
# down projection by rows.
LAYER_PLAN: dict[str, TPStyle] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "self_attn.o_proj": "rowwise", "mlp.down_proj": "rowwise",
}
# Sequence parallelism (torchtitan's plan): the two RMSNorms on sequence shards; the attention (called with its
# hidden states by keyword) and the MLP (positionally) gather the sequence at their input.
SEQUENCE_PLAN = SequencePlan(sharded=("input_layernorm", "post_attention_layernorm"),
                             gathered={"self_attn": "hidden_states", "mlp": None})
ATTENTION = "self_attn"  # the attention module context parallelism runs as the ring

# config.json keys that describe a checkpoint's file rather than the architecture, and ``layer_types``, one
# entry per layer of the config's depth, which ``decoder_config`` cuts to the spec's depth
_NOT_ARCHITECTURE = ("model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "layer_types")


def decoder_config(model: ModelSpec, config_class: type, family_sizes: Optional[dict] = None,
                   attention: str = "sdpa") -> Any:
    """The transformers config for a spec: its Hugging Face config when it has one, else hp_tool's Llama
    defaults; the spec's sizes on top (``family_sizes``: the keys a family adds, e.g. its experts); transformers'
    ``attention`` kernel (SDPA unless the family's attention needs another), no dropout, no KV cache."""
    given = {k: v for k, v in (model.hf_config or {}).items() if k not in _NOT_ARCHITECTURE}
    if not given:
        given = dict(max_position_embeddings=model.seq_length, rms_norm_eps=1e-5, attention_bias=False,
                     mlp_bias=False)
    sizes = dict(vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                 num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_kv_heads,
                 intermediate_size=model.ffn_hidden_size, tie_word_embeddings=bool(model.tied_embeddings))
    # the head dim always: a config class may default it apart from hidden / heads (Qwen3's 128)
    sizes["head_dim"] = model.kv_channels or model.hidden_size // model.num_attention_heads
    # each layer's kind (sliding or full attention: Gemma) as the config lists it, for the layers the spec builds (the
    # tracer builds fewer); a config without the list derives it for the spec's depth
    layer_types = (model.hf_config or {}).get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) >= model.num_layers:
        sizes["layer_types"] = layer_types[:model.num_layers]
    sizes.update(family_sizes or {})
    return config_class(**{**given, **sizes, "use_cache": False, "attention_dropout": 0.0,
                           "attn_implementation": attention})


def shard_heads(layer: nn.Module, tp: int) -> None:
    """Nothing to do: Llama's attention reshapes with -1 heads, so the split weights set the count."""


def hf_key(name: str) -> str:
    """A canonical parameter name's key in a Hugging Face checkpoint of Llama's layout: the body under
    ``model.``, the head as it is."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def decoder_family(name: str, config_class: type, model_class: type, rotary: type,
                   family_sizes: Callable[[ModelSpec], dict] = lambda model: {},
                   layer_plan: dict[str, TPStyle] = LAYER_PLAN, expert_plan: Optional[dict[str, str]] = None,
                   hf_key: Optional[Callable[[str], str]] = hf_key,
                   hf_parts: Callable = lambda model, key: None,
                   stage_hooks: DecoderHooks = DecoderHooks(), attention: str = "sdpa",
                   sequence_plan: SequencePlan = SEQUENCE_PLAN,
                   embedding: Callable[[nn.Module], nn.Module] = lambda module: module) -> TorchFamily:
    """The record of a model with Llama's module layout (``model.layers``, ``embed_tokens``, ``norm``,
    ``lm_head``, the same attention projections and norms); RoPE's frequencies are rebuilt after
    materialising. ``family_sizes``: config keys the spec sets besides ``decoder_config``'s (a mixture of
    experts' experts), ``layer_plan``: one layer's TP plan, ``expert_plan``: its EP plan
    (``TorchFamily.expert_plan``), ``hf_key``: checkpoint names (None: no checkpoint loads), ``hf_parts``:
    tensors a published checkpoint stores in parts (``TorchFamily.hf_parts``), ``stage_hooks``: what its
    stage computes beyond its modules (``TorchFamily.stage_hooks``; Llama's add nothing), ``attention``:
    transformers' attention kernel, ``sequence_plan``: one layer's sequence-parallel plan, ``embedding``: the
    stage's token embedding from the model's (a family that scales it in its hooks takes a plain one)."""

    def cut_stage(model: ModelSpec, full: nn.Module, pp: int, stage: int, hooks: DecoderHooks):
        body = full.model
        parts = CausalParts(body.layers, embedding(body.embed_tokens), None, body.norm, full.lm_head)
        return cut_causal_stage(model, full.config, parts, pp, stage, rotary=rotary, hooks=hooks)

    return TorchFamily(name=name,
                       config=lambda model: decoder_config(model, config_class, family_sizes(model), attention),
                       model_class=model_class, cut_stage=cut_stage, layer_plan=lambda layer: layer_plan,
                       shard_heads=shard_heads, sequence_plan=sequence_plan, attention=ATTENTION,
                       fake_batch=causal_fake_batch, hf_key=hf_key, expert_plan=expert_plan, hf_parts=hf_parts,
                       stage_hooks=stage_hooks)


register(decoder_family("llama", LlamaConfig, LlamaForCausalLM, LlamaRotaryEmbedding))
