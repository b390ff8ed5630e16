"""TrialSpec: the self-contained description of one training run (a benchmark trial or the full run).

One YAML per candidate (``candidate_configs/<trial_id>.yaml``); the base config and the optimal config
use the same schema. Loading is pure Python (OmegaConf + dataclasses, no torch), so the planner, the
launcher and the trial engine all share it. Every field is typed; an unknown key or a wrong type fails
on load with the key's name, and ``__post_init__`` checks the cross-field rules.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from hp_tool.architectures import Shape
from hp_tool.dimensions import BY_NAME, DIMENSIONS, fingerprint_defaults
from hp_tool.families import family
from hp_tool.errors import ConfigError, require
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.recipe import LORA_DROPOUT, LOSS_CHUNK_TOKENS, SECTIONS, Adapters, Degrees, Recipe
from hp_tool.fingerprint import fingerprint_of
from hp_tool.fsutil import atomic_write_text
from hp_tool.sharding import combination_problem
from hp_tool.vocab import DATA_SOURCES, PRECISIONS, RUN_MODES, SCHEDULES



@dataclass
class LoraSpec:
    """The adapters of the lora and qlora methods (peft's LoraConfig)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = LORA_DROPOUT
    target_modules: List[str] = field(default_factory=list)  # a layer's linear modules, by name

    def __post_init__(self) -> None:
        require(self.rank >= 1, "model.lora.rank", self.rank, "must be at least 1", "use a rank such as 16")
        require(bool(self.target_modules), "model.lora.target_modules", self.target_modules, "is empty",
                "name the linear modules to adapt, e.g. [q_proj, v_proj]")


@dataclass
class ModelSpec:
    """Shape of the transformer; weights are random. T5/mT5: num_layers per stack, seq_length the encoder's
    and decoder_seq_length the decoder's. A fine-tuned model carries its Hugging Face config (``hf_config``,
    the config.json's contents), which the trial builds; the shape fields are read from it."""

    family: str = "gpt3"  # a registered family (hp_tool/families/)
    num_layers: int = 12
    hidden_size: int = 768
    num_attention_heads: int = 12
    num_kv_heads: int = 12  # == num_attention_heads unless grouped-query attention (Llama)
    ffn_hidden_size: int = 3072
    vocab_size: int = 51200
    seq_length: int = 2048
    init_method_std: float = 0.02
    num_parameters: int = 0  # total parameter count of the whole model (all stages, unsharded)
    kv_channels: Optional[int] = None  # per-head width; null = hidden_size / num_attention_heads
    decoder_seq_length: Optional[int] = None  # encoder-decoder families only
    qkv_bias: bool = False  # q, k and v projections carry biases (Qwen2)
    tied_embeddings: Optional[bool] = None  # the head is the embedding's matrix; null = the family's rule
    hf_config: Optional[Dict[str, Any]] = None  # a fine-tuned model's config.json (hp_tool/hf_config.py)
    checkpoint: Optional[str] = None  # a Hugging Face model directory whose weights the run starts from
    method: str = "full"  # full | lora | qlora: what trains (hp_tool/families/methods.py)
    lora: Optional[LoraSpec] = None  # the adapters, for lora and qlora
    fp8: bool = False  # the layers' linears in Float8 (hp_tool/trial/converters.py Float8Linears)
    # mixture of experts: each layer's MLP is num_experts experts of ffn_hidden_size, top_k per token, and
    # (Qwen2-MoE) an always-active shared expert of shared_expert_ffn_hidden_size; 0 experts = dense
    num_experts: int = 0
    top_k: int = 0
    shared_expert_ffn_hidden_size: int = 0

    def shape(self) -> Shape:
        """The planner's view of this model (for parameter and FLOP counts); what trains (the method and its
        adapters) is the layout's recipe (``TrialSpec.layout``)."""
        return Shape(self.family, self.num_layers, self.hidden_size, self.num_attention_heads,
                     self.num_kv_heads, self.ffn_hidden_size, self.vocab_size, self.seq_length,
                     self.kv_channels, self.decoder_seq_length, self.qkv_bias, self.tied_embeddings,
                     pretrained=self.hf_config is not None, num_experts=self.num_experts, top_k=self.top_k,
                     shared_expert_ffn=self.shared_expert_ffn_hidden_size)

    @property
    def adapters(self) -> Optional[Adapters]:
        """The method's adapters as a recipe holds them (None for full training)."""
        lora = self.lora
        return None if lora is None else Adapters(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))

    def __post_init__(self) -> None:
        facts = family(self.family)  # an unknown family fails here, naming model.family
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                     "ffn_hidden_size", "vocab_size", "seq_length"):
            require(getattr(self, name) > 0, f"model.{name}", getattr(self, name),
                    "must be positive", "set a positive integer")
        require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                "model.hidden_size", self.hidden_size,
                f"not divisible by num_attention_heads={self.num_attention_heads}",
                "choose hidden_size as a multiple of the head count, or set model.kv_channels")
        require(self.kv_channels is None or self.kv_channels > 0, "model.kv_channels", self.kv_channels,
                "must be positive", "set the per-head width, or null for hidden_size / num_attention_heads")
        require((self.decoder_seq_length is not None) == facts.arch.encoder_decoder, "model.decoder_seq_length",
                self.decoder_seq_length, "is set exactly for encoder-decoder families",
                "give a positive decoder length for t5/mt5, null for decoder-only families")
        require(self.decoder_seq_length is None or self.decoder_seq_length > 0, "model.decoder_seq_length",
                self.decoder_seq_length, "must be positive", "set the decoder's length in tokens, e.g. 128")
        require(self.num_attention_heads % self.num_kv_heads == 0, "model.num_kv_heads",
                self.num_kv_heads, f"does not divide num_attention_heads={self.num_attention_heads}",
                "use a divisor of the head count")
        BY_NAME["method"].require(self.method, "model")
        BY_NAME["fp8"].require(self.fp8, "model")
        require((self.lora is not None) == (self.method != "full"), "model.lora", self.lora,
                f"is given exactly for the adapter methods (lora, qlora), and the method is {self.method}",
                "give model.lora for lora and qlora, null for full")
        require(facts.arch.moe == (self.num_experts > 0), "model.num_experts", self.num_experts,
                f"family {self.family} is {'a mixture of experts' if facts.arch.moe else 'dense'}",
                "give the experts of an MoE family (e.g. 8), 0 for a dense one")
        require(0 < self.top_k <= self.num_experts if facts.arch.moe else self.top_k == 0, "model.top_k", self.top_k,
                f"must be between 1 and num_experts={self.num_experts} for an MoE model, 0 for a dense one",
                "set the experts each token is routed to (Mixtral: 2)")
        model_type = (self.hf_config or {}).get("model_type", self.family)
        require(model_type == self.family, "model.hf_config.model_type", model_type,
                f"is not the spec's family {self.family!r}", "give the config of a model of this family")


# how to mend a spec whose layout breaks a rule (estimate.layout.Layout.problems), by rule
def layout_fields(section: str) -> list[tuple[str, type, Any]]:
    """(name, type, field with the recipe's default) of each layout field that TrialSpec section ``section`` holds
    (hp_tool/recipe.py ``SECTIONS``): a section declares them once, where the layout does."""
    hints = {**typing.get_type_hints(Degrees), **typing.get_type_hints(Recipe)}
    return [(f.name, hints[f.name], field(default=f.default)) for part in (Degrees, Recipe)
            for f in dataclasses.fields(part) if SECTIONS[f.name] == section]


@dataclass
class ParallelSpec(dataclasses.make_dataclass("ParallelFields", layout_fields("parallel"))):
    """Parallel layout: world size = tp * pp * cp * dp. Its fields are the layout's parallel ones (hp_tool/recipe.py
    ``Degrees`` and ``Recipe``, by name, with their defaults), and the pipeline schedule. The long-context fields'
    rules need the model (``Layout.sequence_problem``), and ``TrialSpec`` checks them."""

    pipeline_schedule: str = "1F1B"  # one of SCHEDULES

    def __post_init__(self) -> None:
        for d in DIMENSIONS:  # each searched field's known values (the dimension table's, as its list's)
            if d.spec == "parallel":
                d.require(getattr(self, d.name), "parallel")
        for name in ("dp", "loss_chunk_tokens"):
            require(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name),
                    "must be at least 1", "set a positive integer")
        require(self.pipeline_schedule in SCHEDULES, "parallel.pipeline_schedule",
                self.pipeline_schedule, "unknown schedule", f"use one of {list(SCHEDULES)}")
        bad = combination_problem(self.engine, self.zero_stage, self.offload, self.tp, self.pp)
        if bad is not None:
            raise ConfigError("parallel", f"engine={self.engine} zero_stage={self.zero_stage} "
                              f"offload={self.offload} tp={self.tp} pp={self.pp}", bad[1],
                              "choose a combination the engine supports (hp_tool/sharding.py)")

    @classmethod
    def of(cls, layout: Layout, pipeline_schedule: str = "1F1B") -> "ParallelSpec":
        """A Layout's YAML form, field by field (the fields other sections hold go there: ``section_values``)."""
        return cls(**section_values(layout, "parallel"), pipeline_schedule=pipeline_schedule)

    def checkpointing(self, act_ckpt_layers: int) -> "ParallelSpec":
        """This section with ``act_ckpt_layers`` checkpointed layers in its mode, or in mode full with none (a
        mode without checkpointed layers means nothing, and selective refuses it): the shallow stages the
        tracer builds."""
        return dataclasses.replace(self, act_ckpt_layers=act_ckpt_layers,
                                   act_ckpt_mode=self.act_ckpt_mode if act_ckpt_layers else "full")


def section_values(layout: Layout, section: str) -> dict[str, Any]:
    """The fields of ``layout`` that TrialSpec section ``section`` holds, by name, as the section types them
    (the model's adapters as a LoraSpec)."""
    values = {name: getattr(layout, name) for name, held in SECTIONS.items() if held == section}
    if "lora" in values and values["lora"] is not None:
        values["lora"] = LoraSpec(**{**dataclasses.asdict(values["lora"]),
                                     "target_modules": list(values["lora"].target_modules)})
    return values


@dataclass
class DataSpec:
    source: str = "synthetic"  # synthetic tokens from the seed, or a flat binary token file
    path: Optional[str] = None  # token file (uint16/uint32 ids, memory-mapped) when source == "file"
    dtype: str = "uint16"

    def __post_init__(self) -> None:
        require(self.source in DATA_SOURCES, "training.data.source", self.source, "unknown data source",
                f"use one of {list(DATA_SOURCES)}")
        require(self.source != "file" or bool(self.path), "training.data.path", self.path,
                "a file data source needs a path", "set training.data.path to a token file")
        require(self.dtype in ("uint16", "uint32"), "training.data.dtype", self.dtype,
                "unsupported token dtype", "use uint16 or uint32")


@dataclass
class TrainingSpec:
    """Optimisation settings. The schedule (warm-up, constant, cosine decay) is defined over max_steps."""

    global_batch_size: int = 8  # sequences per optimizer step across all data-parallel replicas
    precision: str = "bf16"  # compute precision on GPU; CPU runs always use fp32
    optimizer: str = "adamw"
    lr: float = 6e-4
    min_lr: float = 6e-5
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    warmup_steps: int = 0
    constant_steps: int = 0
    max_steps: int = 100  # length of the full schedule (steps of the full run)
    grad_clip: float = 1.0
    seed: int = 1234
    data: DataSpec = field(default_factory=DataSpec)

    def __post_init__(self) -> None:
        require(self.global_batch_size >= 1, "training.global_batch_size", self.global_batch_size,
                "must be positive", "set a positive integer")
        require(self.precision in PRECISIONS, "training.precision", self.precision,
                "unknown precision", f"use one of {list(PRECISIONS)}")
        BY_NAME["optimizer"].require(self.optimizer, "training")
        require(self.max_steps >= 1, "training.max_steps", self.max_steps, "must be positive",
                "set the number of optimizer steps of the full run")


@dataclass
class ResourcesSpec:
    num_nodes: int = 1
    gpus_per_node: int = 1  # processes per node (GPUs on a GPU cluster, CPU processes locally)
    gpu_memory_gib: float = 80.0
    peak_tflops_per_gpu: float = 312.0  # dense peak in the compute precision, for MFU
    intra_node_bandwidth_gbps: float = 200.0  # GB/s per GPU within a node (NVLink)
    inter_node_bandwidth_gbps: float = 25.0  # GB/s per GPU across nodes (InfiniBand)
    gpu_hour_price: Optional[float] = None  # dollars per GPU-hour, for cost estimates
    gpu: Optional[str] = None  # the gpu preset the plan assumed, e.g. h100_80gb (cpu: CPU processes)
    host_ram_gib: Optional[float] = None  # host RAM per node, GiB
    pcie_bandwidth_gbps: float = 25.0  # GB/s per GPU and direction between host and GPU
    host_cpu_cores: Optional[float] = None  # host CPU threads per node (CPU Adam under offload); None: unknown
    host_memory_bandwidth_gbps: Optional[float] = None  # GB/s peak of the host's memory per node; None: unknown
    fp8_peak_tflops_per_gpu: Optional[float] = None  # the GPU's FP8 Tensor Core peak; None: it has none
    memory_bandwidth_gbps: float = 2000.0  # GB/s of GPU memory (fp8 casts, QLoRA's dequantisation)
    # the gpu preset's compute-efficiency constants (hp_tool/estimate/layout.py EFFICIENCY_FIELDS); {}: defaults
    efficiency: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node", "gpu_memory_gib", "peak_tflops_per_gpu",
                     "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
            require(getattr(self, name) > 0, f"resources.{name}", getattr(self, name),
                    "must be positive", "set a positive number")

    @classmethod
    def of(cls, hw: Hardware, num_nodes: int, gpu_hour_price: Optional[float], gpu: Optional[str]) -> "ResourcesSpec":
        """A spec's resources: ``num_nodes`` nodes of the planner's ``hw`` (the one place a Hardware becomes them;
        ``hardware`` reads them back)."""
        return cls(num_nodes, hw.gpus_per_node, hw.gpu_memory_gib, hw.peak_tflops, hw.intra_node_bandwidth_gbps,
                   hw.inter_node_bandwidth_gbps, gpu_hour_price, gpu=gpu, host_ram_gib=hw.host_ram_gib,
                   pcie_bandwidth_gbps=hw.pcie_bandwidth_gbps, host_cpu_cores=hw.host_cpu_cores,
                   host_memory_bandwidth_gbps=hw.host_memory_bandwidth_gbps, efficiency=hw.efficiency(),
                   fp8_peak_tflops_per_gpu=hw.fp8_peak_tflops, memory_bandwidth_gbps=hw.memory_bandwidth_gbps)

    def hardware(self) -> Hardware:
        """The planner's Hardware these resources were made from (``of``), for the step-time terms a collector
        prices: the framework's memory overhead, which only memory estimates read, is not carried (0)."""
        return Hardware(self.gpus_per_node, self.gpu_memory_gib, self.peak_tflops_per_gpu, self.intra_node_bandwidth_gbps,
                        self.inter_node_bandwidth_gbps, memory_overhead_gib=0.0, host_ram_gib=self.host_ram_gib,
                        pcie_bandwidth_gbps=self.pcie_bandwidth_gbps, host_cpu_cores=self.host_cpu_cores,
                        host_memory_bandwidth_gbps=self.host_memory_bandwidth_gbps,
                        memory_bandwidth_gbps=self.memory_bandwidth_gbps, fp8_peak_tflops=self.fp8_peak_tflops_per_gpu,
                        **self.efficiency)


@dataclass
class RunSpec:
    """How long to run and when to stop. A benchmark stops at whichever limit comes first."""

    mode: str = "benchmark"  # one of RUN_MODES
    max_minutes: float = 10.0  # wall-clock budget of the job, start-up included
    max_steps: int = 50  # optimizer steps to run at most
    warmup_steps: int = 3  # first steps excluded from timing
    stable_window: int = 5  # stop early once this many timed steps ...
    stable_cv: float = 0.05  # ... have a coefficient of variation below this (0 disables)
    memory_cap_gib: Optional[float] = None  # CPU only: per-process address-space cap (RLIMIT_AS)
    output_dir: Optional[str] = None  # where metrics.jsonl and result.json go
    save_dir: Optional[str] = None  # a full run saves a Hugging Face checkpoint of its model here at the end

    def __post_init__(self) -> None:
        require(self.mode in RUN_MODES, "run.mode", self.mode, "unknown run mode",
                f"use one of {list(RUN_MODES)}")
        require(self.max_minutes > 0, "run.max_minutes", self.max_minutes, "must be positive",
                "set the job's time limit in minutes")
        require(self.max_steps >= 1, "run.max_steps", self.max_steps, "must be positive",
                "set a positive number of steps")
        require(self.warmup_steps >= 0, "run.warmup_steps", self.warmup_steps,
                "must not be negative", "use 0 or more")


@dataclass
class FullRunSpec:
    """The production run a benchmark trial stands for (the trial may use fewer nodes)."""

    num_nodes: int = 1
    dp: int = 1
    global_batch_size: int = 8
    num_tokens_in_b: float = 0.0  # every epoch's tokens
    max_steps: int = 1
    epochs: Optional[float] = None  # fine-tuning: passes over the data; None for pretraining

    @property
    def epoch_tokens(self) -> Optional[float]:
        """Tokens in one pass over a fine-tuning run's data; None for pretraining."""
        return None if self.epochs is None else self.num_tokens_in_b * 1e9 / self.epochs


@dataclass
class EstimatesSpec:
    """The planner's predictions, kept beside the measurement. None where not estimated."""

    memory_gib: Optional[float] = None  # peak per GPU, GiB (1e9 bytes)
    step_time_s: Optional[float] = None  # one optimizer step of the full run, seconds
    tokens_per_s_per_gpu: Optional[float] = None
    model_tflops_per_gpu: Optional[float] = None
    traced_memory_gib: Optional[float] = None  # traced peak per GPU (tensors + overhead), GiB; None: not traced


@dataclass
class TrialSpec:
    trial_id: str = "trial"
    model: ModelSpec = field(default_factory=ModelSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    run: RunSpec = field(default_factory=RunSpec)
    full_run: FullRunSpec = field(default_factory=FullRunSpec)
    estimates: EstimatesSpec = field(default_factory=EstimatesSpec)

    def __post_init__(self) -> None:
        m, p, r = self.model, self.parallel, self.resources
        world = r.num_nodes * r.gpus_per_node
        require(p.tp * p.pp * p.cp * p.dp == world, "parallel", f"tp={p.tp} pp={p.pp} cp={p.cp} dp={p.dp}",
                f"tp*pp*cp*dp={p.tp * p.pp * p.cp * p.dp} differs from the world size "
                f"num_nodes*gpus_per_node={r.num_nodes}*{r.gpus_per_node}={world}",
                "make the parallel degrees multiply to the number of processes")
        layout = self.layout()
        for problem in layout.problems(m.shape()):
            key = f"{SECTIONS[problem.field]}.{problem.field}"
            value = getattr(layout, problem.field)
            raise ConfigError(key, value, problem.reason, problem.fix)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each data-parallel replica."""
        return self.training.global_batch_size // (self.parallel.mbs * self.parallel.dp)

    def layout(self) -> Layout:
        """The layout this trial runs: each field of its degrees and recipe from the section holding it, by
        name (``SECTIONS``)."""
        sections = {"parallel": self.parallel, "training": self.training, "model": self.model}
        values = {name: getattr(sections[section], name) for name, section in SECTIONS.items()}
        return Layout.of(**{**values, "lora": self.model.adapters})

    def full_layout(self) -> Layout:
        """The layout of the full run this trial stands for: its own, with the full run's data-parallel
        replicas and global batch."""
        return self.layout().replace(dp=self.full_run.dp, global_batch_size=self.full_run.global_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that changes what this trial measures: model, layout, batch, precision,
        optimizer, data, steps, time box and stop rule, and the processes it runs on. Not the trial id,
        the output folder, the planner's estimates, the full run it stands for, or prices."""
        d = self.to_dict()
        # the fields added later are left out at their defaults, so a spec without them keeps its fingerprint
        parallel = {k: v for k, v in d["parallel"].items() if ADDED_FIELD_DEFAULTS.get(k, object()) != v}
        model = {k: v for k, v in d["model"].items() if ADDED_MODEL_DEFAULTS.get(k, object()) != v}
        return fingerprint_of({
            "model": model, "parallel": parallel, "training": d["training"],
            "run": {k: v for k, v in d["run"].items() if k != "output_dir"},
            "resources": {k: d["resources"][k] for k in ("num_nodes", "gpus_per_node")},
        })


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """TrialSpec's OmegaConf schema, built once (a third of a spec's read): merging copies it, never changes it."""
    return OmegaConf.structured(TrialSpec)


def load_spec(path: str | os.PathLike) -> TrialSpec:
    """Read a TrialSpec YAML; unknown keys, wrong types and broken rules raise with the key's name."""
    merged = OmegaConf.merge(_schema(), OmegaConf.load(str(path)))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def dump_spec(spec: TrialSpec, path: str | os.PathLike) -> Path:
    """Write the spec as YAML atomically, so a reader never sees half a file."""
    import yaml

    text = yaml.safe_dump(spec.to_dict(), sort_keys=False, default_flow_style=False)
    return atomic_write_text(path, text)


# ParallelSpec's fields added after specs were first written (the long-context savers, the checkpointing mode) and
# their defaults: what a layout without them runs
ADDED_FIELD_DEFAULTS = {**fingerprint_defaults("parallel"), "loss_chunk_tokens": LOSS_CHUNK_TOKENS}
ADDED_MODEL_DEFAULTS = fingerprint_defaults("model")  # the model's (fp8 linears)

