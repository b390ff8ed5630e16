"""Gemma-2 and Gemma-3 (Hugging Face ``model_type`` gemma2, gemma3_text): Llama's projections with four RMSNorms a
layer (before and after the attention and the MLP, each computing ``x * (1 + w)`` in fp32), a GeLU-gated MLP (as
many matrices as SwiGLU), the token embeddings scaled by sqrt(hidden), a tied head, and sliding-window attention on
alternating layers (Gemma-2: every other layer, a 4096-token window; Gemma-3: five of every six, 512-1024 tokens).
Gemma-2 soft-caps the attention scores (``attn_logit_softcapping``) and the final logits; Gemma-3 drops the caps
for per-head q and k norms. Fine-tuned from a Hugging Face config, never sized from a budget.

How the engine runs them (hp_tool/trial/families/gemma.py) decides what is priced:
  - Gemma-2's capped scores cannot go through SDPA, so its layers run transformers' eager attention, which
    keeps the scores' tensors for backward (``eager_attention_bytes``): (2p + 4) bytes per score, plus the
    keys and values repeated to every query head where heads are grouped;
  - the sliding windows are masks on kernels that compute every score (the eager kernel, SDPA with a mask),
    so a sliding layer costs what a full one costs: the FLOPs are Llama's at the whole sequence;
  - the final logits' cap keeps its tanh's output (``Family.arch.softcapped_logits``).
Context parallelism is refused (the ring attention applies neither caps nor windows), and the inference search
does not cover the families.
"""


from hp_tool.families import llama, qwen3
from hp_tool.families.registry import Family, layer_term
from hp_tool.families.shape import Shape


NORM_VALUE_BYTES = 8  # a Gemma norm's fp32 input and fp32 normalised value, per value it normalises


def norm_bytes(shape: Shape, mbs: int, tp: int, sequence_parallel: bool, p: int) -> float:
    """What Gemma's four norms keep beyond Llama's two: each norm's fp32 input and its fp32 normalised value before
    the cast back (8 bytes a value; Llama's keeps 4 + p), over the hidden size, on sequence shards under SP. The
    pre-norms' outputs, the projections' inputs, are Llama's."""
    sb = shape.seq_length * mbs * shape.hidden_size / (tp if sequence_parallel else 1)
    return 2 * (NORM_VALUE_BYTES - (4 + p)) * sb + 2 * NORM_VALUE_BYTES * sb


def eager_attention_bytes(shape: Shape, mbs: int, tp: int, p: int) -> float:
    """What transformers' eager attention keeps beyond SDPA's, one micro-batch (a = the rank's heads): per score
    (a·b·s²) the capped scores' tanh output (p), the fp32 softmax (4) and its cast back to the compute dtype (p;
    none in fp32), no log-sum-exp (4·abs in Llama's formula); and with grouped heads, k and v repeated to every
    query head (each p·sbq, where SDPA keeps k and v at the kv heads' width)."""
    s, b, a = shape.seq_length, mbs, shape.num_attention_heads / tp
    per_score = p + 4 + (p if p != 4 else 0)
    repeated = 2 * p * s * b * (shape.attention_dim - shape.kv_dim) / tp
    return per_score * a * b * s * s - 4 * a * b * s + repeated


def eager_backward_bytes(shape: Shape, mbs: int, tp: int, p: int) -> float:
    """What the eager attention's backward holds beyond the layer's saved tensors at its peak: the softmax's
    gradient in fp32 (4 bytes a score) beside the softmax it reads. The MLP half of the layer has freed its tensors
    by then, and the probabilities' 16-bit copy is freed first, which this leaves out: an upper bound, 4% over the
    traced peak where the layers' backward holds it (a bf16 GPU target and fp32 CPU, tests/test_gemma.py)."""
    return 4 * shape.num_attention_heads / tp * mbs * shape.seq_length ** 2


def qk_norm_bytes(shape: Shape, mbs: int, tp: int) -> float:
    """Gemma-3's per-head q and k norms: ``NORM_VALUE_BYTES`` a value they normalise (``qwen3.qk_values``)."""
    return NORM_VALUE_BYTES * qwen3.qk_values(shape, mbs, tp)


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """Llama's layer with two norms more (hidden each)."""
    return llama.layer_parameters(shape) + 2 * shape.hidden_size


def gemma2_activation_bytes(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False, p: int = 2,
                            flash: bool = True, encoder: bool = False) -> float:
    """Llama's layer with Gemma's norms and the eager attention (``flash`` does not apply: the scores are kept)."""
    return llama.llama_activation_bytes_per_layer(shape, mbs, tp, sequence_parallel, p) + \
        norm_bytes(shape, mbs, tp, sequence_parallel, p) + eager_attention_bytes(shape, mbs, tp, p)


def gemma3_activation_bytes(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False, p: int = 2,
                            flash: bool = True, encoder: bool = False) -> float:
    """Llama's layer with Gemma's norms and the per-head q and k norms (``qk_norm_bytes``)."""
    return llama.llama_activation_bytes_per_layer(shape, mbs, tp, sequence_parallel, p) + \
        norm_bytes(shape, mbs, tp, sequence_parallel, p) + qk_norm_bytes(shape, mbs, tp)


def _variant(name: str, description: str, unmodelled: tuple[str, ...] = (), **facts) -> Family:
    """Llama's record read from a Hugging Face config, tied, with the trial running the config's windows."""
    return llama.hf_variant(name, description, qkv_bias=False).variant(
        tied_head=True,
        context_parallel=False,
        # transformers' attention_bias puts biases on q, k, v and o; no published Gemma has them
        hf_unmodelled=("attention_bias", *unmodelled),
        runs_windows=True,
        # the inference worker's cached decode has neither the eager kernel's masks nor Gemma-3's two RoPE tables
        inference=False,
        # four norms a layer, each keeping fp32 values (NORM_VALUE_BYTES), and eager or soft-capped attention: Llama's
        # fused and compiled savings are not theirs, and theirs are not counted (the eager bytes stand)
        fused_norm_saving=None,
        compiled_saving=None,
        **facts)


GEMMA2 = _variant(
    "gemma2", "Gemma-2: four norms a layer, soft-capped attention (eager kernel) and logits, alternating sliding "
    "windows, scaled tied embeddings (from a Hugging Face config)",
    layer_parameters=layer_parameters, activation_bytes=layer_term(gemma2_activation_bytes), softcapped_logits=True,
    backward_transient_bytes=lambda shape, at: eager_backward_bytes(shape, at.mbs, at.tp, at.bytes_per_value),
    layer_ops=(118, 200, 198),
    layer_tensors=(11, 11),
    layer_bytes=((262, 10), (568, 18), (242, 10)),
    # the eager attention is several kernels, not the one SDPA call selective checkpointing's policy counts on
    layer_matmuls=None)

GEMMA3 = _variant(
    "gemma3_text", "Gemma-3 (text): four norms a layer, per-head q and k norms, alternating sliding windows with a "
    "local RoPE base, scaled tied embeddings (from a Hugging Face config)",
    layer_parameters=lambda shape, encoder=False: layer_parameters(shape) + qwen3.qk_norm_parameters(shape),
    activation_bytes=layer_term(gemma3_activation_bytes),
    layer_ops=(118, 217, 216),
    layer_tensors=(13, 13),
    layer_bytes=((282, 10), (692, 18), (261, 10)),
    # soft-capped scores would need the eager kernel, which the engine runs for Gemma-2 only; no published
    # Gemma-3 caps its scores or logits
    unmodelled=("attn_logit_softcapping", "final_logit_softcapping"))
