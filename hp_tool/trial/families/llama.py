"""Llama on the trial engine: transformers' Llama (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no
biases, untied head)."""

from __future__ import annotations

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hp_tool.contracts.spec import ModelSpec
from hp_tool.trial.causal import CausalParts, causal_fake_batch, cut_causal_stage
from hp_tool.trial.families.base import TorchFamily, TPStyle, register

# Megatron's split: q/k/v and both SwiGLU inputs (gate, up) by columns, the attention output and the MLP's
# down projection by rows.
LAYER_PLAN: dict[str, TPStyle] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "self_attn.o_proj": "rowwise", "mlp.down_proj": "rowwise",
}


def config(model: ModelSpec) -> LlamaConfig:
    """Llama's config for a spec's shape: SDPA attention, no KV cache."""
    return LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_kv_heads, intermediate_size=model.ffn_hidden_size,
        max_position_embeddings=model.seq_length, rms_norm_eps=1e-5, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )


def cut_stage(model: ModelSpec, full: nn.Module, pp: int, stage: int):
    """This stage of a ``LlamaForCausalLM`` on meta; RoPE's frequencies are rebuilt after materialising."""
    body = full.model
    parts = CausalParts(body.layers, body.embed_tokens, None, body.norm, full.lm_head)
    return cut_causal_stage(model, full.config, parts, pp, stage, rotary=LlamaRotaryEmbedding)


def shard_heads(layer: nn.Module, tp: int) -> None:
    """Nothing to do: Llama's attention reshapes with -1 heads, so the split weights set the count."""


register(TorchFamily(name="llama", config=config, model_class=LlamaForCausalLM, cut_stage=cut_stage,
                     layer_plan=lambda layer: LAYER_PLAN, shard_heads=shard_heads, fake_batch=causal_fake_batch))
