"""GPT-3 (NeMo's auto-configurator sizes): learned positions, pre-LayerNorm with biases, a 4h GeLU MLP, the
output head tied to the word embedding.

Parameter count: P = 12·L·h² + 13·L·h + (V + s)·h. Activations per layer: Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2.
"""

from __future__ import annotations

import math
from typing import Optional

from hp_tool.families.decoder import decoder_layer_flops
from hp_tool.families.registry import Architecture, Family, LayerAt, Matmul, MemoryTerms, Sizing, TimeTerms
from hp_tool.families.shape import Shape, num_layers_for
from hp_tool.tables import Table, lookup, span

REFERENCE_SEQ = 2048  # the GBS table is for this sequence length

# size < bound -> (hidden, heads, lr)
GPT3_SHAPE: Table[tuple[int, int, float]] = [
    (0.25, (768, 12, 6e-4)),
    (0.5, (1024, 16, 3e-4)),
    (1, (1536, 16, 2.5e-4)),
    (2, (2048, 16, 2e-4)),
    (3, (2560, 32, 1.6e-4)),
    (4.5, (3072, 32, 1.4e-4)),
    (8, (4096, 32, 1.2e-4)),
    (15, (5120, 40, 1e-4)),
    (25, (6144, 48, 1e-4)),
    (52, (8192, 64, 8e-5)),
    (105, (10240, 80, 7e-5)),
    (205, (12288, 96, 6e-5)),
    (405, (20480, 128, 5e-5)),
    (805, (20480, 128, 4e-5)),
    (1105, (25600, 160, 3e-5)),
]

# 80 GiB GPUs, seq 2048: size <= bound -> (global batch size, starting TP, starting PP)
GPT3_GBS_TP_PP: Table[tuple[int, int, int]] = [
    (1, (256, 1, 1)),
    (4, (1024, 1, 1)),
    (8, (2048, 2, 1)),
    (13, (2048, 4, 1)),
    (20.6, (2048, 8, 1)),
    (45.6, (2048, 8, 2)),
    (123.6, (2048, 8, 4)),
    (196.6, (2048, 8, 8)),
    (392.2, (2048, 8, 16)),
    (735, (2048, 8, 32)),
    (1100, (2048, 8, 64)),
]

# Candidate grid, 80 GiB, seq 2048: size <= bound -> (TP, PP, MBS, (min, max) of TP*PP)
GPT3_GRID: Table[tuple[list[int], list[int], list[int], tuple[int, int]]] = [
    (1, ([1, 2], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (4, ([1, 2, 4], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (8, ([1, 2, 4], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (13, ([1, 2, 4, 8], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (23, ([1, 2, 4], span(1, 4), [1, 2, 4], (4, 8))),
    (45, ([2, 4, 8], span(1, 4), [1, 2, 4], (8, 32))),
    (95, ([2, 4, 8], span(1, 8), [1, 2, 4, 8], (8, 64))),
    (130, ([2, 4, 8], span(1, 16), [1, 2, 4, 8], (16, 128))),
    (195, ([8], span(4, 16), [1, 2, 4], (32, 256))),
    (395, ([8], span(8, 32), [1, 2, 4], (64, 512))),
    (790, ([8], span(8, 100), [1, 2, 4], (128, 1024))),
    (1100, ([8], span(16, 130), [1, 2, 4], (256, 2048))),
]


def gpt_parameters(num_layers: int, hidden: int, vocab: int, seq: int) -> int:
    """GPT parameter count with ffn = 4h and learned positions (tied input/output embedding)."""
    return 12 * num_layers * hidden**2 + 13 * num_layers * hidden + (vocab + seq) * hidden


def gpt3_num_layers(size_b: float, hidden: int, vocab: int, seq: int) -> int:
    """First layer count whose GPT parameter count is within the margin of ``size_b`` billions."""
    return num_layers_for(size_b, lambda layers: gpt_parameters(layers, hidden, vocab, seq),
                          f"GPT-3 with hidden size {hidden}")


def gpt3_shape(size_b: float, vocab: int, seq: int, decoder_seq: Optional[int] = None) -> tuple[Shape, float]:
    """GPT-3 shape and learning rate for a model of ``size_b`` billion parameters."""
    hidden, heads, lr = lookup(GPT3_SHAPE, size_b)
    layers = gpt3_num_layers(size_b, hidden, vocab, seq)
    return Shape("gpt3", layers, hidden, heads, heads, 4 * hidden, vocab, seq), lr


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """One layer: q/k/v and output projections, the 4h MLP, all with biases, and two LayerNorms."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_dim
    return h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + 2 * h * f + f + h + 4 * h


def activation_bytes_per_layer(seq: int, mbs: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, store_scores: bool = True,
                               bytes_per_value: int = 2, dropout: bool = True) -> float:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022), one micro-batch.

    ``store_scores=False`` drops the 5·a·s/h term: flash attention, or selective recompute.
    ``dropout=False`` drops the dropout masks (2·sbh, and a·s²·b of the 5·a·s/h): the trial engine's
    models run without dropout, so they keep 32·sbh (tests/test_memory_check.py checks it against the trace).
    The paper's numbers are for 16-bit values; ``bytes_per_value=4`` scales them for fp32.
    """
    sbh = seq * mbs * hidden
    scores = (5 if dropout else 2) * heads * seq / hidden if store_scores else 0.0
    replicated = 10 if dropout else 8  # layer-norm inputs 4, projection inputs 4, dropout masks 2
    if sequence_parallel:
        per_value = (replicated + 24 + scores) / tp
    else:
        per_value = replicated + 24 / tp + scores / tp
    return sbh * per_value * bytes_per_value / 2


def layer_matmuls(shape: Shape) -> tuple[Matmul, ...]:
    """A layer's matmuls in forward order (transformers' OPT layer): q, k, v and the attention output, then the
    MLP's fc1 and fc2; with biases, so each runs as addmm."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_dim
    return (Matmul("q_proj", h, h), Matmul("k_proj", h, kv), Matmul("v_proj", h, kv),
            Matmul("out_proj", h, h, "rowwise"), Matmul("fc1", h, f), Matmul("fc2", f, h, "rowwise"))


def _activation_bytes(shape: Shape, at: LayerAt) -> float:
    """The engine's GPT layer: Korthikanti's count without dropout masks."""
    return activation_bytes_per_layer(shape.seq_length, at.mbs, shape.hidden_size, shape.num_attention_heads, at.tp,
                                      at.sequence_parallel, not at.flash, at.bytes_per_value, dropout=False)


FAMILY = Family(
    name="gpt3",
    description="GPT-3 (NeMo's sizes): learned positions, LayerNorm with biases, 4h GeLU MLP, tied head",
    arch=Architecture(
        encoder_decoder=False,
        gated_mlp=False,
        tied_head=True,
        layer_parameters=layer_parameters,
        embedding_parameters=lambda shape: (shape.vocab_size + shape.seq_length) * shape.hidden_size,
        head_parameters=lambda shape: 2 * shape.hidden_size,  # the final LayerNorm; the projection is tied
        layer_forward_flops=decoder_layer_flops,
        layer_matmuls=layer_matmuls,
    ),
    sizing=Sizing(
        shape_for_size=gpt3_shape,
        lr_for=lambda size_b: lookup(GPT3_SHAPE, size_b)[2],
        default_ffn=lambda hidden: 4 * hidden,
        init_std=lambda shape: round(0.64 / math.sqrt(shape.hidden_size), 6),  # NeMo's 0.64/sqrt(h)
        gbs_tp_pp=GPT3_GBS_TP_PP,
        # sequences at seq 2048, halved for each doubling of the sequence length
        global_batch=lambda batch, seq: max(1, int(batch * REFERENCE_SEQ / seq)),
        warmup_ratio=0.0015,  # NeMo's GPT-3 schedule: 0.15% warm-up, 16.6% constant
        constant_ratio=0.166,
        grid_table=lambda shape: GPT3_GRID,
    ),
    memory=MemoryTerms(activation_bytes=_activation_bytes),
    time=TimeTerms(layer_ops=(39, 93, 80), layer_tensors=(8, 16), layer_bytes=((25, 4), (52, 8), (19, 4))),
)
