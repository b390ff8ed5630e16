"""Formulas every decoder-only family shares. Pure."""

from __future__ import annotations

from hp_tool.families.shape import Shape


def decoder_layer_flops(shape: Shape, encoder: bool = False) -> float:
    """Forward matmul FLOPs of one decoder-only layer for one sample (attention over the full sequence):
    q/k/v (k/v at the key/value heads' width), scores and their product with v, the output projection and
    the (gated) MLP. ``encoder`` is unused: a decoder-only model has one stack."""
    h, f, s = shape.hidden_size, shape.ffn_hidden_size, shape.seq_length
    a = shape.attention_dim
    qkv = 2 * h * (a + 2 * shape.kv_dim)
    attention = 2 * 2 * s * a  # Q·Kᵀ and scores·V
    out_proj = 2 * a * h
    mlp = (3 if shape.gated_mlp else 2) * 2 * h * f
    return s * (qkv + attention + out_proj + mlp)


def decoder_parameters(shape: Shape) -> int:
    """Parameters of a whole decoder-only model: its layers, embedding and head."""
    f = shape.facts
    return shape.num_layers * f.arch.layer_parameters(shape, False) + f.arch.embedding_parameters(shape) + f.arch.head_parameters(shape)


def skipped_expert_parameters(shape: Shape) -> int:
    """One layer's routed-expert parameters a token does not run: num_experts - top_k of the experts
    (the family's ``expert_parameters``); 0 for a dense model."""
    experts = shape.facts.arch.expert_parameters(shape)
    return experts // shape.num_experts * (shape.num_experts - shape.top_k) if experts else 0


def expert_forward_flops(shape: Shape) -> float:
    """Forward matmul FLOPs of one layer's routed experts for one sample: 2 per weight of the top_k experts
    each token runs; 0 for a dense model."""
    experts = shape.facts.arch.expert_parameters(shape)
    return 2.0 * shape.seq_length * shape.top_k * experts / shape.num_experts if experts else 0.0
