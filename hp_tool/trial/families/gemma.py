"""Gemma-2 and Gemma-3 on the trial engine: transformers' Gemma2 and Gemma3 text models, Llama's module layout
with four norms a layer (before and after the attention and the MLP; ``(1 + weight)`` RMSNorms), a GeLU-gated
MLP, the token embeddings scaled by sqrt(hidden) and a tied head (built from the spec's Hugging Face config; see
``llama.decoder_family``). What the stage computes beyond the modules is the family's hooks:

  - the embedding scale (transformers keeps it in a non-persistent buffer of its own embedding class, which
    materialising from the meta device would leave empty: the stage takes a plain embedding sharing the weight
    and scales its output, as transformers' does, in the weight's dtype);
  - alternating sliding and full attention (``config.layer_types``): each sliding layer's window mask;
  - Gemma-2: the final logits soft-capped (``final_logit_softcapping``), and the attention scores soft-capped
    inside the attention (``attn_logit_softcapping``), which SDPA cannot do: its layers run transformers' eager
    kernel, the one transformers itself trains Gemma-2 with, with an additive mask for every layer;
  - Gemma-3: per-head q and k norms (inside its attention module), and RoPE with a local base on sliding layers
    and the global one (scaled in the large sizes) on full ones, one rotary module called with the layer type.
"""

from __future__ import annotations

import math

from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from hp_tool.trial.causal import DecoderHooks
from hp_tool.trial.families.base import SequencePlan, register
from hp_tool.trial.families.llama import decoder_family

# Sequence parallelism: the four norms on sequence shards (the attention's and the MLP's outputs arrive as shards
# from their row-split projections, and their norms run before the residual adds); the attention and the MLP
# gather the sequence at their input, as Llama's.
SEQUENCE_PLAN = SequencePlan(sharded=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                      "post_feedforward_layernorm"),
                             gathered={"self_attn": "hidden_states", "mlp": None})


def plain_embedding(scaled: nn.Module) -> nn.Embedding:
    """An ``nn.Embedding`` holding the scaled embedding's weight (the stage scales its output instead)."""
    plain = nn.Embedding(scaled.num_embeddings, scaled.embedding_dim, scaled.padding_idx, device="meta")
    plain.weight = scaled.weight
    return plain


def sliding_window(config, layer: int):
    """The layer's window in tokens where ``config.layer_types`` makes it a sliding layer; None on full ones."""
    return config.sliding_window if config.layer_types[layer] == "sliding_attention" else None


def gemma_hooks(rope_by_layer: bool) -> DecoderHooks:
    """The embedding scale, the sliding windows and the final logits' soft cap where the config sets one
    (Gemma-2's 30); each layer's rotary table by its type (Gemma-3)."""
    return DecoderHooks(
        embed_scale=lambda config: math.sqrt(config.hidden_size),
        logit_softcap=lambda config: config.final_logit_softcapping,
        attention_window=sliding_window,
        rope_layer_type=(lambda config, layer: config.layer_types[layer]) if rope_by_layer else
        (lambda config, layer: None))


register(decoder_family("gemma2", Gemma2Config, Gemma2ForCausalLM, Gemma2RotaryEmbedding,
                        stage_hooks=gemma_hooks(rope_by_layer=False), attention="eager", sequence_plan=SEQUENCE_PLAN,
                        embedding=plain_embedding))
register(decoder_family("gemma3_text", Gemma3TextConfig, Gemma3ForCausalLM, Gemma3RotaryEmbedding,
                        stage_hooks=gemma_hooks(rope_by_layer=True), sequence_plan=SEQUENCE_PLAN,
                        embedding=plain_embedding))
