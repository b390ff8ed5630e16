"""Mixture-of-experts decoders: Llama's attention (grouped-query, RoPE, RMSNorm) with every layer's MLP
replaced by ``num_experts`` SwiGLU experts of ``ffn_hidden_size`` each, a linear router (hidden x experts)
sending every token to ``top_k`` of them, and (Qwen2-MoE) an always-active shared expert with a sigmoid gate.

Families: ``moe`` (sized from a budget, Mixtral's architecture), ``mixtral`` and ``qwen2_moe`` (read from a
Hugging Face config). Counts follow transformers' modules (``MixtralSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock``); REFERENCE §14 has the published totals they reproduce (Mixtral-8x7B 46.7B total,
12.9B active).

Sizing from a budget: ``model_size_in_b`` is the *active* parameter count, because the compute a budget buys
is 6·N_active·D (FLOPs per token follow the experts a token runs, not those it skips); the experts multiply
the memory, not the FLOPs. Width, heads and FFN come from Llama's table for that size (Mixtral-8x7B is
Mistral-7B's layers with 8 experts), 8 experts and top-2 as Mixtral, and the layer count that gives the
active size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from hp_tool.families import llama
from hp_tool.families.decoder import (decoder_layer_flops, decoder_parameters, expert_forward_flops,
                                      skipped_expert_parameters)
from hp_tool.families.registry import Family, Matmul, layer_term
from hp_tool.families.shape import Shape, num_layers_for
from hp_tool.tables import Table, lookup

MIXTRAL_EXPERTS, MIXTRAL_TOP_K = 8, 2  # Mixtral-8x7B and 8x22B (config.json: num_local_experts, num_experts_per_tok)

# Expected load of the busiest expert over the mean (top_k·tokens/experts) when routing is dropless: Switch
# Transformer trains with capacity factors 1.0-1.25 (Fedus et al. 2021, §2.2 and Table 1) and finds 1.25 keeps
# nearly every token; GShard uses 2.0 when it drops tokens beyond capacity. Default: 1.25.
DEFAULT_EXPERT_IMBALANCE = 1.25


def _without_mlp(shape: Shape) -> Shape:
    """The layer with no MLP: Llama's attention and norms, which Llama's formulas count on their own."""
    return dataclasses.replace(shape, ffn_hidden_size=0)


def expert_parameters(shape: Shape) -> int:
    """One layer's routed experts: ``num_experts`` SwiGLU MLPs (gate, up, down) of ``ffn_hidden_size``. These
    are what expert parallelism splits; 0 for a dense model."""
    return shape.num_experts * 3 * shape.hidden_size * shape.ffn_hidden_size


def always_active_parameters(shape: Shape) -> int:
    """One layer's MoE parameters every token uses besides the routed experts: the router (hidden x
    experts) and the shared expert's SwiGLU with its one-output gate."""
    h = shape.hidden_size
    shared = 3 * h * shape.shared_expert_ffn + h if shape.shared_expert_ffn else 0
    return h * shape.num_experts + shared


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """One layer, every expert counted: Llama's attention and norms (q, k, v biases where the model has
    them), the router, the shared expert and the routed experts."""
    return llama.layer_parameters(_without_mlp(shape)) + always_active_parameters(shape) + expert_parameters(shape)


def layer_forward_flops(shape: Shape, encoder: bool = False) -> float:
    """Forward matmul FLOPs of one layer for one sample, counting the experts a token runs (top_k): Llama's
    attention (q/k/v, the scores and their product with v, o), the router, the shared expert with its gate
    and top_k SwiGLU experts."""
    h, s = shape.hidden_size, shape.seq_length
    router = 2 * h * shape.num_experts
    shared = 3 * 2 * h * shape.shared_expert_ffn + 2 * h if shape.shared_expert_ffn else 0
    return decoder_layer_flops(_without_mlp(shape)) + s * (router + shared) + expert_forward_flops(shape)


def _routed_bytes(shape: Shape, tokens: int, bytes_per_value: int) -> float:
    """Bytes the routed experts keep for ``tokens`` tokens' top_k expert rows: per row its gathered input and
    the weighted output (2h), the gate/up output, SiLU output and their product (4f), as transformers'
    experts forward saves them."""
    return bytes_per_value * shape.top_k * tokens * (2 * shape.hidden_size + 4 * shape.ffn_hidden_size)


def expert_activation_bytes(shape: Shape, mbs: int, bytes_per_value: int) -> float:
    """Bytes one layer's routed experts keep for backward at the mean load (top_k copies of each token,
    ``_routed_bytes``) and the router's fp32 probabilities."""
    tokens = shape.seq_length * mbs
    return _routed_bytes(shape, tokens, bytes_per_value) + 4 * tokens * shape.num_experts * 2


def expert_parallel_activation_bytes(shape: Shape, mbs: int, ep: int, bytes_per_value: int, tp: int = 1) -> float:
    """What splitting the experts over ``ep`` ranks changes in one layer's saved activations (the family's
    count has every token's top_k expert rows, as one rank holding all experts runs them), one micro-batch:
    the busiest rank's experts receive ``expert_imbalance`` times the mean of the routed tokens, each TP rank
    dispatches only its 1/TP slice of them, and the all-to-all keeps the sorted copy of the tokens it sent
    (transformers' AllToAllEP). 0 at EP 1."""
    if ep <= 1:
        return 0.0
    tokens = shape.seq_length * mbs
    dispatch = bytes_per_value * shape.top_k * tokens * shape.hidden_size
    return (shape.expert_imbalance / tp - 1.0) * _routed_bytes(shape, tokens, bytes_per_value) + dispatch / tp


def activation_bytes(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                     bytes_per_value: int = 2, flash: bool = True, encoder: bool = False) -> float:
    """Bytes one layer keeps for backward, one micro-batch: Llama's attention and norms (its formula with no
    MLP), the routed experts at the mean load (not split by TP: the engine runs whole experts on every TP
    rank), and the shared expert as a SwiGLU MLP (whole on every TP rank too)."""
    s, b, p = shape.seq_length, mbs, bytes_per_value
    attention_and_norms = llama.llama_activation_bytes_per_layer(_without_mlp(shape), mbs, tp, sequence_parallel, p)
    shared = 4 * p * s * b * shape.shared_expert_ffn
    return attention_and_norms + expert_activation_bytes(shape, mbs, p) + shared


def moe_shape(size_b: float, vocab: int, seq: int, decoder_seq: Optional[int] = None) -> tuple[Shape, float]:
    """A Mixtral-style shape with ``size_b`` billion *active* parameters (see the module docstring)."""
    hidden, heads, kv, multiplier, multiple_of, lr = lookup(llama.LLAMA_SHAPE, size_b)
    ffn = llama.llama_ffn(hidden, multiplier, multiple_of)

    def shape(layers: int) -> Shape:
        return Shape("moe", layers, hidden, heads, kv, ffn, vocab, seq, num_experts=MIXTRAL_EXPERTS,
                     top_k=MIXTRAL_TOP_K)

    def active(layers: int) -> int:
        return decoder_parameters(shape(layers)) - layers * skipped_expert_parameters(shape(layers))

    return shape(num_layers_for(size_b, active, f"a mixture of experts with hidden size {hidden}")), lr


def linear_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    """The nn.Linear modules of a layer LoRA can adapt: the attention projections (transformers' experts are
    3-D parameters peft's LoRA layers do not wrap, and adapting them would defeat the sparsity)."""
    full = llama.FAMILY.arch.linear_shapes(shape)
    return {name: full[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


def layer_matmuls(shape: Shape) -> tuple[Matmul, ...]:
    """A layer's nn.Linear matmuls in forward order (transformers' Mixtral and Qwen2-MoE layers): Llama's q, k,
    v and o, then the shared expert's gate, up and down (Qwen2-MoE), the router, and the shared expert's
    one-output gate; whole on every TP rank but the attention's. The routed experts run as grouped matmuls,
    which the selective policy does not count (and recomputes)."""
    h, e, fs = shape.hidden_size, shape.num_experts, shape.shared_expert_ffn
    attention = llama.layer_matmuls(shape)[:4]
    router = (Matmul("gate", h, e, "whole"),)
    if not fs:
        return attention + router
    shared = (Matmul("shared_expert.gate_proj", h, fs, "whole"), Matmul("shared_expert.up_proj", h, fs, "whole"),
              Matmul("shared_expert.down_proj", fs, h, "whole"))
    return attention + shared + router + (Matmul("shared_expert_gate", h, 1, "whole"),)


# Grid for MoE: size (active billions) <= bound -> (TP, PP, MBS, (min, max) of TP*PP); the experts multiply
# the memory of a dense model of the active size by about num_experts / top_k, so start from the dense
# table of a model 3x larger (Mixtral-8x7B ~ a 40B dense model's layout) and let the memory model prune.
MOE_GRID: Table = [
    (4, ([1, 2], [1, 2], [1, 2, 4], (1, 8))),
    (15, ([1, 2, 4], [1, 2, 4], [1, 2], (1, 16))),
    (45, ([2, 4, 8], [1, 2, 4, 8], [1, 2], (2, 64))),
    (500, ([4, 8], [2, 4, 8, 16], [1], (8, 128))),
]


FAMILY = llama.FAMILY.variant(
    name="moe",
    description="Mixture of experts (Mixtral's architecture): Llama's attention, top-k of n SwiGLU experts per layer",
    shape_for_size=moe_shape,
    layer_parameters=layer_parameters,
    layer_forward_flops=layer_forward_flops,
    activation_bytes=layer_term(activation_bytes),
    grid_table=lambda shape: MOE_GRID,
    hf_qkv_bias=None,
    hf_unmodelled=(),
    linear_shapes=linear_shapes,
    linear_inputs=llama.LINEAR_INPUTS[:2],  # the attention's (linear_shapes)
    moe=True,
    expert_parameters=expert_parameters,
    expert_parallel_activation_bytes=lambda shape, at: expert_parallel_activation_bytes(shape, at.mbs, at.ep,
                                                                                        at.bytes_per_value, at.tp),
    # compiled, the experts' SwiGLU recomputes its SiLU too, over the routed tokens: not counted (Llama's fused norms
    # are; the experts' eager bytes stand, an upper bound)
    compiled_saving=None,
    layer_matmuls=layer_matmuls,
    layer_ops=(94, 163, 157),
    layer_tensors=(8, 9),
    layer_bytes=((184, 64), (428, 134), (144, 64)),
)


def hf_moe_variant(name: str, description: str, qkv_bias: bool, unmodelled: tuple[str, ...] = ()) -> Family:
    """A mixture of experts read from its Hugging Face config only (never sized from a budget)."""
    return FAMILY.variant(name=name, description=description, planner=False, hf_qkv_bias=lambda config: qkv_bias,
                          hf_unmodelled=unmodelled)
