"""A parallel layout with every rule on whether it can run, and the cluster's hardware: the inputs the
memory and speed models share.

``Layout`` is the one type for a layout: its parallel degrees and its training recipe (hp_tool/recipe.py), each
field read as the layout's own. The planner's candidates wrap one, the TrialSpec holds its fields by name
(``TrialSpec.layout()``), the collector and the inference grid build one. Its validity rules are ``RULES``, one
small named function each with its fix; ``problems()`` is the loop over them, and each ``Problem`` names the Layout
field at fault (each caller maps fields to its own config keys), the rule, the reason and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Optional

from hp_tool.architectures import interleave_problem, pipeline_problem
from hp_tool.dimensions import DIMENSIONS
from hp_tool.recipe import Degrees, Recipe
from hp_tool.sharding import (checkpoint_mode_problem, combination_problem, compile_problem, expert_problem,
                              expert_saver_problem, family_problem, fp8_layout_problem, master_weights_problem,
                              method_problem, optimizer_problem, sequence_problem)

if TYPE_CHECKING:
    from hp_tool.families.shape import Shape

GB = 1e9  # bandwidths are in GB/s of 1e9 bytes, as vendors label links
GIB = 2 ** 30  # memory is in GiB, as torch.cuda.mem_get_info and nvidia-smi report it

# context parallelism's ring attention computes a block's scores tile by tile of the query rows, each tile's fp32
# scores at most RING_SCORE_BYTES, but at least RING_MIN_ROWS query rows, so that a long block is not cut into
# thousands of thin matmuls (hp_tool/trial/ring_attention.py query_tiles; memory.ring_transient_bytes)
RING_SCORE_BYTES = 8 * 2 ** 20
RING_MIN_ROWS = 128


def ring_tile_rows(batch_heads: int, keys: int) -> int:
    """Query rows of one tile of the ring's scores against ``keys`` keys over ``batch_heads`` batch x heads."""
    return max(RING_MIN_ROWS, RING_SCORE_BYTES // (batch_heads * keys * 4))


@dataclass(frozen=True)
class Layout:
    """One candidate's layout for the full run: its degrees and its recipe. Each field of either, and what they
    derive, reads as an attribute of the layout (``layout.tp``, ``layout.engine``, ``layout.gpus``);
    ``Layout.of`` and ``replace`` take the fields by name."""

    degrees: Degrees
    recipe: Recipe = Recipe()

    def __post_init__(self) -> None:
        # every field of both parts, and what the recipe derives, read as the layout's own attribute: a plain
        # lookup, as the planner reads them millions of times (the parts, frozen, stay what the layout is: its
        # equality and hash)
        self.__dict__.update(self.degrees.__dict__)
        self.__dict__.update(self.recipe.__dict__)
        self.__dict__.update(bytes_per_value=self.recipe.bytes_per_value, adapted=self.recipe.adapted)

    @classmethod
    def of(cls, **values) -> "Layout":
        """A layout from its fields by name, each given to the part that holds it (the rest at their defaults)."""
        unknown = set(values) - PART_OF.keys()
        if unknown:
            raise TypeError(f"not a layout field: {sorted(unknown)}")
        return cls(Degrees(**{k: v for k, v in values.items() if PART_OF[k] == "degrees"}),
                   Recipe(**{k: v for k, v in values.items() if PART_OF[k] == "recipe"}))

    def replace(self, **changes) -> "Layout":
        """This layout with ``changes`` (fields by name) made to the parts that hold them. The planner makes
        tens of thousands of these, so a part is copied with its changed fields set rather than rebuilt through
        ``dataclasses.replace``; a recipe whose method or adapters change is checked again."""
        unknown = set(changes) - PART_OF.keys()
        if unknown:
            raise TypeError(f"not a layout field: {sorted(unknown)}")
        degrees, recipe = {}, {}
        for k, v in changes.items():
            (degrees if PART_OF[k] == "degrees" else recipe)[k] = v
        new = _evolve(self, changes)  # its own copy of every field, the changed ones set
        new.__dict__["degrees"] = _evolve(self.degrees, degrees)
        new.__dict__["recipe"] = _evolve(self.recipe, recipe)
        if recipe:
            new.__dict__.update(bytes_per_value=new.recipe.bytes_per_value, adapted=new.recipe.adapted)
        if "method" in recipe or "lora" in recipe:
            new.recipe.__post_init__()
        return new

    def values(self) -> dict:
        """Every field of both parts by name."""
        return {**{f.name: getattr(self.degrees, f.name) for f in fields(Degrees)},
                **{f.name: getattr(self.recipe, f.name) for f in fields(Recipe)}}

    def problems(self, shape: "Shape", gpus_per_node: Optional[int] = None) -> list["Problem"]:
        """Every reason this layout cannot run ``shape``, most basic first (``RULES``, in order); empty when it
        can. With ``gpus_per_node``, TP must stay within a node."""
        out = []
        for rule in RULES:
            found = rule.check(self, shape, gpus_per_node)
            if found is not None:  # a per-saver method's own Problem, or (field, reason)
                out.append(dataclasses.replace(found, fix=rule.fix) if isinstance(found, Problem)
                           else Problem(found[0], rule.name, found[1], rule.fix))
        return out

    def checkpoint_mode_problem(self, shape: "Shape") -> Optional["Problem"]:
        """Why the checkpointed layers cannot be recomputed in this mode (rule "checkpoint_mode"), or None."""
        bad = checkpoint_mode_problem(shape.family, self.act_ckpt_mode, self.act_ckpt_layers, self.engine, self.cp,
                                      self.activation_offload, self.method)
        return None if bad is None else Problem("act_ckpt_mode", "checkpoint_mode", bad)

    def sequence_problem(self, shape: "Shape") -> Optional["Problem"]:
        """Why the long-context savers (loss, sequence and context parallelism, activation offload) cannot run
        this way (rule "sequence"), or None."""
        bad = sequence_problem(shape.family, shape.seq_length, self.tp, self.pp, self.cp, self.ep,
                               self.sequence_parallel, self.loss, self.activation_offload, self.engine)
        return None if bad is None else Problem(bad[0], "sequence", bad[1])

    def expert_saver_problem(self) -> Optional["Problem"]:
        """Why the engine cannot split experts at this ZeRO stage and offload (rule "expert_savers"), or None;
        judged per saver like ``saver_problem``."""
        bad = expert_saver_problem(self.ep, self.zero_stage, self.offload)
        return None if bad is None else Problem("zero_stage", "expert_savers", bad)

    def method_problem(self, shape: "Shape") -> Optional["Problem"]:
        """Why this layout cannot train ``shape`` by its method (rule "method"), or None; judged per saver."""
        bad = method_problem(self.method, self.engine, self.tp, self.zero_stage, self.offload, shape.moe)
        return None if bad is None else Problem("method", "method", bad)

    def optimizer_problem(self) -> Optional["Problem"]:
        """Why the engine cannot step this optimizer at this ZeRO stage and offload (rule "optimizer"), or
        None; judged per saver like ``saver_problem``."""
        bad = master_weights_problem(self.master_weights, self.engine, self.offload)
        if bad is not None:
            return Problem("master_weights", "optimizer", bad)
        bad = optimizer_problem(self.optimizer, self.engine, self.zero_stage, self.offload)
        return None if bad is None else Problem("optimizer", "optimizer", bad)

    def saver_problem(self) -> Optional["Problem"]:
        """Why this engine cannot run this ZeRO stage and offload at this TP/PP (rule "savers"), or None;
        the last of ``problems()``, which a planner judging one saver at a time asks alone."""
        bad = combination_problem(self.engine, self.zero_stage, self.offload, self.tp, self.pp)
        return None if bad is None else Problem(SAVER_FIELDS[bad[0]], "savers", bad[1])


def _evolve(part, changes: dict):
    """A copy of frozen dataclass ``part`` with ``changes`` (field -> value) set; ``part`` itself without any."""
    if not changes:
        return part
    new = object.__new__(type(part))
    new.__dict__.update(part.__dict__)
    new.__dict__.update(changes)
    return new


# which part holds each field of a layout; what the parts derive, read as the layout's own
PART_OF = {**{f.name: "degrees" for f in fields(Degrees)}, **{f.name: "recipe" for f in fields(Recipe)}}
for _name, _value in vars(Degrees).items():  # the degrees' own properties and methods, which read the fields
    if isinstance(_value, property) or (callable(_value) and not _name.startswith("_")):  # the layout holds
        setattr(Layout, _name, _value)


# combination_problem names train_settings keys; the Layout's fields they are about
SAVER_FIELDS = {d.key: d.name for d in DIMENSIONS}


@dataclass(frozen=True)
class Problem:
    """Why a layout cannot run: the Layout field at fault, the rule (``Rule.name``), the reason in words and how
    to mend it (the rule's ``fix``)."""

    field: str
    rule: str
    reason: str
    fix: str = ""


Check = Callable[[Layout, "Shape", Optional[int]], "Optional[Problem | tuple[str, str]]"]


@dataclass(frozen=True)
class Rule:
    """One validity rule of a layout: its name (each ``Problem``'s ``rule``), its check (the layout, the model
    and the GPUs per node, or None, to (field at fault, reason) or a ``Problem`` of a per-saver method, or None)
    and the fix a refused spec names."""

    name: str
    check: Check
    fix: str


def _tp_family(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    if layout.tp > 1 and shape.facts.trial.no_tensor_parallel:
        return "tp", f"TP={layout.tp}: {shape.facts.trial.no_tensor_parallel}"
    return None


def _tp_heads(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    heads, kv, tp = shape.num_attention_heads, shape.num_kv_heads, layout.tp
    if tp > 1 and shape.facts.trial.no_tensor_parallel:
        return None  # the family's own rule says it
    if heads % tp:
        return "tp", f"TP={tp} does not divide the {heads} heads"
    if kv % tp:
        return "tp", f"TP={tp} does not divide the {kv} key/value heads ({heads} query heads)"
    return None


def _tp_node(layout: Layout, _shape: "Shape", gpus_per_node: Optional[int]):
    if gpus_per_node is not None and layout.tp > gpus_per_node:
        return "tp", f"TP={layout.tp} spans nodes ({gpus_per_node} GPUs per node)"
    return None


def _pipeline(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    bad = pipeline_problem(shape, layout.pp)
    return None if not bad else ("pp", bad)


def _checkpointed_layers(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    if pipeline_problem(shape, layout.pp):
        return None  # no stage size to judge against
    per_stage = shape.pipeline_layers // layout.pp
    if layout.act_ckpt_layers > per_stage:
        return "act_ckpt_layers", f"{layout.act_ckpt_layers} checkpointed layers exceed the {per_stage} layers per stage"
    return None


def _engine_family(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    bad = family_problem(shape.family, layout.engine)
    return None if not bad else ("engine", bad[1])


def _batch(layout: Layout, _shape: "Shape", _gpn: Optional[int]):
    if layout.global_batch_size % (layout.mbs * layout.dp):
        return "global_batch_size", (f"GBS={layout.global_batch_size} not divisible by MBS*DP={layout.mbs}*"
                                     f"{layout.dp}")
    return None


def _interleave(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    if layout.global_batch_size % (layout.mbs * layout.dp):
        return None  # no micro-batch count to judge
    bad = interleave_problem(shape, layout.pp, layout.virtual_stages, layout.act_ckpt_layers, layout.num_microbatches)
    if not bad:
        return None
    what, why = bad
    return ("global_batch_size" if what == "microbatches" else what), why


def _experts(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    bad = expert_problem(shape.num_experts, layout.ep, layout.dp, layout.tp, layout.engine)
    return None if not bad else ("ep", bad)


def _compile(layout: Layout, _shape: "Shape", _gpn: Optional[int]):
    bad = compile_problem(layout.compile, layout.engine, layout.tp)
    return None if not bad else ("compile", bad)


def _fp8(layout: Layout, shape: "Shape", _gpn: Optional[int]):
    bad = fp8_layout_problem(shape.family, layout.fp8, layout.engine, layout.tp, layout.method, layout.precision,
                             layout.sequence_parallel)
    return None if not bad else ("fp8", bad)


# Every validity rule of a layout, most basic first: ``Layout.problems`` is the loop over them, the planner's
# candidates, a spec read back by a trial (hp_tool/contracts/spec.py) and the inference grid ask it. The GPU's own
# rule (fp8 tensor cores) needs the hardware, and the planner asks it apart (``sharding.fp8_problem``).
RULES: tuple[Rule, ...] = (
    Rule("family", _tp_family, "use TP 1: the family does not split over TP"),
    Rule("heads", _tp_heads, "use a TP that divides the kv head count"),
    Rule("node", _tp_node, "keep TP within one node"),
    Rule("pipeline", _pipeline, "use a PP that splits the layers evenly (T5/mT5: 1, or even with PP/2 dividing "
                                 "num_layers)"),
    Rule("checkpointing", _checkpointed_layers, "use at most the layers of a pipeline stage"),
    Rule("family", _engine_family, "use engine torch"),
    Rule("batch", _batch, "use a multiple of mbs*dp"),
    Rule("interleave", _interleave, "use 1 virtual stage, or a layout interleaved 1F1B can run (virtual stages "
                                     "dividing the layers per stage and the checkpointed layers)"),
    Rule("savers", lambda layout, _s, _g: layout.saver_problem(),
          "choose a combination the engine supports (hp_tool/sharding.py combination_problem)"),
    Rule("optimizer", lambda layout, _s, _g: layout.optimizer_problem(),
          "use adamw, or the optimizer without offload (hp_tool/sharding.py optimizer_problem)"),
    Rule("method", lambda layout, shape, _g: layout.method_problem(shape),
          "use a layout the method runs on (hp_tool/sharding.py method_problem)"),
    Rule("experts", _experts, "use an expert-parallel size the model and engine run (hp_tool/sharding.py "
                               "expert_problem)"),
    Rule("expert_savers", lambda layout, _s, _g: layout.expert_saver_problem(),
          "with EP > 1 use ZeRO 0, 2 or 3 (hp_tool/sharding.py expert_saver_problem)"),
    Rule("sequence", lambda layout, shape, _g: layout.sequence_problem(shape),
          "use a loss, sequence or context parallelism the layout runs (hp_tool/sharding.py sequence_problem)"),
    Rule("checkpoint_mode", lambda layout, shape, _g: layout.checkpoint_mode_problem(shape),
          "use act_ckpt_mode full, or selective with act_ckpt_layers > 0 on the torch engine (hp_tool/sharding.py "
          "checkpoint_mode_problem)"),
    Rule("compile", _compile, "use compile false, or the torch engine at TP 1"),
    Rule("fp8", _fp8, "use fp8 false, or the torch engine without sequence parallelism training full in bf16 "
                       "(hp_tool/sharding.py fp8_layout_problem)"),
)


def rank_shape(shape: "Shape", layout: Layout) -> "Shape":
    """The model as one rank sees its sequence: ``seq_length / CP`` tokens (context parallelism splits each
    sequence over CP ranks, two balanced chunks each); the shape itself without CP. Activations, logits and
    the collectives that move them are per token a rank holds; the model's FLOPs stay the whole sequence's."""
    if layout.cp == 1:
        return shape
    return dataclasses.replace(shape, seq_length=shape.seq_length // layout.cp)


def stage_layers(shape: "Shape", layout: Layout) -> tuple[int, int]:
    """(the layers one pipeline stage runs, how many of them it checkpoints): every stage holds an equal share of
    the pipelined layers (``architectures.pipeline_problem``), so the busiest is any of them."""
    per_stage = shape.pipeline_layers // layout.pp
    return per_stage, min(layout.act_ckpt_layers, per_stage)


def microbatches_in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at once, in units of one micro-batch
    through all the rank's layers, as torch.distributed.pipelining's schedules run them. One without PP.
    1F1B: PP - stage, at most the step's micro-batches. Interleaved 1F1B over v chunks per rank: the warm-up
    runs (v - 1)·r + 2·(PP - 1 - stage) chunk forwards ahead (r micro-batches per round: PP when the step
    has at least PP), at most all m·v, and the steady state's next forward one more; each chunk holds 1/v
    of the rank's layers. On the first rank with m >= PP that is PP·(1 + (PP - 1)/(PP·v)) (Korthikanti et
    al. 2022, §4.2.3)."""
    pp, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
    if pp == 1:
        return 1.0
    if v == 1:
        return float(min(pp - stage, m))
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - stage), m * v)
    return min(warmup + 1, m * v) / v


@dataclass(frozen=True)
class Hardware:
    """What the cluster offers per GPU; bandwidths in GiB/s per GPU, peak in TFLOPS."""

    gpus_per_node: int
    gpu_memory_gib: float
    peak_tflops: float  # dense peak in the run's compute precision (the recipe's)
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float
    memory_overhead_gib: float  # framework overhead: CUDA context, allocator slack, comm buffers
    host_ram_gib: Optional[float] = None  # host RAM per node; None = unknown (offload cannot be planned)
    # host CPU threads (vCPUs) per node, which step an offloaded optimizer (speed.cpu_adam_params_per_s);
    # None = unknown (the reference host's rate)
    host_cpu_cores: Optional[float] = None
    # GB/s peak of the host's memory channels per node, the ceiling of its CPU Adam; None = unknown (the ceiling of
    # a 2-socket DDR4-3200 host, speed.CPU_ADAM_MAX_PARAMS_PER_S)
    host_memory_bandwidth_gbps: Optional[float] = None
    pcie_bandwidth_gbps: float = 25.0  # GB/s per GPU and direction between host and GPU (offload traffic)
    memory_bandwidth_gbps: float = 2000.0  # GB/s of GPU memory (QLoRA's dequantisation)
    flash_attention: bool = True  # attention scores are not stored (SDPA / flash kernels)
    # the training stack fuses the layers' element-wise work (Transformer Engine, Megatron's fused kernels: what
    # benchmarks/published_runs.py says of NeMo's and Megatron's runs); hp_tool's engines fuse it under
    # torch.compile only (speed.elementwise_s)
    fused_elementwise: bool = False
    # the training stack's attention kernels are Hopper's own (Transformer Engine's cuDNN fused attention,
    # FlashAttention-3), at their measured rate (speed.HOPPER_ATTENTION_EFFICIENCY), not the preset's: what
    # benchmarks/published_runs.py says of NeMo's H100 runs; hp_tool's engines call torch's SDPA, which the
    # presets' attention efficiency is fitted on
    hopper_attention: bool = False
    # the training stack's norms are fused kernels that keep their input alone (torchtitan's fused_rmsnorm: what
    # benchmarks/published_runs.py says of its runs that set it); hp_tool's engines run transformers' eager norms,
    # whose fp32 copy of the input the family's activation record counts (Family.memory.fused_norm_saving)
    fused_norms: bool = False
    # the fraction of the TP collectives the training stack hides behind the GEMMs beside them (torch's async TP,
    # Transformer Engine's userbuffers: what benchmarks/published_runs.py says of such runs); hp_tool's engines
    # hide none
    tp_comm_hidden: float = 0.0
    # the GPU's compute efficiency (gpu preset ``efficiency``, fitted per generation on published runs:
    # benchmarks/published_runs.py; hp_tool/estimate/speed.py gemm_efficiency and attention_efficiency)
    max_efficiency: float = 0.7  # the fraction of peak large dense matmuls approach
    width_half: float = 384.0  # hidden columns per TP rank at which the matmuls reach half of it
    tokens_half: float = 128.0  # tokens per micro-batch at which the matmuls reach half of it
    attention_efficiency: float = 0.6  # the fraction of peak causal flash attention approaches (head dim 128)
    fp8_peak_tflops: Optional[float] = None  # the FP8 Tensor Core peak (gpu.peak_tflops.fp8); None: no fp8 units
    device_is_host: bool = False  # CPU processes (gpu preset cpu): host RAM is the device's, offload moves nothing

    def offloads_activations(self, layout: "Layout") -> bool:
        """Whether ``layout``'s activation offload takes saved tensors off the device: not where the device is
        the host (the engine leaves a CPU rank's tensors where they are)."""
        return layout.activation_offload and not self.device_is_host

    def usable_gib(self, margin: float) -> float:
        """GPU memory a layout may fill: the device's total less the fraction ``margin`` kept free
        (train_settings.memory_margin); the planner prunes a predicted or traced peak above it."""
        return self.gpu_memory_gib * (1 - margin)

    def efficiency(self) -> dict[str, float]:
        """The GPU's compute-efficiency constants by field name (``EFFICIENCY_FIELDS``), as a TrialSpec's
        resources carry them."""
        return {name: getattr(self, name) for name in EFFICIENCY_FIELDS}


# Hardware's compute-efficiency constants: a gpu preset's ``efficiency`` group (hp_tool/config.py GpuEfficiency)
EFFICIENCY_FIELDS = ("max_efficiency", "width_half", "tokens_half", "attention_efficiency")


def interleave_held_tensors(layout: Layout, stage: int) -> tuple[int, int]:
    """Hidden-state tensors [mbs, seq, hidden] that interleaved 1F1B holds on pipeline rank ``stage`` beyond
    what one stage of the rank's layers holds under 1F1B: (receive buffers the other v - 1 chunks keep for
    the whole run, one per micro-batch for activations and one for gradients; the tensors the step sends,
    outputs forward unless the chunk is the model's last and input gradients backward unless its first,
    which torch's interleaved runtime keeps until it waits for the sends at the step's end). (0, 0) without
    interleaving. Measured per rank in real runs (tests/test_memtrace.py)."""
    v, m, pp = layout.virtual_stages, layout.num_microbatches, layout.pp
    if v == 1:
        return 0, 0
    recv = 2 * (v - 1) * m
    sends = (v * m - (m if stage == pp - 1 else 0)) + (v * m - (m if stage == 0 else 0))
    return recv, sends
