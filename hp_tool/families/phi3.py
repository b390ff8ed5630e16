"""Phi-3 and Phi-4 (Hugging Face ``model_type`` phi3): Llama's parameters and matmuls with q, k and v fused into one
projection (``qkv_proj``) and the MLP's gate and up into another (``gate_up_proj``), as peft names them; no biases,
untied head. Fine-tuned from its Hugging Face config, never sized from a budget.

The fused outputs are split by views, so what a layer keeps for backward changes where a view holds its fused
buffer alive: SDPA keeps v, a view of the q/k/v output, and with it the whole buffer (q and k are new tensors after
RoPE); the MLP keeps gate and up, the two halves of one buffer, as Llama keeps its two outputs. Phi-3's RoPE
concatenates the rotated part with the rest (partial rotary), which leaves q heads-first in memory; the attention
kernel returns its output in q's layout, so turning it back to tokens-first for o_proj is a copy, and SDPA's output
and o_proj's input are two tensors where Llama's are one. No engine splits
the fused projections over TP ranks (a column split would give a rank parts of q, k and v that are not its heads;
transformers' own plan gathers the outputs again), so TP is refused, and with it sequence parallelism."""


from hp_tool.families import llama
from hp_tool.families.registry import LinearInput, Matmul, layer_term
from hp_tool.families.shape import Shape


def linear_shapes(s: Shape) -> dict[str, tuple[int, int]]:
    """A layer's nn.Linear modules by name -> (in features, out features), in forward order."""
    return {"qkv_proj": (s.hidden_size, s.attention_dim + 2 * s.kv_dim), "o_proj": (s.attention_dim, s.hidden_size),
            "gate_up_proj": (s.hidden_size, 2 * s.ffn_hidden_size), "down_proj": (s.ffn_hidden_size, s.hidden_size)}


LINEAR_INPUTS = (LinearInput(("qkv_proj",)), LinearInput(("o_proj",), held=True), LinearInput(("gate_up_proj",)),
                 LinearInput(("down_proj",)))


def layer_matmuls(shape: Shape) -> tuple[Matmul, ...]:
    """The fused q/k/v, o, the fused gate/up, then down (no TP split: the family refuses TP)."""
    return llama.matmuls(linear_shapes(shape))


def activation_bytes_per_layer(shape: Shape, mbs: int, tp: int = 1, sequence_parallel: bool = False,
                               bytes_per_value: int = 2) -> float:
    """Llama's (``llama_activation_bytes_per_layer``) with v held as the whole q/k/v output, p·sb(q + k) more, and
    the attention output held twice (SDPA's, heads-first, and o_proj's tokens-first copy), p·sbq more; q = heads x
    head dim, k = kv heads x head dim (tests/test_phi3.py checks it against the trace)."""
    s, b, p, q, k = shape.seq_length, mbs, bytes_per_value, shape.attention_dim, shape.kv_dim
    return llama.llama_activation_bytes_per_layer(shape, mbs, tp, sequence_parallel, p) + p * s * b * (2 * q + k) / tp


FAMILY = llama.hf_variant("phi3", "Phi-3 / Phi-4: Llama's layers with fused q/k/v and gate/up projections (from a "
                          "Hugging Face config)", qkv_bias=False).variant(
    activation_bytes=layer_term(activation_bytes_per_layer),
    linear_shapes=linear_shapes,
    linear_inputs=LINEAR_INPUTS,
    layer_matmuls=layer_matmuls,
    sequence_parallel=False,
    no_tensor_parallel="Phi-3's fused qkv_proj and gate_up_proj are not split over TP ranks by either engine (use "
                       "TP 1: ZeRO / FSDP shard the weights instead)",
    layer_ops=(72, 122, 117),
    layer_tensors=(6, 6),
    layer_bytes=((127, 10), (308, 26), (121, 10)),
)
