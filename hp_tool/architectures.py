"""Per-family shapes, parameter counts and FLOP counts. Pure functions, no torch.

Parameter count (GPT): P = 12·L·h² + 13·L·h + (V + s)·h. FLOPs: every matmul of each family counted
per token (Narayanan et al. 2021 for GPT; Llama's grouped-query attention and SwiGLU counted as they are;
T5/mT5's encoder, decoder self- and cross-attention and logits as NeMo counts them, REFERENCE §10).

Encoder-decoder families (T5, mT5): ``num_layers`` is the depth of each stack, ``seq_length`` the encoder's
length and ``decoder_seq_length`` the decoder's. The pipeline splits the 2·L layers: the encoder on the
first PP/2 stages, the decoder on the rest (NeMo's split rank), so PP is 1 or even with PP/2 dividing L.
The model is T5's with a gated-GeLU FFN, relative position buckets in the first layer of each stack, and
the output head tied to the shared input embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from hp_tool.tables import GPT3_SHAPE, LLAMA_SHAPE, MT5_SHAPE, T5_SHAPE, lookup


@dataclass(frozen=True)
class Family:
    """What hp_tool can do for a model family: plan (size it, build its grid) and train (trial engine)."""

    planner: bool
    engine: bool


# The one list of families; config validation, the TrialSpec and the engine read their subsets from it.
FAMILIES = {
    "gpt3": Family(planner=True, engine=True),
    "llama": Family(planner=True, engine=True),
    "t5": Family(planner=True, engine=True),
    "mt5": Family(planner=True, engine=True),
}
ENCODER_DECODER = ("t5", "mt5")
RELATIVE_ATTENTION_BUCKETS = 32  # T5's relative position buckets (one bias per bucket and head)
PLANNER_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.planner)
ENGINE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.engine)


@dataclass(frozen=True)
class Shape:
    """Transformer shape; kv_heads == heads unless grouped-query attention. Encoder-decoder: layers per
    stack, the encoder's sequence length and the decoder's (see the module docstring)."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    kv_channels: Optional[int] = None  # per-head width when it is not hidden / heads (T5: 64)
    decoder_seq_length: Optional[int] = None  # encoder-decoder only: the decoder's (target) length

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_dim(self) -> int:
        """Width of the attention's query (and output projection input): heads x head dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def encoder_decoder(self) -> bool:
        return self.family in ENCODER_DECODER

    @property
    def pipeline_layers(self) -> int:
        """Layers the pipeline splits: both stacks for an encoder-decoder."""
        return 2 * self.num_layers if self.encoder_decoder else self.num_layers

    @property
    def target_length(self) -> int:
        """Tokens per sample the output head and the loss see (the decoder's for an encoder-decoder)."""
        return self.decoder_seq_length if self.encoder_decoder else self.seq_length

    @property
    def gated_mlp(self) -> bool:
        return self.family != "gpt3"


def pipeline_problem(shape: Shape, pp: int) -> Optional[str]:
    """Why ``pp`` pipeline stages cannot split ``shape``, or None. The one rule for the planner, the base
    config and the TrialSpec."""
    if shape.encoder_decoder:
        if pp > 1 and (pp % 2 or shape.num_layers % (pp // 2)):
            return (f"PP={pp} cannot split the encoder and decoder stacks ({shape.num_layers} layers each): "
                    f"the encoder takes the first PP/2 stages and the decoder the rest, so PP is 1 or an even "
                    f"number whose half divides {shape.num_layers}")
        return None
    if shape.num_layers % pp:
        return f"PP={pp} does not divide the {shape.num_layers} layers"
    return None


def interleave_problem(shape: Shape, pp: int, virtual_stages: int, act_ckpt_layers: int,
                       microbatches: int) -> Optional[tuple[str, str]]:
    """(what is at fault: "virtual_stages", "act_ckpt_layers" or "microbatches", why) when interleaved 1F1B
    cannot run ``virtual_stages`` model chunks per pipeline rank, else None. The one rule for the planner
    and the TrialSpec. Chunk k of rank r is virtual stage r + k·PP; each holds layers/(PP·v) layers and
    recomputes act_ckpt_layers/v of them; torch's ScheduleInterleaved1F1B splits the step's micro-batches
    into rounds of about PP and needs the rounds to divide them."""
    v = virtual_stages
    if v < 1:
        return "virtual_stages", f"{v} virtual stages per pipeline rank: at least 1"
    if v == 1:
        return None
    if pp == 1:
        return "virtual_stages", f"{v} virtual stages interleave a pipeline, and PP=1 has none"
    if shape.encoder_decoder:
        return "virtual_stages", (f"interleaved pipelining runs decoder-only models; {shape.family} splits its "
                                  "encoder and decoder over the stages")
    per_stage = shape.pipeline_layers // pp
    if per_stage % v:
        return "virtual_stages", f"{v} virtual stages do not divide the {per_stage} layers per pipeline stage"
    if act_ckpt_layers % v:
        return "act_ckpt_layers", (f"{act_ckpt_layers} checkpointed layers per stage do not split over {v} "
                                   f"virtual stages (each chunk recomputes the same number)")
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return "microbatches", (f"interleaved 1F1B runs {microbatches} micro-batches per step in {rounds} "
                                f"rounds (micro-batches // PP), which must divide them")
    return None


def stage_layer_counts(shape: Shape, pp: int, stage: int) -> tuple[int, int]:
    """(encoder layers, decoder layers) on pipeline ``stage`` of ``pp``; a decoder-only model's layers
    count as decoder layers."""
    per_stage = shape.pipeline_layers // pp
    if not shape.encoder_decoder:
        return 0, per_stage
    first = stage * per_stage
    encoder = max(0, min(first + per_stage, shape.num_layers) - first)
    return encoder, per_stage - encoder


def checkpointed_layer_counts(shape: Shape, pp: int, stage: int, act_ckpt_layers: int) -> tuple[int, int]:
    """(encoder, decoder) layers recomputed on ``stage`` for ``act_ckpt_layers`` per stage: the first ones of
    each stack on it; a stage holding both stacks (PP=1) divides them, the encoder taking the odd one."""
    encoder, decoder = stage_layer_counts(shape, pp, stage)
    if encoder and decoder:
        k_enc = min(encoder, act_ckpt_layers - act_ckpt_layers // 2)
        return k_enc, min(decoder, act_ckpt_layers - k_enc)
    return min(encoder, act_ckpt_layers), min(decoder, act_ckpt_layers)


def gpt_parameters(num_layers: int, hidden: int, vocab: int, seq: int) -> int:
    """GPT parameter count with ffn = 4h and learned positions (tied input/output embedding)."""
    return 12 * num_layers * hidden**2 + 13 * num_layers * hidden + (vocab + seq) * hidden


def t5_nemo_parameters(layers: int, hidden: int, heads: int, kv_channels: int, ffn: int, vocab: int,
                       seq: int) -> float:
    """NeMo's T5/mT5 parameter count for its layer search (REFERENCE §3; L = layers per stack,
    A = heads·kv): 2·L·1.5F + 3·L·A + h·(2 + 4·L·1.5F + L·(21 + 12·A) + s + V)."""
    a = heads * kv_channels
    return (2 * layers * 1.5 * ffn + 3 * layers * a
            + hidden * (2 + 4 * layers * 1.5 * ffn + layers * (21 + 12 * a) + seq + vocab))


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """Parameters of one transformer layer (of the encoder stack when ``encoder``, for T5/mT5)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    kv = shape.num_kv_heads * shape.head_dim
    if shape.encoder_decoder:  # no biases; RMS norms; gated FFN; decoder layers add cross-attention
        attention = 4 * h * shape.attention_dim
        return (attention + 3 * h * f + 2 * h) if encoder else (2 * attention + 3 * h * f + 3 * h)
    if shape.family == "llama":  # no biases, RMSNorm, SwiGLU
        return h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    # GPT: biases and two LayerNorms (weight and bias)
    return h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + 2 * h * f + f + h + 4 * h


def embedding_parameters(shape: Shape) -> int:
    """Input embedding parameters (word, plus learned positions for GPT; T5 counts its encoder's relative
    position table here)."""
    positions = shape.seq_length if shape.family == "gpt3" else 0
    extra = RELATIVE_ATTENTION_BUCKETS * shape.num_attention_heads if shape.encoder_decoder else 0
    return (shape.vocab_size + positions) * shape.hidden_size + extra


def head_parameters(shape: Shape) -> int:
    """Final norm plus output projection (GPT and T5 tie the projection to the word embedding; T5 counts
    both stacks' final norms and its decoder's relative position table here)."""
    h = shape.hidden_size
    if shape.family == "llama":
        return h + shape.vocab_size * h
    if shape.encoder_decoder:
        return 2 * h + RELATIVE_ATTENTION_BUCKETS * shape.num_attention_heads
    return 2 * h


def vocab_parallel_parameters(shape: Shape, tp: int, pp: int) -> tuple[float, float]:
    """(embedding, head) parameters one TP rank holds, as the engine shards them: the [vocab, hidden]
    matrices split over TP (vocab-parallel), learned positions and the final norm whole. GPT and T5 tie
    their head to the embedding; with PP > 1 the last stage keeps its own copy of that matrix."""
    vh = shape.vocab_size * shape.hidden_size
    embed = embedding_parameters(shape) - vh + vh / tp
    head = float(head_parameters(shape))
    if shape.family == "llama":
        head += vh / tp - vh
    elif pp > 1:
        head += vh / tp
    return embed, head


def stage_layer_parameters(shape: Shape, pp: int, stage: int) -> int:
    """Parameters of the transformer layers on pipeline ``stage`` (before tensor parallelism)."""
    encoder, decoder = stage_layer_counts(shape, pp, stage)
    return encoder * layer_parameters(shape, encoder=True) + decoder * layer_parameters(shape)


def count_parameters(shape: Shape) -> int:
    """Parameter count of the whole model (all stages, unsharded)."""
    return stage_layer_parameters(shape, 1, 0) + embedding_parameters(shape) + head_parameters(shape)


def layer_forward_flops_per_sample(shape: Shape, encoder: bool = False) -> float:
    """Forward matmul FLOPs of one transformer layer for one sample (attention over the full sequence).

    Decoder-only: q/k/v (k/v at the key/value heads' width), scores and their product with v, the output
    projection and the (gated) MLP. T5/mT5 (REFERENCE §10 with A = heads·kv for NeMo's h): encoder layer
    8·s_e·h·A + 4·s_e²·A + 6·s_e·h·F; decoder layer the same over s_d plus cross-attention
    4·s_d·h·A + 4·s_e·h·A + 4·s_e·s_d·A."""
    h, f, s = shape.hidden_size, shape.ffn_hidden_size, shape.seq_length
    if shape.encoder_decoder:
        a = shape.attention_dim
        if encoder:
            return 8 * s * h * a + 4 * s * s * a + 6 * s * h * f
        t = shape.decoder_seq_length
        cross = 4 * t * h * a + 4 * s * h * a + 4 * s * t * a
        return 8 * t * h * a + 4 * t * t * a + cross + 6 * t * h * f
    kv = shape.num_kv_heads * shape.head_dim
    qkv = 2 * h * (h + 2 * kv)
    attention = 2 * 2 * s * h  # Q·Kᵀ and scores·V
    out_proj = 2 * h * h
    mlp = (3 if shape.gated_mlp else 2) * 2 * h * f
    return s * (qkv + attention + out_proj + mlp)


def model_flops_per_step(shape: Shape, global_batch_size: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), recomputation excluded.

    For GPT with ffn = 4h this equals 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)).
    """
    layers = shape.num_layers * layer_forward_flops_per_sample(shape)
    if shape.encoder_decoder:
        layers += shape.num_layers * layer_forward_flops_per_sample(shape, encoder=True)
    logits = 2 * shape.target_length * shape.hidden_size * shape.vocab_size
    return 3.0 * global_batch_size * (layers + logits)


def recompute_flops_per_step(shape: Shape, global_batch_size: int, act_ckpt_layers: int, pp: int) -> float:
    """Extra FLOPs of one step from re-running the forward of ``act_ckpt_layers`` layers on each of the
    ``pp`` stages (checkpointed_layer_counts says which)."""
    per_sample = 0.0
    for stage in range(pp):
        k_enc, k_dec = checkpointed_layer_counts(shape, pp, stage, act_ckpt_layers)
        per_sample += k_dec * layer_forward_flops_per_sample(shape)
        if k_enc:
            per_sample += k_enc * layer_forward_flops_per_sample(shape, encoder=True)
    return float(global_batch_size * per_sample)


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


# ---- T5 / mT5 shapes from a size (NeMo's table and layer search) ----

T5_LR = 1e-4  # NeMo's T5/mT5 learning rate at every size


def t5_shape(family: str, size_b: float, vocab: int, seq: int, decoder_seq: int) -> tuple[Shape, float]:
    """T5/mT5 shape for ``size_b`` billion parameters: width, heads, FFN and kv channels from the family's
    table, then the layers per stack whose NeMo parameter count gives the size."""
    hidden, heads, ffn, kv = lookup(MT5_SHAPE if family == "mt5" else T5_SHAPE, size_b)

    def parameters(layers: int) -> float:
        return t5_nemo_parameters(layers, hidden, heads, kv, ffn, vocab, seq)

    layers = num_layers_for(size_b, parameters, f"{family} with hidden size {hidden}")
    return Shape(family, layers, hidden, heads, heads, ffn, vocab, seq, kv, decoder_seq), T5_LR


def shape_for_size(family: str, size_b: float, vocab: int, seq: int,
                   decoder_seq: Optional[int] = None) -> tuple[Shape, float]:
    """The family's shape and learning rate for a model of ``size_b`` billion parameters."""
    if family in ENCODER_DECODER:
        return t5_shape(family, size_b, vocab, seq, decoder_seq)
    return (llama_shape if family == "llama" else gpt3_shape)(size_b, vocab, seq)


def lr_for(family: str, size_b: float) -> float:
    """The family's learning rate for a model of ``size_b`` billion parameters (explicit shapes too)."""
    if family in ENCODER_DECODER:
        return T5_LR
    return lookup(LLAMA_SHAPE, size_b)[5] if family == "llama" else lookup(GPT3_SHAPE, size_b)[2]
