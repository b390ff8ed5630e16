"""What a fine-tuning method trains and computes: LoRA's adapters and QLoRA's 4-bit base, per layer. Pure.

LoRA (Hu et al. 2021): every adapted linear W (d_out x d_in) stays frozen and gains B·A, A r x d_in and
B d_out x r: r·(d_in + d_out) trainable parameters (REFERENCE §13; peft's count). Frozen weights keep no
gradient and no optimizer state; backward still computes the input gradients through them, but no weight
gradients: a frozen linear costs forward + one matmul instead of forward + two.
QLoRA (Dettmers et al. 2023): the frozen linear weights of the layers in NF4, blocks of 64 values with an
8-bit absmax each and one fp32 constant per 256 blocks (double quantisation): NF4_BITS per parameter;
embeddings, norms and the head stay 16-bit; each layer's weight is dequantised to the compute dtype for
its matmul (a transient copy of the largest one).
"""

from __future__ import annotations

from typing import Optional

from hp_tool.families.shape import Shape
from hp_tool.recipe import Adapters

NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # 4.127 bits per 4-bit parameter
ADAPTED = ("lora", "qlora")  # methods that train adapters over a frozen base

# Each term below takes the adapters a method trains (a Recipe's ``lora``): None for full training.


def linear_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    """One layer's linear modules by name -> (in, out) features (the family's)."""
    shapes = shape.facts.arch.linear_shapes
    return {} if shapes is None else shapes(shape)


def adapter_parameters_per_layer(shape: Shape, lora: Optional[Adapters]) -> int:
    """Trainable adapter parameters of one layer: r·(in + out) per adapted linear; 0 for full training."""
    if lora is None:
        return 0
    linears = linear_shapes(shape)
    return sum(lora.rank * (linears[t][0] + linears[t][1]) for t in lora.target_modules)


def trainable_parameters(shape: Shape, lora: Optional[Adapters], total: int) -> int:
    """Parameters the method trains, of a model of ``total``: all of them, or the adapters of every layer."""
    return total if lora is None else shape.num_layers * adapter_parameters_per_layer(shape, lora)


def linear_parameters_per_layer(shape: Shape) -> int:
    """Weights of one layer's linear modules (what QLoRA stores in 4 bits)."""
    return sum(i * o for i, o in linear_shapes(shape).values())


def adapter_forward_flops_per_layer(shape: Shape, lora: Optional[Adapters]) -> float:
    """Forward FLOPs of one layer's adapters for one sample: x·Aᵀ then ·Bᵀ, per token."""
    return 2.0 * shape.seq_length * adapter_parameters_per_layer(shape, lora)


def attention_core_flops_per_layer(shape: Shape) -> float:
    """Forward FLOPs of one layer's Q·Kᵀ and scores·V for one sample (no weights: their gradients are the
    inputs' and are computed whatever trains)."""
    return 2 * 2 * shape.seq_length * shape.seq_length * shape.attention_dim


def layer_training_flops(shape: Shape, forward: float, lora: Optional[Adapters] = None) -> float:
    """Forward + backward FLOPs of one layer whose forward costs ``forward`` for one sample: 3x forward in
    full training; with frozen weights the linears' backward is one matmul (input gradients), the attention
    core's two, and the adapters train in full (3x their forward)."""
    if lora is None:
        return 3.0 * forward
    core = attention_core_flops_per_layer(shape)
    adapters = adapter_forward_flops_per_layer(shape, lora)
    return forward + (forward - core) + 2 * core + 3 * adapters


def activation_delta_bytes(shape: Shape, lora: Optional[Adapters], mbs: int, tp: int, sequence_parallel: bool,
                           bytes_per_value: int, mask_bytes: int = 1) -> float:
    """What an adapter method changes in one layer's saved activations, one micro-batch: each adapter keeps
    its A's output (r values a token) for B's gradient; the layer's two norms, their weights frozen, no
    longer keep their normalised output (kept for the weights' gradients only); and what the adapters keep
    of the linears' inputs (``adapter_input_bytes``). 0 for full training."""
    if lora is None:
        return 0.0
    tokens = mbs * shape.seq_length
    adapters = tokens * lora.rank * len(lora.target_modules) * bytes_per_value
    norms = 2 * tokens * shape.hidden_size * bytes_per_value / (tp if sequence_parallel else 1)
    return adapters - norms + tokens * adapter_input_bytes(shape, lora, tp, bytes_per_value, mask_bytes)


def adapter_input_bytes(shape: Shape, lora: Adapters, tp: int, bytes_per_value: int, mask_bytes: int = 1) -> float:
    """Bytes per token (on a TP rank: a row-split linear's input is 1/TP of its width) by which what one layer
    keeps of its linear modules' inputs differs from the family's formula, which keeps each input once (the
    family's ``linear_inputs``) for the weights' gradients.

    peft runs each adapter as ``lora_A(dropout(x))``, and A keeps its input for its gradient; the frozen base
    keeps none. So an input stays only where the layer holds it anyway (``held``: the attention's output) or
    an adapter's A reads it as it is (dropout 0, peft's ``nn.Identity``; the engine never casts an adapter's
    input: hp_tool/trial/methods.py ``inject_adapters``). Each adapter keeps its own input-sized copy in the
    compute dtype when its dropout is above 0 (q, k and v read one tensor but drop it out apart). With dropout
    also its mask,
    ``mask_bytes`` an element: 1 on a GPU, where torch's dropout runs ``native_dropout``, which keeps a bool
    mask; on a CPU torch's dropout multiplies by a noise tensor of the input's dtype and keeps that
    (``bytes_per_value``, 4 in fp32). The trace runs each as its target does (hp_tool/trial/trace/replay.py
    ``dropout_as_on``). Not counted: the first layer's q, k and v keep no mask (its input needs no gradient).
    Checked against the trace in tests/test_lora_dropout_memory.py."""
    linears, targets = linear_shapes(shape), set(lora.target_modules)
    rowwise = {m.name for m in shape.facts.arch.layer_matmuls(shape) if m.split == "rowwise"} \
        if shape.facts.arch.layer_matmuls is not None else set()
    dropout = lora.dropout > 0  # each adapter drops its input out apart: its own copy and mask
    per_adapter = (bytes_per_value + mask_bytes) if dropout else 0
    total = 0.0
    for tensor in shape.facts.arch.linear_inputs:
        width = linears[tensor.readers[0]][0] / (tp if tensor.readers[0] in rowwise else 1)
        readers = sum(name in targets for name in tensor.readers)
        kept = tensor.held or (readers > 0 and not dropout)
        total += readers * per_adapter * width - (0 if kept else bytes_per_value * width)
    return total


def head_training_flops(forward: float, lora: Optional[Adapters] = None) -> float:
    """Forward + backward FLOPs of the output head (``forward`` per sample): 3x trained, 2x frozen."""
    return (2.0 if lora is not None else 3.0) * forward
