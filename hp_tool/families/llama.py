"""Llama-style models: grouped-query attention, SwiGLU, RMSNorm, RoPE, no biases, untied embeddings.

Shapes for sizes without a published one come from Meta's released configs; the batch is Llama 2's 4M
tokens; the grid extends NeMo's GPT tables by sequence length.
"""

from __future__ import annotations

from typing import Optional

from hp_tool.families.decoder import decoder_layer_flops, decoder_parameters
from hp_tool.families.registry import (Architecture, Family, LinearInput, Matmul, MemoryTerms, Sizing, TrialHooks,
                                       layer_term)
from hp_tool.families.shape import Shape, num_layers_for
from hp_tool.tables import Table, lookup, span

# Shape for a size without a published one: size < bound -> (hidden, heads, kv heads, FFN multiplier,
# FFN multiple_of, lr). Sources: Meta's released configs (params.json: dim, n_heads, n_kv_heads,
# ffn_dim_multiplier, multiple_of) of Llama 3.2 1B/3B, Llama 3 8B/70B, Llama 3.1 405B, Llama-2 13B's width
# and Llama-1 33B's width with grouped-query attention; learning rates from the Llama 2 paper (Table 1:
# 3e-4 up to 13B, 1.5e-4 for 34B and 70B) and Llama 3.1 405B (8e-5).
LLAMA_SHAPE: Table[tuple[int, int, int, float, int, float]] = [
    (1.5, (2048, 32, 8, 1.5, 256, 3e-4)),
    (4.5, (3072, 24, 8, 1.0, 256, 3e-4)),
    (10, (4096, 32, 8, 1.3, 256, 3e-4)),
    (20, (5120, 40, 8, 1.0, 256, 3e-4)),
    (45, (6656, 52, 4, 1.0, 256, 1.5e-4)),
    (150, (8192, 64, 8, 1.3, 4096, 1.5e-4)),
    (500, (16384, 128, 8, 1.2, 4096, 8e-5)),
]

# Training batch and the base layout: size <= bound -> (tokens per global batch, TP, PP).
# Llama 2 trained every size on 4M-token batches (paper, section 2.2); smaller models take fewer tokens.
LLAMA_GBS_TP_PP: Table[tuple[int, int, int]] = [
    (1.5, (2**20, 1, 1)),
    (4.5, (2**21, 1, 1)),
    (10, (2**22, 2, 1)),
    (20, (2**22, 4, 1)),
    (45, (2**22, 8, 2)),
    (150, (2**22, 8, 4)),
    (500, (2**24, 8, 16)),
]

# Candidate grid, 80 GiB, by sequence length: size <= bound -> (TP, PP, MBS, (min, max) of TP*PP).
# Rows up to 95B (seq 4096) and 45B (seq 8192) are NeMo's GPT tables for those lengths (REFERENCE 9);
# NeMo stops there and falls back to TP<=8, PP=1 with no memory check, which proposes TP1 PP1 for a 70B
# at seq 8192. The last rows extend them to deeper pipelines; the memory model prunes what cannot fit.
LLAMA_GRID = {
    4096: [
        (4, ([1, 2, 4], [1], [1, 2, 4, 8], (1, 8))),
        (8, ([1, 2, 4], span(1, 2), [1, 2, 4], (1, 8))),
        (13, ([2, 4], span(1, 2), [1, 2, 4], (2, 8))),
        (23, ([4, 8], span(1, 2), [1, 2], (4, 16))),
        (45, ([4, 8], span(2, 4), [1, 2], (8, 32))),
        (95, ([4, 8], span(1, 8), [1, 2], (8, 64))),
        (500, ([8], span(4, 32), [1, 2], (32, 256))),
    ],
    8192: [
        (1, ([1, 2], span(1, 2), [1, 2, 4], (1, 8))),
        (4, ([1, 2, 4], span(1, 2), [1, 2, 4], (1, 8))),
        (13, ([2, 4], span(1, 2), [1, 2], (2, 8))),
        (23, ([4, 8], span(1, 4), [1], (8, 32))),
        (45, ([4, 8], span(4, 8), [1], (32, 64))),
        (500, ([8], span(4, 16), [1], (32, 128))),
    ],
}


def llama_ffn(hidden: int, multiplier: float, multiple_of: int) -> int:
    """Llama's FFN width (Meta's model code): int(8h/3), times ``multiplier``, rounded up to a multiple of
    ``multiple_of``. Llama-2 7B: 11008; Llama-3 8B (1.3, 256): 14336; Llama-2/3 70B (1.3, 4096): 28672."""
    width = int(multiplier * int(8 * hidden / 3))
    return multiple_of * -(-width // multiple_of)


def llama_shape(size_b: float, vocab: int, seq: int, decoder_seq: Optional[int] = None) -> tuple[Shape, float]:
    """Llama shape and learning rate for ``size_b`` billion parameters: width, heads, kv heads and FFN from
    the table for the size (LLAMA_SHAPE), then the layer count that gives the size."""
    hidden, heads, kv, multiplier, multiple_of, lr = lookup(LLAMA_SHAPE, size_b)
    ffn = llama_ffn(hidden, multiplier, multiple_of)

    def parameters(layers: int) -> int:
        return decoder_parameters(Shape("llama", layers, hidden, heads, kv, ffn, vocab, seq))

    layers = num_layers_for(size_b, parameters, f"Llama with hidden size {hidden}")
    return Shape("llama", layers, hidden, heads, kv, ffn, vocab, seq), lr


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """One layer: q (h·a, a = heads x head dim, h unless the head dim is set apart), k and v (h·kv each),
    o (a·h), three SwiGLU matrices, two RMSNorm weights; biases on q, k and v only where the model has
    them (Qwen2: a + 2·kv)."""
    h, f, a, k = shape.hidden_size, shape.ffn_hidden_size, shape.attention_dim, shape.kv_dim
    bias = a + 2 * k if shape.qkv_bias else 0
    return h * (a + 2 * k) + a * h + 3 * h * f + 2 * h + bias


def llama_activation_bytes_per_layer(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                                     bytes_per_value: int = 2) -> float:
    """Bytes one Llama layer (RMSNorm, GQA with RoPE, SwiGLU) keeps for backward, one micro-batch.

    Derived tensor by tensor as Korthikanti et al. do for GPT, for the engine's modules (transformers'
    LlamaDecoderLayer, SDPA flash/efficient attention, no dropout, no biases). s = sequence, b = micro-batch,
    h = hidden, q = heads x head dim (h unless the config sets the head dim apart), k = kv heads x head dim,
    f = FFN width, a = heads, p = bytes per value (2 for bf16):

      attention RMSNorm: its input upcast to fp32 (LlamaRMSNorm computes in fp32), the
      normalised value cast back                                                        (4 + p)·sbh
      q, k, v projections: their input (the norm's output)                             p·sbh
      RoPE: nothing (cos/sin are shared buffers); q and k after RoPE are SDPA's inputs
      SDPA: q, k, v and its output (also o_proj's input), fp32 log-sum-exp per head    p·(2sbq + 2sbk) + 4·abs
      MLP RMSNorm: as the attention's                                                  (4 + p)·sbh
      gate and up projections: their input                                             p·sbh
      SiLU(gate) * up: gate output, up output, SiLU output, product (down's input)     4p·sbf

    Under TP the projections' outputs and the attention are split over heads (divide by TP); the norms are whole
    on every TP rank unless sequence parallelism splits them along s, while the projections' inputs are whole
    either way (SP gathers them before the projection, which keeps the gathered copy). Attention scores are
    never stored (flash kernels); the residual adds keep nothing.
    """
    s, b, h, f, a = shape.seq_length, mbs, shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads
    q, k = shape.attention_dim, shape.kv_dim
    p = bytes_per_value
    sp = tp if sequence_parallel else 1
    norms = 2 * (4 + p) * s * b * h / sp + 2 * p * s * b * h  # the two norms, the inputs of q/k/v and gate/up
    attention = (p * (2 * s * b * q + 2 * s * b * k) + 4 * a * b * s) / tp
    mlp = 4 * p * s * b * f / tp
    return norms + attention + mlp


def llama_fused_norm_saving(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                            bytes_per_value: int = 2, frozen: bool = False) -> float:
    """What a Llama layer does not keep when each RMSNorm is one fused kernel that keeps its input (the residual
    stream, p·sbh) and a per-row fp32 scale, two norms a layer (split along s by sequence parallelism): the eager
    norm keeps the fp32 upcast of its input (4·sbh) and, when its weight trains, the normalised value (p·sbh, which an
    adapter method's frozen norms do not keep: ``methods.activation_delta_bytes``). Counted: compiled (Inductor's
    fused norm, torchtitan's Triton fused_rmsnorm alike), a Llama layer on CPU keeps 8 bytes a token per hidden unit
    fewer in its norms in full training, 4 with LoRA (tests/test_compile.py)."""
    sp = tp if sequence_parallel else 1
    eager = 4 + (0 if frozen else bytes_per_value)
    return 2 * (eager - bytes_per_value) * shape.seq_length * mbs * shape.hidden_size / sp


def llama_compiled_saving(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                          bytes_per_value: int = 2) -> float:
    """What a Llama layer under torch.compile keeps less beyond its fused norms (``llama_fused_norm_saving``): of
    the SwiGLU's four saved products (gate, up, SiLU(gate), their product), Inductor recomputes SiLU(gate) from the
    gate's output in backward, p·sbf split over TP. Counted: a compiled Llama layer on CPU keeps 8 bytes a token
    per hidden unit and 2 per FFN unit fewer than the eager one (tests/test_compile.py)."""
    return bytes_per_value * shape.seq_length * mbs * shape.ffn_hidden_size / tp


def llama_head_activation_bytes(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                                bytes_per_value: int = 2) -> float:
    """What the last stage keeps for backward beyond its layers, one micro-batch: the final RMSNorm as a
    layer's ((4 + p)·sbh, on sequence shards with SP), the head's input (p·sbh, whole: SP gathers it; the
    chunked loss keeps the hidden states' gradient instead, counted with the loss), and RoPE's cos and sin
    (2·s·d, shared by the micro-batch). Measured against the trace (tests/test_long_context_memory.py)."""
    s, b, h, p = shape.seq_length, mbs, shape.hidden_size, bytes_per_value
    head_dim = shape.attention_dim // shape.num_attention_heads
    return (4 + p) * s * b * h / (tp if sequence_parallel else 1) + p * s * b * h + 2 * s * head_dim * p


def linear_shapes(s: Shape) -> dict[str, tuple[int, int]]:
    """A layer's nn.Linear modules by name -> (in features, out features), in the order its forward runs them."""
    return {"q_proj": (s.hidden_size, s.attention_dim), "k_proj": (s.hidden_size, s.kv_dim),
            "v_proj": (s.hidden_size, s.kv_dim), "o_proj": (s.attention_dim, s.hidden_size),
            "gate_proj": (s.hidden_size, s.ffn_hidden_size), "up_proj": (s.hidden_size, s.ffn_hidden_size),
            "down_proj": (s.ffn_hidden_size, s.hidden_size)}


# what a layer's linears read: q, k and v the attention norm's output; o the attention's output (SDPA keeps it for
# its backward); gate and up the MLP norm's output; down SiLU(gate) * up
LINEAR_INPUTS = (LinearInput(("q_proj", "k_proj", "v_proj")), LinearInput(("o_proj",), held=True),
                 LinearInput(("gate_proj", "up_proj")), LinearInput(("down_proj",)))

ROWWISE = ("o_proj", "down_proj")  # Megatron's split (hp_tool/trial/families/llama.py LAYER_PLAN): the rest by columns


def matmuls(linears: dict[str, tuple[int, int]]) -> tuple[Matmul, ...]:
    """The matmuls of a layer's linears (name -> (in, out), in forward order), split as Megatron splits Llama's:
    the attention output and the MLP's down projection by rows, the rest by columns."""
    return tuple(Matmul(name, i, o, "rowwise" if name in ROWWISE else "colwise") for name, (i, o) in linears.items())


def layer_matmuls(shape: Shape) -> tuple[Matmul, ...]:
    """A layer's matmuls in forward order: q, k, v, o, then the MLP's gate, up and down."""
    return matmuls(linear_shapes(shape))


def grid_table(shape: Shape) -> Table:
    """The grid for the shortest tabled sequence length at least the model's (the longest one beyond)."""
    lengths = sorted(LLAMA_GRID)
    return LLAMA_GRID[next((n for n in lengths if n >= shape.seq_length), lengths[-1])]


FAMILY = Family(
    name="llama",
    description="Llama-style: grouped-query attention, SwiGLU, RMSNorm, RoPE, untied embeddings",
    arch=Architecture(
        encoder_decoder=False,
        gated_mlp=True,
        tied_head=False,
        layer_parameters=layer_parameters,
        embedding_parameters=lambda shape: shape.vocab_size * shape.hidden_size,
        # final norm + lm_head (none of its own when a Hugging Face config ties it to the embedding)
        head_parameters=lambda shape: shape.hidden_size + (0 if shape.tied_head else shape.vocab_size * shape.hidden_size),
        layer_forward_flops=decoder_layer_flops,
        linear_shapes=linear_shapes,
        linear_inputs=LINEAR_INPUTS,
        layer_matmuls=layer_matmuls,
    ),
    sizing=Sizing(
        shape_for_size=llama_shape,
        lr_for=lambda size_b: lookup(LLAMA_SHAPE, size_b)[5],
        default_ffn=lambda hidden: llama_ffn(hidden, 1.0, 256),
        init_std=lambda shape: 0.02,  # Meta's and transformers' default
        gbs_tp_pp=LLAMA_GBS_TP_PP,
        global_batch=lambda tokens, seq: max(1, tokens // seq),  # the table's tokens per batch
        warmup_ratio=0.0015,
        constant_ratio=0.166,
        grid_table=grid_table,
    ),
    memory=MemoryTerms(
        activation_bytes=layer_term(llama_activation_bytes_per_layer),
        head_activation_bytes=layer_term(llama_head_activation_bytes),
        fused_norm_saving=lambda shape, at: llama_fused_norm_saving(shape, at.mbs, at.tp, at.sequence_parallel,
                                                                    at.bytes_per_value, at.frozen_norms),
        compiled_saving=layer_term(llama_compiled_saving),
    ),
    trial=TrialHooks(
        sequence_parallel=True,
        context_parallel=True,
        # transformers' Llama: attention_bias puts biases on q, k, v and o, mlp_bias on the MLP; no published
        # Llama has them, and hp_tool/hf_config.py refuses a config that sets them
        hf_qkv_bias=lambda config: False,
        hf_unmodelled=("attention_bias", "mlp_bias"),
    ),
)


def hf_variant(name: str, description: str, qkv_bias: bool) -> Family:
    """A model with Llama's layers that hp_tool reads from its Hugging Face config only (never sized from a
    budget): Llama's record under another ``model_type``, with or without q, k and v biases."""
    return FAMILY.variant(name=name, description=description, planner=False, hf_unmodelled=(),
                          hf_qkv_bias=lambda config: qkv_bias)
