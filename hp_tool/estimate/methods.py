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

from hp_tool.families.shape import Shape

NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # 4.127 bits per 4-bit parameter
ADAPTED = ("lora", "qlora")  # methods that train adapters over a frozen base


def linear_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    """One layer's linear modules by name -> (in, out) features (the family's)."""
    shapes = shape.facts.linear_shapes
    return {} if shapes is None else shapes(shape)


def adapter_parameters_per_layer(shape: Shape) -> int:
    """Trainable adapter parameters of one layer: r·(in + out) per adapted linear; 0 for full training."""
    if shape.method not in ADAPTED:
        return 0
    linears = linear_shapes(shape)
    return sum(shape.lora_rank * (linears[t][0] + linears[t][1]) for t in shape.lora_targets)


def trainable_parameters(shape: Shape, total: int) -> int:
    """Parameters the method trains, of a model of ``total``: all of them, or the adapters of every layer."""
    return total if shape.method not in ADAPTED else shape.num_layers * adapter_parameters_per_layer(shape)


def linear_parameters_per_layer(shape: Shape) -> int:
    """Weights of one layer's linear modules (what QLoRA stores in 4 bits)."""
    return sum(i * o for i, o in linear_shapes(shape).values())


def adapter_forward_flops_per_layer(shape: Shape) -> float:
    """Forward FLOPs of one layer's adapters for one sample: x·Aᵀ then ·Bᵀ, per token."""
    return 2.0 * shape.seq_length * adapter_parameters_per_layer(shape)


def attention_core_flops_per_layer(shape: Shape) -> float:
    """Forward FLOPs of one layer's Q·Kᵀ and scores·V for one sample (no weights: their gradients are the
    inputs' and are computed whatever trains)."""
    return 2 * 2 * shape.seq_length * shape.seq_length * shape.attention_dim


def layer_training_flops(shape: Shape, forward: float) -> float:
    """Forward + backward FLOPs of one layer whose forward costs ``forward`` for one sample: 3x forward in
    full training; with frozen weights the linears' backward is one matmul (input gradients), the attention
    core's two, and the adapters train in full (3x their forward)."""
    if shape.method not in ADAPTED:
        return 3.0 * forward
    core = attention_core_flops_per_layer(shape)
    adapters = adapter_forward_flops_per_layer(shape)
    return forward + (forward - core) + 2 * core + 3 * adapters


def activation_delta_bytes(shape: Shape, mbs: int, tp: int, sequence_parallel: bool, bytes_per_value: int) -> float:
    """What an adapter method changes in one layer's saved activations, one micro-batch: each adapter keeps
    its A's output (r values a token) for B's gradient; the layer's two norms, their weights frozen, no
    longer keep their normalised output (kept for the weights' gradients only). 0 for full training."""
    if shape.method not in ADAPTED:
        return 0.0
    tokens = mbs * shape.seq_length
    adapters = tokens * shape.lora_rank * len(shape.lora_targets) * bytes_per_value
    norms = 2 * tokens * shape.hidden_size * bytes_per_value / (tp if sequence_parallel else 1)
    return adapters - norms


def head_training_flops(shape: Shape, forward: float) -> float:
    """Forward + backward FLOPs of the output head (``forward`` per sample): 3x trained, 2x frozen."""
    return (2.0 if shape.method in ADAPTED else 3.0) * forward
