"""T5 and mT5 (NeMo's sizes and clusters): encoder-decoder with a gated-GeLU FFN, RMS norms, no biases,
relative position buckets in the first layer of each stack, the output head tied to the shared input
embedding. ``num_layers`` is the depth of each stack, ``seq_length`` the encoder's length and
``decoder_seq_length`` the decoder's. The pipeline splits the 2·L layers: the encoder on the first PP/2
stages, the decoder on the rest (NeMo's split rank). FLOPs: the encoder, the decoder's self- and
cross-attention and the logits as NeMo counts them (REFERENCE §10). mT5 shares T5's tables but for wider
bounds on its first rows (its 250k vocabulary is a larger share of a small model) and is sized smaller for
a budget.
"""

from __future__ import annotations

from typing import Callable, Optional

from hp_tool.families.registry import Architecture, Family, MemoryTerms, Sizing, TimeTerms, TrialHooks
from hp_tool.families.shape import Shape, num_layers_for
from hp_tool.tables import Table, lookup, span

RELATIVE_ATTENTION_BUCKETS = 32  # relative position buckets (one bias per bucket and head)
T5_LR = 1e-4  # NeMo's T5/mT5 learning rate at every size
T5_KV_CHANNELS = 64  # per-head width of an explicit shape without model.kv_channels
T5_INIT_STD = 0.015  # NeMo's init_method_std
T5_WARMUP_RATIO = 0.01  # NeMo's warm-up, a fraction of the run's steps
T5_REFERENCE_SEQ = 512  # the GBS table is for this encoder length
T5_DECODER_SEQ = 128  # decoder length when train_settings.decoder_seq_length is null (NeMo's T5 configs)

# size < bound -> (hidden, heads, FFN, kv channels). NeMo's last two rows use 128 kv channels
# (auto_configurator utils.calculate_model_size_params).
T5_SHAPE: Table[tuple[int, int, int, int]] = [
    (0.1, (512, 6, 1024, 64)),
    (0.4, (768, 12, 2048, 64)),
    (1, (1024, 16, 2816, 64)),
    (5, (2048, 32, 5120, 64)),
    (15, (4096, 64, 10240, 64)),
    (25.9, (5120, 80, 10880, 64)),
    (43, (6144, 96, 10880, 64)),
    (85.5, (6144, 96, 16384, 64)),
    (165.5, (7680, 96, 20480, 128)),
    (250, (12288, 96, 32768, 128)),
]
# mT5: the same rows with wider bounds for the first three (its 250k vocabulary is a larger share).
MT5_SHAPE: Table[tuple[int, int, int, int]] = [(0.25, T5_SHAPE[0][1]), (0.5, T5_SHAPE[1][1]),
                                               (1.2, T5_SHAPE[2][1])] + list(T5_SHAPE[3:])

# 80 GiB GPUs, seq 512: size <= bound -> (global batch size, starting TP, starting PP)
T5_GBS_TP_PP: Table[tuple[int, int, int]] = [
    (1, (2048, 1, 1)),
    (5, (1920, 2, 1)),
    (11.5, (1920, 4, 1)),
    (18.5, (1920, 8, 1)),
    (25.9, (1920, 8, 2)),
    (43, (1920, 8, 4)),
    (85.5, (1920, 8, 8)),
    (165.5, (1920, 8, 16)),
    (250, (1920, 8, 32)),
]

# Candidate grid, 80 GiB, seq 512: size <= bound -> (TP, PP, MBS, (min, max) of TP*PP). PP values are kept
# only where they split both stacks (architectures.pipeline_problem).
T5_GRID: Table[tuple[list[int], list[int], list[int], tuple[int, int]]] = [
    (1, ([1, 2], [1], [16, 32, 64, 128], (1, 8))),
    (4, ([1, 2, 4], [1], [4, 6, 8, 12, 16, 24, 32, 48], (1, 8))),
    (8, ([2, 4, 8], [1], [4, 6, 8, 12, 16, 24, 32], (1, 8))),
    (14.5, ([4, 8], [1], [2, 4, 6, 8, 12, 16, 24], (1, 8))),
    (25.9, ([4, 8], span(1, 2), [1, 2, 4, 6, 8], (4, 16))),
    (43, ([4, 8], span(1, 4), [1, 2, 4, 6, 8], (8, 32))),
    (85.5, ([4, 8], span(2, 8), [1, 2, 4, 6, 8], (16, 64))),
    (165.5, ([8], span(4, 16), [1, 2, 4, 6], (32, 128))),
    (250, ([8], span(4, 32), [1, 2, 4, 6, 8], (64, 256))),
]


def t5_nemo_parameters(layers: int, hidden: int, heads: int, kv_channels: int, ffn: int, vocab: int,
                       seq: int) -> float:
    """NeMo's T5/mT5 parameter count for its layer search (REFERENCE §3; L = layers per stack,
    A = heads·kv): 2·L·1.5F + 3·L·A + h·(2 + 4·L·1.5F + L·(21 + 12·A) + s + V)."""
    a = heads * kv_channels
    return (2 * layers * 1.5 * ffn + 3 * layers * a
            + hidden * (2 + 4 * layers * 1.5 * ffn + layers * (21 + 12 * a) + seq + vocab))


def _shape_for_size(name: str, table: Table) -> Callable[[float, int, int, Optional[int]], tuple[Shape, float]]:
    def shape_for_size(size_b: float, vocab: int, seq: int, decoder_seq: Optional[int]) -> tuple[Shape, float]:
        """Width, heads, FFN and kv channels from the family's table, then the layers per stack whose NeMo
        parameter count gives ``size_b`` billions."""
        hidden, heads, ffn, kv = lookup(table, size_b)

        def parameters(layers: int) -> float:
            return t5_nemo_parameters(layers, hidden, heads, kv, ffn, vocab, seq)

        layers = num_layers_for(size_b, parameters, f"{name} with hidden size {hidden}")
        return Shape(name, layers, hidden, heads, heads, ffn, vocab, seq, kv, decoder_seq), T5_LR
    return shape_for_size


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """One layer: no biases, RMS norms, the gated FFN; a decoder layer adds cross-attention and its norm."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    attention = 4 * h * shape.attention_dim
    return (attention + 3 * h * f + 2 * h) if encoder else (2 * attention + 3 * h * f + 3 * h)


def layer_forward_flops(shape: Shape, encoder: bool = False) -> float:
    """One layer's forward matmul FLOPs per sample (REFERENCE §10 with A = heads·kv for NeMo's h): encoder
    layer 8·s_e·h·A + 4·s_e²·A + 6·s_e·h·F; decoder layer the same over s_d plus cross-attention
    4·s_d·h·A + 4·s_e·h·A + 4·s_e·s_d·A."""
    h, f, s, a = shape.hidden_size, shape.ffn_hidden_size, shape.seq_length, shape.attention_dim
    if encoder:
        return 8 * s * h * a + 4 * s * s * a + 6 * s * h * f
    t = shape.decoder_seq_length
    cross = 4 * t * h * a + 4 * s * h * a + 4 * s * t * a
    return 8 * t * h * a + 4 * t * t * a + cross + 6 * t * h * f


def t5_activation_bytes_per_layer(shape: Shape, mbs: int, encoder: bool, tp: int = 1,
                                  sequence_parallel: bool = False, bytes_per_value: int = 2) -> float:
    """Bytes one T5/mT5 layer keeps for backward, one micro-batch, derived tensor by tensor for the engine's
    modules (transformers' T5Block with eager attention, relative position bias added to the scores,
    tanh-GeLU gated FFN, no dropout). s = the layer's own length (encoder or decoder), e = the encoder's,
    b = micro-batch, h = hidden, A = heads x kv channels, a = heads, f = FFN width, p = bytes per value:

      each RMS norm (T5LayerNorm): fp32 copy of its input, its input (16-bit only: in fp32 the copy
      is the input), the normalised value and its output (the next projections' input)  (4 + 3p)·sbh
      self-attention: q, k, v, the attention output (o's input)                         4p·sbA
      scores: the softmax output in the compute dtype (PV's input)                      p·abs²
      gated FFN: wi_0's output (GeLU input), GeLU output, wi_1's output, product        4p·sbf
      decoder cross-attention (decoder layers only): its norm, q and its output over s,
      k and v over the encoder's e tokens, scores over s x e                            (4 + 3p)·sbh + 2p·sbA
                                                                                        + 2p·ebA + p·abse

    The encoder output that every decoder layer's k/v projection reads is counted once per stage
    (``estimate_memory``). Projections, attention and FFN split over TP; norms are whole on every TP rank
    unless sequence parallelism splits them."""
    p, b, h, f, a = bytes_per_value, mbs, shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads
    big_a = shape.attention_dim
    s = shape.seq_length if encoder else shape.decoder_seq_length
    sp = tp if sequence_parallel else 1
    norm = (4 + 2 * p + (p if p < 4 else 0)) * s * b * h / sp
    self_attention = (4 * p * s * b * big_a + p * a * b * s * s) / tp
    ffn = 4 * p * s * b * f / tp
    total = 2 * norm + self_attention + ffn
    if not encoder:
        e = shape.seq_length
        total += norm + (2 * p * s * b * big_a + 2 * p * e * b * big_a + p * a * b * s * e) / tp
    return total


def _family(name: str, table: Table, size_factors: tuple[float, float], description: str) -> Family:
    buckets = lambda shape: RELATIVE_ATTENTION_BUCKETS * shape.num_attention_heads  # noqa: E731
    return Family(
        name=name,
        description=description,
        arch=Architecture(
            encoder_decoder=True,
            gated_mlp=True,
            tied_head=True,
            layer_parameters=layer_parameters,
            # the encoder's relative position table counts with the embedding
            embedding_parameters=lambda shape: shape.vocab_size * shape.hidden_size + buckets(shape),
            # both stacks' final norms and the decoder's relative position table; the projection is tied
            head_parameters=lambda shape: 2 * shape.hidden_size + buckets(shape),
            layer_forward_flops=layer_forward_flops,
        ),
        sizing=Sizing(
            shape_for_size=_shape_for_size(name, table),
            lr_for=lambda size_b: T5_LR,
            default_ffn=lambda hidden: int(2.5 * hidden),  # NeMo's 2048 -> 5120, 4096 -> 10240
            init_std=lambda shape: T5_INIT_STD,
            gbs_tp_pp=T5_GBS_TP_PP,
            # sequences at encoder length 512, halved for each doubling of the length
            global_batch=lambda batch, seq: max(1, int(batch * T5_REFERENCE_SEQ / seq)),
            warmup_ratio=T5_WARMUP_RATIO,
            constant_ratio=0.0,
            grid_table=lambda shape: T5_GRID,
            size_factors=size_factors,
            default_kv_channels=T5_KV_CHANNELS,
            default_decoder_seq=T5_DECODER_SEQ,
        ),
        memory=MemoryTerms(activation_bytes=lambda shape, at: t5_activation_bytes_per_layer(
            shape, at.mbs, at.encoder, at.tp, at.sequence_parallel, at.bytes_per_value)),
        time=TimeTerms(layer_ops=(98, 178, 174), layer_tensors=(12, 12), layer_bytes=((138, 10), (318, 18), (132, 10))),
        trial=TrialHooks(
            engines=("torch",),
            engines_note=(f"hp_tool trains encoder-decoder models ({name}) on the torch engine only "
                          "(TP, PP over both stacks, FSDP2 for ZeRO 0-3 and offload)"),
            inference=False,
        ),
    )


T5 = _family("t5", T5_SHAPE, (1.0, 1.0), "T5 (NeMo's sizes): encoder-decoder, gated-GeLU FFN, tied head")
# mT5 gets a smaller model for the budget and takes longer per parameter (NeMo's factors)
MT5 = _family("mt5", MT5_SHAPE, (0.87, 1.15), "mT5: T5 with a 250k multilingual vocabulary")
