"""The ``Family`` record: everything hp_tool knows about a model family, as data and pure functions, and
the registry the rest of the code looks families up in. Pure, no torch.

A family is one file in this folder that builds its record (``gpt3.py``, ``llama.py``, ``t5.py`` with mT5);
``hp_tool/families/__init__.py`` registers them. The planner, the estimates, the base config and the
TrialSpec ask the record instead of comparing family names; the trial engine's torch half of a family
lives in ``hp_tool/trial/families/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
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
class LayerAt:
    """Where a family's memory terms are asked: one micro-batch of ``mbs`` sequences on one rank (its shape as
    the rank sees it), TP degree, sequence parallelism, bytes per activation value, flash attention, the encoder
    stack's layer, the EP degree, and whether the norms' weights are frozen (an adapter method)."""

    mbs: int
    tp: int = 1
    sequence_parallel: bool = False
    bytes_per_value: int = 2
    flash: bool = True
    encoder: bool = False
    ep: int = 1
    frozen_norms: bool = False


def _no_bytes(shape: "Shape", at: LayerAt) -> float:
    return 0.0


def layer_term(fn: Callable[..., float]) -> Callable[["Shape", LayerAt], float]:
    """A memory term from a function of (shape, micro-batch, TP, sequence parallel, bytes per value)."""
    return lambda shape, at: fn(shape, at.mbs, at.tp, at.sequence_parallel, at.bytes_per_value)


@dataclass(frozen=True)
class Architecture:
    """What the family's layers are: their structure, and the parameters, FLOPs and linear modules they count."""

    encoder_decoder: bool  # two stacks: num_layers per stack, an encoder and a decoder length
    gated_mlp: bool  # SwiGLU / gated GeLU: three FFN matrices instead of two
    tied_head: bool  # the output projection is the input embedding's matrix
    layer_parameters: Callable[..., int]  # (shape, encoder=False) -> one layer's (of the encoder stack when True)
    embedding_parameters: Callable[["Shape"], int]  # input side: word (and position) tables
    head_parameters: Callable[["Shape"], int]  # final norms and an untied output projection
    layer_forward_flops: Callable[..., float]  # (shape, encoder=False) -> one layer's forward matmul FLOPs per sample
    moe: bool = False  # a mixture of experts (hp_tool/families/moe.py): Shape.num_experts routed experts per layer
    # one layer's routed experts' parameters (what expert parallelism splits; a token runs top_k of the
    # num_experts, hp_tool/families/decoder.py); 0 for a dense family
    expert_parameters: Callable[["Shape"], int] = lambda shape: 0
    softcapped_logits: bool = False  # the final logits pass through c·tanh(logits / c) before the loss (Gemma-2)
    # a layer's linear modules by name -> (in features, out features): what LoRA adapts; None: no adapters
    linear_shapes: Optional[Callable[["Shape"], dict[str, tuple[int, int]]]] = None
    # the tensors those modules read, each once (what the activation formula keeps for their weights' gradients):
    # what LoRA's frozen base frees and its dropout copies; () with no adapters
    linear_inputs: tuple[LinearInput, ...] = ()
    # selective checkpointing: a layer's nn.Linear matmuls (aten mm / addmm) in the order its forward runs them,
    # the matmuls the per-op policy counts to save every second output of; the family's attention is one SDPA
    # kernel, whose output the policy saves too (hp_tool/trial/selective_checkpoint.py). None: not modelled,
    # and selective checkpointing refused (hp_tool/sharding.py checkpoint_mode_problem)
    layer_matmuls: Optional[Callable[["Shape"], tuple[Matmul, ...]]] = None


@dataclass(frozen=True)
class Sizing:
    """How the planner sizes a model from a budget and trains it: shapes, learning rates, NeMo's batch, schedule
    and grid tables where it has them."""

    shape_for_size: Callable[..., "tuple[Shape, float]"]  # (size_b, vocab, seq, decoder_seq) -> (shape, lr)
    lr_for: Callable[[float], float]  # learning rate for a size in billions (explicit shapes too)
    default_ffn: Callable[[int], int]  # FFN width of an explicit shape without one, from the hidden size
    init_std: Callable[["Shape"], float]  # weight initialisation std
    gbs_tp_pp: Table  # size <= bound -> (table batch, starting TP, starting PP) for the base config
    global_batch: Callable[[int, int], int]  # (the table's batch, sequence length) -> sequences per step
    warmup_ratio: float  # warm-up steps as a fraction of the run's
    constant_ratio: float  # constant-LR steps as a fraction of the run's
    grid_table: Callable[["Shape"], Table]  # size <= bound -> (TP, PP, MBS, (min, max) of TP*PP)
    size_factors: tuple[float, float] = (1.0, 1.0)  # (size for the budget, days per parameter) factors
    default_kv_channels: Optional[int] = None  # per-head width of an explicit shape without one
    default_decoder_seq: Optional[int] = None  # decoder length when train_settings gives none
    planner: bool = True  # sized and searched from a budget


@dataclass(frozen=True)
class MemoryTerms:
    """What one layer keeps on the GPU, each term ``(shape, at: LayerAt) -> bytes`` for one micro-batch on one rank
    (``shape`` as the rank sees it)."""

    # what one layer keeps for backward
    activation_bytes: Callable[["Shape", LayerAt], float]
    # what the last stage keeps beyond its layers (final norm, head input, shared position tables); None: not
    # modelled for the family
    head_activation_bytes: Optional[Callable[["Shape", LayerAt], float]] = None
    # what one layer does not keep of ``activation_bytes`` (with an adapter method's ``activation_delta_bytes``) when
    # each of its norms is one fused kernel keeping its input alone (torchtitan's fused_rmsnorm, Transformer
    # Engine's, torch.compile's: no fp32 copy of the input; ``Hardware.fused_norms``, a stack property hp_tool's
    # engines leave off, or the layout's compile); None: not counted
    fused_norm_saving: Optional[Callable[["Shape", LayerAt], float]] = None
    # what else one layer does not keep under torch.compile (its norms fused as above, and Inductor recomputing in
    # backward the element-wise values it can from those it keeps: SwiGLU's SiLU output); counted on the engine's
    # compiled layer (tests/test_compile.py); None: not counted, the eager bytes (an upper bound) less the fused
    # norms' where counted
    compiled_saving: Optional[Callable[["Shape", LayerAt], float]] = None
    # what one layer's backward allocates beyond what the layer saved, at its peak (eager attention's gradient of
    # the scores: Gemma-2); 0 where the kernels' own workspace is all
    backward_transient_bytes: Callable[["Shape", LayerAt], float] = _no_bytes
    # what splitting the experts over EP ranks changes in one layer's saved activations (the busiest rank's routed
    # tokens, the TP rank's slice, the dispatch buffers); 0 for a dense family
    expert_parallel_activation_bytes: Callable[["Shape", LayerAt], float] = _no_bytes


@dataclass(frozen=True)
class TimeTerms:
    """What one layer costs a step beyond its matmuls, counted on the trial engine's own modules."""

    # (forward, backward, recompute) aten operators one layer dispatches for one micro-batch in full training, each
    # a host launch in an eager step (hp_tool/estimate/host.py); recompute: what a checkpointed layer's backward
    # adds (its forward again and the checkpoint's bookkeeping). Counted by benchmarks/host_overhead.py, checked
    # by tests/test_host_overhead.py; a T5 layer is the mean of its stacks'. The default is Llama's layer (and its
    # variants': Mistral, Qwen2)
    layer_ops: tuple[int, int, int] = (73, 138, 130)
    # (modules holding parameters, parameter tensors) of one layer, q, k and v biases apart (three tensors more where
    # ``Shape.qkv_bias``): what an engine's per-module and per-parameter hooks run over (hp_tool/estimate/host.py).
    # Counted by benchmarks/host_overhead.py, checked by tests/test_host_overhead.py; the default is Llama's layer
    layer_tensors: tuple[int, int] = (9, 9)
    # ((a, b) per pass: forward, backward, recompute) the bytes per token one layer's element-wise operators (norms
    # and their fp32 casts, rotary embeddings, activations, residual adds; not the matmuls or attention) read and
    # write in bf16, a x hidden + b x ffn (a mixture of experts: ffn x top_k): GPU memory traffic an eager layer
    # runs apart from its matmuls (hp_tool/estimate/speed.py ``elementwise_s``). Counted by
    # benchmarks/elementwise_bytes.py, checked by tests/test_elementwise_bytes.py; the default is Llama's layer
    layer_bytes: tuple[tuple[float, float], ...] = ((117, 10), (274, 18), (111, 10))


@dataclass(frozen=True)
class TrialHooks:
    """What hp_tool's engines run for the family and how a Hugging Face config of it is read."""

    engines: tuple[str, ...] = ENGINES  # trial engines that train it
    engines_note: str = ""  # why the others do not
    inference: bool = True  # the inference search covers it
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
    # a Hugging Face ``model_type`` hp_tool reads (hp_tool/hf_config.py): the transformers config -> whether
    # q, k and v carry biases; None: not read from a Hugging Face config
    hf_qkv_bias: Optional[Callable[[Any], bool]] = None
    hf_unmodelled: tuple[str, ...] = ()  # config.json flags that, when true, describe layers hp_tool does not model


GROUPS = {"arch": Architecture, "sizing": Sizing, "memory": MemoryTerms, "time": TimeTerms, "trial": TrialHooks}
GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}  # a group's field -> the group


@dataclass(frozen=True)
class Family:
    """One model family's facts, grouped: its layers (``arch``), how it is sized and trained from a budget
    (``sizing``), what a layer keeps on the GPU (``memory``) and costs beyond its matmuls (``time``), and what
    the trial engines run for it (``trial``). Counts are per token or per sample as each field says; bytes are
    bytes."""

    name: str
    description: str
    arch: Architecture
    sizing: Sizing
    memory: MemoryTerms
    time: TimeTerms = TimeTerms()
    trial: TrialHooks = TrialHooks()

    def variant(self, **changes: Any) -> "Family":
        """This family with ``changes`` made, each field by its name (``name``, ``description`` or a group's
        field) given to the group that holds it: a variant of a family is the fields it changes."""
        unknown = set(changes) - GROUP_OF.keys() - {"name", "description"}
        if unknown:
            raise TypeError(f"not a Family field: {sorted(unknown)}")
        grouped: dict[str, dict[str, Any]] = {}
        for k, v in changes.items():
            grouped.setdefault(GROUP_OF.get(k, ""), {})[k] = v
        top = grouped.pop("", {})
        return dataclasses.replace(self, **top, **{g: dataclasses.replace(getattr(self, g), **kw)
                                                   for g, kw in grouped.items()})


_FAMILIES: Registry[Family] = Registry("model family")


def register(record: Family) -> Family:
    """Add a family to the registry (once per name)."""
    return _FAMILIES.add(record.name, record)


def family_names(planner_only: bool = False) -> tuple[str, ...]:
    """The registered families' names (those the planner sizes, with ``planner_only``)."""
    return tuple(n for n, f in _FAMILIES.items() if f.sizing.planner or not planner_only)


def hf_model_types() -> tuple[str, ...]:
    """The Hugging Face ``model_type`` values hp_tool reads (families with ``hf_qkv_bias``)."""
    return tuple(n for n, f in _FAMILIES.items() if f.trial.hf_qkv_bias is not None)


def family(name: str, key: str = "model.family") -> Family:
    """The record of ``name``; an unknown name is a ConfigError naming ``key``."""
    return _FAMILIES.get(name, key, "unknown model family")
