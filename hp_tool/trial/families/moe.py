"""Mixtures of experts on the trial engine: transformers' Mixtral (families ``moe`` and ``mixtral``), Qwen3-MoE
(``qwen3_moe``: Qwen3's per-head q and k norms, no shared expert) and
Qwen2-MoE (``qwen2_moe``, with a gated shared expert and q, k, v biases), Llama's module layout with each
layer's MLP a router and ``num_experts`` experts stored as two 3-D parameters (``mlp.experts.gate_up_proj``
[E, 2f, h], ``mlp.experts.down_proj`` [E, h, f]); see ``llama.decoder_family``.

Tensor parallelism splits the attention only (q, k, v by columns, o by rows): the router, the experts and
the shared expert stay whole on every TP rank, which all see the same tokens (the attention output is
all-reduced), so they route alike, compute the same outputs and get identical gradients. Splitting experts
is expert parallelism's job (``expert_plan``, transformers' own: :func:`hp_tool.trial.parallel.apply_expert_parallel`).

The router's auxiliary load-balancing loss is off (``output_router_logits`` False) and so is its jitter:
the loss is the language model's alone, as for the dense families, and every layout routes the same tokens
to the same experts. Checkpoints are named as Llama's (``llama.hf_key``). Published Mixtral and Qwen2-MoE
files (and ``save_pretrained``'s) store each expert's projections apart, Mixtral's under ``block_sparse_moe``
with its router; ``hf_parts`` says where: the checkpoint reader fuses them as transformers does while loading
(gate and up concatenated, the experts stacked), and a saved run splits them back the same way.
"""

from __future__ import annotations

import re
from typing import Optional

from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)
from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

from hp_tool.contracts.spec import ModelSpec
from hp_tool.trial.families.base import StoredParts, TPStyle, register
from hp_tool.trial.families.llama import decoder_family

ATTENTION_PLAN: dict[str, TPStyle] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
}

_NO_ROUTER_LOSS = dict(output_router_logits=False)  # the trial's loss is the language model's alone


def layer_expert_plan(config_class: type) -> dict[str, str]:
    """One layer's part of the model's expert-parallel plan (the config class's ``base_model_ep_plan``,
    whose keys name every layer as ``layers.*.``), relative to the layer."""
    prefix = "layers.*."
    return {key[len(prefix):]: style for key, style in config_class.base_model_ep_plan.items()
            if key.startswith(prefix)}


def mixtral_sizes(model: ModelSpec) -> dict:
    """Mixtral's expert keys from the spec: ``intermediate_size`` (decoder_config's ffn) is one expert's."""
    return dict(num_local_experts=model.num_experts, num_experts_per_tok=model.top_k, router_jitter_noise=0.0,
                **_NO_ROUTER_LOSS)


def qwen2_moe_sizes(model: ModelSpec) -> dict:
    """Qwen2-MoE's expert keys from the spec: every layer sparse (as the planner counts them), each expert
    ``ffn_hidden_size`` wide, the shared expert ``shared_expert_ffn_hidden_size``, q, k, v biases as the
    spec says."""
    return dict(num_experts=model.num_experts, num_experts_per_tok=model.top_k,
                moe_intermediate_size=model.ffn_hidden_size,
                shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size, decoder_sparse_step=1,
                mlp_only_layers=[], qkv_bias=model.qkv_bias, **_NO_ROUTER_LOSS)


def qwen3_moe_sizes(model: ModelSpec) -> dict:
    """Qwen3-MoE's expert keys from the spec: every layer sparse, each expert ``ffn_hidden_size`` wide, no shared
    expert (the config's ``norm_topk_prob`` as it says)."""
    return dict(num_experts=model.num_experts, num_experts_per_tok=model.top_k,
                moe_intermediate_size=model.ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=[],
                **_NO_ROUTER_LOSS)


# Where published checkpoints keep a layer's expert tensors, relative to ``model.layers.<i>.``: per fused tensor
# the per-expert parts ({e}: the expert) concatenated along dim 0 (gate before up, as transformers' experts
# chunk them), and Mixtral's router under its older module name.
MIXTRAL_PARTS = {"mlp.experts.gate_up_proj": ("block_sparse_moe.experts.{e}.w1.weight",
                                              "block_sparse_moe.experts.{e}.w3.weight"),
                 "mlp.experts.down_proj": ("block_sparse_moe.experts.{e}.w2.weight",),
                 "mlp.gate.weight": "block_sparse_moe.gate.weight"}
QWEN2_MOE_PARTS = {"mlp.experts.gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                   "mlp.experts.down_proj": ("mlp.experts.{e}.down_proj.weight",)}
_LAYER_KEY = re.compile(r"^(.*\blayers\.\d+\.)(.+)$")


def stored_parts(table: dict):
    """``TorchFamily.hf_parts`` for a family whose published checkpoints lay experts out as ``table`` says."""

    def parts(model: ModelSpec, key: str) -> Optional[StoredParts]:
        match = _LAYER_KEY.match(key)
        where = table.get(match.group(2)) if match else None
        if where is None:
            return None
        layer = match.group(1)
        if isinstance(where, str):  # the same tensor under another name
            return StoredParts(((layer + where,),), stacked=False)
        return StoredParts(tuple(tuple(layer + p.format(e=e) for p in where) for e in range(model.num_experts)))

    return parts


def moe_family(name: str, config_class: type, model_class: type, rotary: type, sizes, parts: dict):
    """The record of a mixture of experts with Llama's layout: TP on attention only, transformers' EP plan,
    published checkpoints' per-expert tensors fused on load."""
    return decoder_family(name, config_class, model_class, rotary, family_sizes=sizes, layer_plan=ATTENTION_PLAN,
                          expert_plan=layer_expert_plan(config_class), hf_parts=stored_parts(parts))


register(moe_family("moe", MixtralConfig, MixtralForCausalLM, MixtralRotaryEmbedding, mixtral_sizes, MIXTRAL_PARTS))
register(moe_family("mixtral", MixtralConfig, MixtralForCausalLM, MixtralRotaryEmbedding, mixtral_sizes,
                    MIXTRAL_PARTS))
register(moe_family("qwen2_moe", Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeRotaryEmbedding, qwen2_moe_sizes,
                    QWEN2_MOE_PARTS))
# Qwen3-MoE: Qwen3's per-head q and k norms, experts stored per expert as Qwen2-MoE's
register(moe_family("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeRotaryEmbedding, qwen3_moe_sizes,
                    QWEN2_MOE_PARTS))
