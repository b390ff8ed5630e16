"""Qwen3 (Hugging Face ``model_type`` qwen3): Llama's layers with an RMSNorm over each head of q and of k before
RoPE (``q_norm``, ``k_norm``: one head-dim weight each), a head dim set apart from hidden / heads in the small
sizes (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024), no biases, tied embeddings up to 4B; and Qwen3-MoE
(``qwen3_moe``): the same attention over Qwen2-MoE's routed experts without a shared expert. Fine-tuned from its
Hugging Face config, never sized from a budget."""

from hp_tool.families import llama, moe
from hp_tool.families.registry import layer_term
from hp_tool.families.shape import Shape


def qk_norm_parameters(shape: Shape) -> int:
    """The two per-head norms' weights (head dim each)."""
    return 2 * shape.head_dim


def qk_values(shape: Shape, mbs: int, tp: int) -> float:
    """Values the per-head q and k norms normalise on a rank, one micro-batch: q's and k's heads (a·sb and k·sb),
    split with the heads by TP."""
    return shape.seq_length * mbs * (shape.attention_dim + shape.kv_dim) / tp


def qk_norm_bytes(shape: Shape, mbs: int, tp: int, bytes_per_value: int) -> float:
    """What the per-head norms keep for backward: as every RMSNorm of the engine, the input upcast to fp32 and
    the normalised value cast back, (4 + p) bytes a value (``qk_values``). RoPE then reads the norms' outputs and
    keeps nothing of its own."""
    return (4 + bytes_per_value) * qk_values(shape, mbs, tp)


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """Llama's layer plus the two per-head norms' weights."""
    return llama.layer_parameters(shape) + qk_norm_parameters(shape)


def activation_bytes_per_layer(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                               bytes_per_value: int = 2) -> float:
    """Llama's (``llama_activation_bytes_per_layer``) plus what the per-head norms keep (``qk_norm_bytes``)."""
    return llama.llama_activation_bytes_per_layer(shape, mbs, tp, sequence_parallel, bytes_per_value) + \
        qk_norm_bytes(shape, mbs, tp, bytes_per_value)


def fused_norm_saving(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                      bytes_per_value: int = 2, frozen: bool = False) -> float:
    """Llama's (``llama_fused_norm_saving``) and the per-head norms' fp32 copies, 4 bytes a value of q and k (their
    eager bytes, ``qk_norm_bytes``, stand with an adapter method too)."""
    return llama.llama_fused_norm_saving(shape, mbs, tp, sequence_parallel, bytes_per_value, frozen) + \
        4 * qk_values(shape, mbs, tp)


FAMILY = llama.hf_variant("qwen3", "Qwen3: Llama's layers with per-head q and k RMSNorms (from a Hugging Face config)",
                          qkv_bias=False).variant(
    layer_parameters=layer_parameters,
    activation_bytes=layer_term(activation_bytes_per_layer),
    fused_norm_saving=lambda shape, at: fused_norm_saving(shape, at.mbs, at.tp, at.sequence_parallel, at.bytes_per_value,
                                                          at.frozen_norms),
    # transformers' Qwen3: attention_bias puts biases on q, k, v and o; no published Qwen3 has them
    hf_unmodelled=("attention_bias",),
    layer_ops=(87, 174, 164),
    layer_tensors=(11, 11),
    layer_bytes=((173, 10), (421, 18), (167, 10)),
)

MOE = moe.hf_moe_variant("qwen3_moe", "Qwen3-MoE: Qwen3's attention (per-head q and k norms) over fine-grained routed "
                         "experts, no shared expert (from a Hugging Face config)", qkv_bias=False,
                         unmodelled=("attention_bias",)).variant(
    layer_parameters=lambda shape, encoder=False: moe.layer_parameters(shape) + qk_norm_parameters(shape),
    activation_bytes=lambda shape, at: moe.activation_bytes(shape, at.mbs, at.tp, at.sequence_parallel,
                                                            at.bytes_per_value) +
    qk_norm_bytes(shape, at.mbs, at.tp, at.bytes_per_value),
    fused_norm_saving=FAMILY.memory.fused_norm_saving,
    layer_ops=(105, 191, 184),
    layer_tensors=(10, 11),
    layer_bytes=((216, 64), (507, 134), (195, 64)),
)
