"""The ``Family`` record: everything hp_tool knows about a model family, as data and pure functions, and
the registry the rest of the code looks families up in. Pure, no torch.

A family is one file in this folder that builds its record (``gpt3.py``, ``llama.py``, ``t5.py`` with mT5);
``hp_tool/families/__init__.py`` registers them. The planner, the estimates, the base config and the
TrialSpec ask the record instead of comparing family names; the trial engine's torch half of a family
lives in ``hp_tool/trial/families/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from hp_tool.registry import Registry
from hp_tool.tables import Table
from hp_tool.vocab import ENGINES

# "Shape" in the annotations below is hp_tool/families/shape.py's, which reads this registry: named, not imported,
# so the two modules do not import each other


@dataclass(frozen=True)
class Matmul:
    """One matmul of a layer's forward, per token: an nn.Linear's ``inputs`` x ``outputs`` weight, and how
    tensor parallelism splits it: ``colwise`` (its output features over the TP ranks), ``rowwise`` (its input
    features; each rank's output is a whole-width partial sum until the all-reduce or reduce-scatter) or
    ``whole`` (every TP rank runs it all, as a mixture of experts' router and shared expert)."""

    name: str
    inputs: int
    outputs: int
    split: str = "colwise"


@dataclass(frozen=True)
class LinearInput:
    """A tensor a layer's nn.Linear modules read: the modules reading it (Llama's q, k and v read the norm's
    output), and whether the layer keeps it for backward whatever trains (``held``: the attention kernel's
    output, which its own backward reads) rather than only for those modules' weight gradients. With the
    base frozen, what an adapter method keeps of each (hp_tool/families/methods.py)."""

    readers: tuple[str, ...]
    held: bool = False


@dataclass(frozen=True)
class Family:
    """One model family's facts. Counts are per token or per sample as each field says; bytes are bytes."""

    name: str
    description: str
    # -- architecture --
    encoder_decoder: bool  # two stacks: num_layers per stack, an encoder and a decoder length
    gated_mlp: bool  # SwiGLU / gated GeLU: three FFN matrices instead of two
    tied_head: bool  # the output projection is the input embedding's matrix
    # -- shapes and training defaults --
    shape_for_size: Callable[[float, int, int, Optional[int]], "tuple[Shape, float]"]  # (size_b, vocab, seq, decoder seq) -> (shape, lr)
    lr_for: Callable[[float], float]  # learning rate for a size in billions (explicit shapes too)
    default_ffn: Callable[[int], int]  # FFN width of an explicit shape without one, from the hidden size
    init_std: Callable[["Shape"], float]  # weight initialisation std
    # -- parameter, FLOP and activation counts --
    layer_parameters: Callable[["Shape", bool], int]  # one layer (of the encoder stack when True)
    embedding_parameters: Callable[["Shape"], int]  # input side: word (and position) tables
    head_parameters: Callable[["Shape"], int]  # final norms and an untied output projection
    layer_forward_flops: Callable[["Shape", bool], float]  # one layer's forward matmul FLOPs per sample
    # (shape, micro-batch, TP, sequence parallel, bytes per value, flash attention, encoder layer) -> bytes
    # one layer keeps for backward, one micro-batch
    activation_bytes: Callable[["Shape", int, int, bool, int, bool, bool], float]
    # -- batch, schedule and grid tables (NeMo's where it has them) --
    gbs_tp_pp: Table  # size <= bound -> (table batch, starting TP, starting PP) for the base config
    global_batch: Callable[[int, int], int]  # (the table's batch, sequence length) -> sequences per step
    warmup_ratio: float  # warm-up steps as a fraction of the run's
    constant_ratio: float  # constant-LR steps as a fraction of the run's
    grid_table: Callable[["Shape"], Table]  # size <= bound -> (TP, PP, MBS, (min, max) of TP*PP)
    # -- what hp_tool runs for it --
    size_factors: tuple[float, float] = (1.0, 1.0)  # (size for the budget, days per parameter) factors
    default_kv_channels: Optional[int] = None  # per-head width of an explicit shape without one
    default_decoder_seq: Optional[int] = None  # decoder length when train_settings gives none
    engines: tuple[str, ...] = ENGINES  # trial engines that train it
    engines_note: str = ""  # why the others do not
    inference: bool = True  # the inference search covers it
    planner: bool = True  # sized and searched from a budget
    # a Hugging Face ``model_type`` hp_tool reads (hp_tool/hf_config.py): the transformers config -> whether
    # q, k and v carry biases; None: not read from a Hugging Face config
    hf_qkv_bias: Optional[Callable[[Any], bool]] = None
    hf_unmodelled: tuple[str, ...] = ()  # config.json flags that, when true, describe layers hp_tool does not model
    # a layer's linear modules by name -> (in features, out features): what LoRA adapts; None: no adapters
    linear_shapes: Optional[Callable[["Shape"], dict[str, tuple[int, int]]]] = None
    # the tensors those modules read, each once (what the activation formula keeps for their weights' gradients):
    # what LoRA's frozen base frees and its dropout copies; () with no adapters
    linear_inputs: tuple[LinearInput, ...] = ()
    # (shape, micro-batch, TP, sequence parallel, bytes per value) -> what the last stage keeps beyond its layers
    # (final norm, head input, shared position tables); None: not modelled for the family
    head_activation_bytes: Optional[Callable[["Shape", int, int, bool, int], float]] = None
    # (shape, micro-batch, TP, sequence parallel, bytes per value, norm weights frozen) -> what one layer does not keep
    # of ``activation_bytes`` (with an adapter method's ``activation_delta_bytes``) when each of its norms is one fused
    # kernel keeping its input alone (torchtitan's fused_rmsnorm, Transformer Engine's, torch.compile's: no fp32 copy
    # of the input; ``Hardware.fused_norms``, a stack property hp_tool's engines leave off, or the layout's compile);
    # None: not counted
    fused_norm_saving: Optional[Callable[["Shape", int, int, bool, int, bool], float]] = None
    # (shape, micro-batch, TP, sequence parallel, bytes per value) -> what else one layer does not keep under
    # torch.compile (its norms fused as above, and Inductor recomputing in backward the element-wise values it can
    # from those it keeps: SwiGLU's SiLU output); counted on the engine's compiled layer (tests/test_compile.py);
    # None: not counted, the eager bytes (an upper bound) less the fused norms' where counted
    compiled_saving: Optional[Callable[["Shape", int, int, bool, int], float]] = None
    # long context: the torch engine's sequence-parallel plan knows its layers (Llama's module layout), and its
    # ring attention splits its attention over context-parallel ranks (causal, rotary positions)
    sequence_parallel: bool = False
    context_parallel: bool = False
    # why no engine splits the family's layers over TP ranks (Phi-3's fused q/k/v and gate/up projections);
    # None: they do
    no_tensor_parallel: Optional[str] = None
    # the trial runs the config's sliding attention windows (masks per layer: Gemma); False: a sequence beyond
    # the config's sliding_window is refused, as the trials would run full causal attention (Mistral)
    runs_windows: bool = False
    softcapped_logits: bool = False  # the final logits pass through c·tanh(logits / c) before the loss (Gemma-2)
    # (shape, micro-batch, TP, bytes per value) -> what one layer's backward allocates beyond what the layer saved, at
    # its peak (eager attention's gradient of the scores: Gemma-2); 0 where the kernels' own workspace is all
    backward_transient_bytes: Callable[["Shape", int, int, int], float] = lambda shape, mbs, tp, p: 0.0
    moe: bool = False  # a mixture of experts (hp_tool/families/moe.py): Shape.num_experts routed experts per layer
    # one layer's routed experts' parameters (what expert parallelism splits; a token runs top_k of the
    # num_experts, hp_tool/families/decoder.py); 0 for a dense family
    expert_parameters: Callable[["Shape"], int] = lambda shape: 0
    # (shape, micro-batch, EP, bytes per value, TP) -> what splitting the experts over EP ranks changes in one
    # layer's saved activations (the busiest rank's routed tokens, the TP rank's slice, the dispatch buffers)
    expert_parallel_activation_bytes: Callable[["Shape", int, int, int, int], float] = \
        lambda shape, mbs, ep, p, tp: 0.0
    # selective checkpointing: a layer's nn.Linear matmuls (aten mm / addmm) in the order its forward runs them,
    # the matmuls the per-op policy counts to save every second output of; the family's attention is one SDPA
    # kernel, whose output the policy saves too (hp_tool/trial/selective_checkpoint.py). None: not modelled,
    # and selective checkpointing refused (hp_tool/sharding.py checkpoint_mode_problem)
    layer_matmuls: Optional[Callable[["Shape"], tuple[Matmul, ...]]] = None
    # (forward, backward, recompute) aten operators one layer dispatches for one micro-batch in full training, each
    # a host launch in an eager step (hp_tool/estimate/host.py); recompute: what a checkpointed layer's backward
    # adds (its forward again and the checkpoint's bookkeeping). Counted on the trial engine's own modules by
    # benchmarks/host_overhead.py, checked by tests/test_host_overhead.py; a T5 layer is the mean of its stacks'.
    # The default is Llama's layer (and its variants': Mistral, Qwen2)
    layer_ops: tuple[int, int, int] = (73, 138, 130)
    # (modules holding parameters, parameter tensors) of one layer, q, k and v biases apart (three tensors more where
    # ``Shape.qkv_bias``): what an engine's per-module and per-parameter hooks run over (hp_tool/estimate/host.py).
    # Counted on the trial engine's own modules by benchmarks/host_overhead.py, checked by
    # tests/test_host_overhead.py; a T5 layer is the mean of its stacks'. The default is Llama's layer
    layer_tensors: tuple[int, int] = (9, 9)
    # ((a, b) per pass: forward, backward, recompute) the bytes per token one layer's element-wise operators (norms
    # and their fp32 casts, rotary embeddings, activations, residual adds; not the matmuls or attention) read and
    # write in bf16, a x hidden + b x ffn (a mixture of experts: ffn x top_k): GPU memory traffic an eager layer
    # runs apart from its matmuls (hp_tool/estimate/speed.py ``elementwise_s``). Counted on the trial engine's own
    # modules by benchmarks/elementwise_bytes.py, checked by tests/test_elementwise_bytes.py; a T5 layer is the
    # mean of its stacks'. The default is Llama's layer
    layer_bytes: tuple[tuple[float, float], ...] = ((117, 10), (274, 18), (111, 10))


_FAMILIES: Registry[Family] = Registry("model family")


def register(record: Family) -> Family:
    """Add a family to the registry (once per name)."""
    return _FAMILIES.add(record.name, record)


def family_names(planner_only: bool = False) -> tuple[str, ...]:
    """The registered families' names (those the planner sizes, with ``planner_only``)."""
    return tuple(n for n, f in _FAMILIES.items() if f.planner or not planner_only)


def hf_model_types() -> tuple[str, ...]:
    """The Hugging Face ``model_type`` values hp_tool reads (families with ``hf_qkv_bias``)."""
    return tuple(n for n, f in _FAMILIES.items() if f.hf_qkv_bias is not None)


def family(name: str, key: str = "model.family") -> Family:
    """The record of ``name``; an unknown name is a ConfigError naming ``key``."""
    return _FAMILIES.get(name, key, "unknown model family")
