"""Per-family shapes, parameter counts and FLOP counts. Pure functions, no torch.

Parameter count (GPT): P = 12·L·h² + 13·L·h + (V + s)·h. FLOPs: every matmul of each family counted
per token (Narayanan et al. 2021 for GPT; Llama's grouped-query attention and SwiGLU counted as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from hp_tool.tables import GPT3_SHAPE, LLAMA_SHAPE, lookup


@dataclass(frozen=True)
class Family:
    """What hp_tool can do for a model family: plan (size it, build its grid) and train (trial engine)."""

    planner: bool
    engine: bool


# The one list of families; config validation, the TrialSpec and the engine read their subsets from it.
FAMILIES = {
    "gpt3": Family(planner=True, engine=True),
    "llama": Family(planner=True, engine=True),
    "t5": Family(planner=False, engine=False),
    "mt5": Family(planner=False, engine=False),
}
PLANNER_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.planner)
ENGINE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.engine)


@dataclass(frozen=True)
class Shape:
    """Transformer shape; kv_heads == heads unless grouped-query attention."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"


def gpt_parameters(num_layers: int, hidden: int, vocab: int, seq: int) -> int:
    """GPT parameter count with ffn = 4h and learned positions (tied input/output embedding)."""
    return 12 * num_layers * hidden**2 + 13 * num_layers * hidden + (vocab + seq) * hidden


def layer_parameters(shape: Shape) -> int:
    """Parameters of one transformer layer."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    kv = shape.num_kv_heads * shape.head_dim
    if shape.family == "llama":  # no biases, RMSNorm, SwiGLU
        return h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    # GPT: biases and two LayerNorms (weight and bias)
    return h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + 2 * h * f + f + h + 4 * h


def embedding_parameters(shape: Shape) -> int:
    """Input embedding parameters (word, plus learned positions for GPT)."""
    positions = 0 if shape.family == "llama" else shape.seq_length
    return (shape.vocab_size + positions) * shape.hidden_size


def head_parameters(shape: Shape) -> int:
    """Final norm plus output projection (GPT ties the projection to the word embedding)."""
    h = shape.hidden_size
    if shape.family == "llama":
        return h + shape.vocab_size * h
    return 2 * h


def vocab_parallel_parameters(shape: Shape, tp: int, pp: int) -> tuple[float, float]:
    """(embedding, head) parameters one TP rank holds, as the engine shards them: the [vocab, hidden]
    matrices split over TP (vocab-parallel), learned positions and the final norm whole. GPT ties its head
    to the embedding; with PP > 1 the last stage keeps its own copy of that matrix."""
    vh = shape.vocab_size * shape.hidden_size
    embed = embedding_parameters(shape) - vh + vh / tp
    head = float(head_parameters(shape))
    if shape.family == "llama":
        head += vh / tp - vh
    elif pp > 1:
        head += vh / tp
    return embed, head


def count_parameters(shape: Shape) -> int:
    """Parameter count of the whole model (all stages, unsharded)."""
    return shape.num_layers * layer_parameters(shape) + embedding_parameters(shape) + head_parameters(shape)


def layer_forward_flops_per_token(shape: Shape) -> float:
    """Forward matmul FLOPs of one transformer layer for one token (attention over the full sequence)."""
    h, f, s = shape.hidden_size, shape.ffn_hidden_size, shape.seq_length
    kv = shape.num_kv_heads * shape.head_dim
    qkv = 2 * h * (h + 2 * kv)
    attention = 2 * 2 * s * h  # Q·Kᵀ and scores·V
    out_proj = 2 * h * h
    mlp = (3 if shape.gated_mlp else 2) * 2 * h * f
    return qkv + attention + out_proj + mlp


def model_flops_per_step(shape: Shape, global_batch_size: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), recomputation excluded.

    For GPT with ffn = 4h this equals 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)).
    """
    tokens = global_batch_size * shape.seq_length
    logits = 2 * shape.hidden_size * shape.vocab_size
    return 3.0 * tokens * (shape.num_layers * layer_forward_flops_per_token(shape) + logits)


def recompute_flops_per_step(shape: Shape, global_batch_size: int, recomputed_layers: int) -> float:
    """Extra FLOPs of one step from re-running the forward of ``recomputed_layers`` layers (all stages)."""
    tokens = global_batch_size * shape.seq_length
    return float(tokens * recomputed_layers * layer_forward_flops_per_token(shape))


# ---- GPT-3 shapes from a size (NeMo's layer search) ----

def _layer_candidates() -> Iterator[tuple[list[int], int]]:
    """(layer counts to try, number of 1% margin steps), in NeMo's order of preference."""
    yield [2**p for p in range(1, 10)], 10
    yield list(range(16, 201, 16)), 6
    yield list(range(2, 201, 2)), 6
    yield list(range(5, 201, 5)), 6
    yield list(range(1, 200)), 10


def num_layers_for(size_b: float, parameters: Callable[[int], int], what: str) -> int:
    """First layer count whose ``parameters(layers)`` is within the margin of ``size_b`` billions."""
    target = size_b * 1e9
    for layer_counts, margin_steps in _layer_candidates():
        for step in range(1, margin_steps + 1):
            margin = step / 100
            for layers in layer_counts:
                if abs(parameters(layers) - target) < margin * target:
                    return layers
    raise ValueError(f"no layer count gives {size_b}B parameters for {what}")


def gpt3_num_layers(size_b: float, hidden: int, vocab: int, seq: int) -> int:
    """First layer count whose GPT parameter count is within the margin of ``size_b`` billions."""
    return num_layers_for(size_b, lambda layers: gpt_parameters(layers, hidden, vocab, seq),
                          f"GPT-3 with hidden size {hidden}")


def gpt3_shape(size_b: float, vocab: int, seq: int) -> tuple[Shape, float]:
    """GPT-3 shape and learning rate for a model of ``size_b`` billion parameters."""
    hidden, heads, lr = lookup(GPT3_SHAPE, size_b)
    layers = gpt3_num_layers(size_b, hidden, vocab, seq)
    shape = Shape("gpt3", layers, hidden, heads, heads, 4 * hidden, vocab, seq)
    return shape, lr


# ---- Llama shapes from a size ----

def llama_ffn(hidden: int, multiplier: float, multiple_of: int) -> int:
    """Llama's FFN width (Meta's model code): int(8h/3), times ``multiplier``, rounded up to a multiple of
    ``multiple_of``. Llama-2 7B: 11008; Llama-3 8B (1.3, 256): 14336; Llama-2/3 70B (1.3, 4096): 28672."""
    width = int(multiplier * int(8 * hidden / 3))
    return multiple_of * -(-width // multiple_of)


def llama_shape(size_b: float, vocab: int, seq: int) -> tuple[Shape, float]:
    """Llama shape and learning rate for ``size_b`` billion parameters: width, heads, kv heads and FFN from
    the table for the size (tables.LLAMA_SHAPE), then the layer count that gives the size."""
    hidden, heads, kv, multiplier, multiple_of, lr = lookup(LLAMA_SHAPE, size_b)
    ffn = llama_ffn(hidden, multiplier, multiple_of)

    def parameters(layers: int) -> int:
        return count_parameters(Shape("llama", layers, hidden, heads, kv, ffn, vocab, seq))

    layers = num_layers_for(size_b, parameters, f"Llama with hidden size {hidden}")
    return Shape("llama", layers, hidden, heads, kv, ffn, vocab, seq), lr


def shape_for_size(family: str, size_b: float, vocab: int, seq: int) -> tuple[Shape, float]:
    """The family's shape and learning rate for a model of ``size_b`` billion parameters."""
    return (llama_shape if family == "llama" else gpt3_shape)(size_b, vocab, seq)


def lr_for(family: str, size_b: float) -> float:
    """The family's learning rate for a model of ``size_b`` billion parameters (explicit shapes too)."""
    return lookup(LLAMA_SHAPE, size_b)[5] if family == "llama" else lookup(GPT3_SHAPE, size_b)[2]
