"""Qwen3 (Hugging Face ``model_type`` qwen3): Llama's layers with an RMSNorm over each head of q and of k before
RoPE (``q_norm``, ``k_norm``: one head-dim weight each), a head dim set apart from hidden / heads in the small
sizes (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024), no biases, tied embeddings up to 4B. Fine-tuned
from its Hugging Face config, never sized from a budget."""

import dataclasses

from hp_tool.families import llama
from hp_tool.families.shape import Shape


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """Llama's layer plus the two per-head norms' weights (head dim each)."""
    return llama.layer_parameters(shape) + 2 * shape.head_dim


def activation_bytes_per_layer(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                               bytes_per_value: int = 2) -> float:
    """Llama's (``llama_activation_bytes_per_layer``) plus what the per-head norms keep: as every RMSNorm of the
    engine, the input upcast to fp32 and the normalised value cast back, (4 + p) bytes a value, over q's and
    k's heads (a·sb and k·sb values), split with the heads by TP. RoPE then reads the norms' outputs and keeps
    nothing of its own; SDPA's inputs are Llama's."""
    s, b, p = shape.seq_length, mbs, bytes_per_value
    qk_norms = (4 + p) * s * b * (shape.attention_dim + shape.kv_dim) / tp
    return llama.llama_activation_bytes_per_layer(shape, mbs, tp, sequence_parallel, p) + qk_norms


FAMILY = dataclasses.replace(
    llama.hf_variant("qwen3", "Qwen3: Llama's layers with per-head q and k RMSNorms (from a Hugging Face config)",
                     qkv_bias=False),
    layer_parameters=layer_parameters,
    activation_bytes=lambda shape, mbs, tp, sp, p, flash, encoder=False: activation_bytes_per_layer(
        shape, mbs, tp, sp, p),
    # transformers' Qwen3: attention_bias puts biases on q, k, v and o; no published Qwen3 has them
    hf_unmodelled=("attention_bias",),
)
