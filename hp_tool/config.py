"""Typed schemas of hp_tool's Hydra config, registered with the ConfigStore.

An unknown key or a wrong type fails while Hydra composes (the message names the key); the checks in
``__post_init__`` run when the composed config is turned into these dataclasses (``to_app_config``),
before anything is planned, written or submitted. Each failure names the key, the value and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from hp_tool.families.moe import DEFAULT_EXPERT_IMBALANCE
from hp_tool.families import family, family_names
from hp_tool.errors import ConfigError, require
from hp_tool.estimate.layout import EFFICIENCY_FIELDS
from hp_tool.sharding import checkpoint_mode_problem
from hp_tool.vocab import trial_device  # noqa: F401 - re-exported: the planner's callers ask it here
from hp_tool.dimensions import DIMENSIONS
from hp_tool.recipe import LORA_DROPOUT
from hp_tool.contracts.inference import INFERENCE_ENGINES
from hp_tool.estimate.serving import KV_FORMATS, WEIGHT_FORMATS
from hp_tool.engine_facts import engine_facts
from hp_tool.vocab import CLUSTER_TYPES, FINETUNE, MEMORY_CHECKS, PRECISIONS, STRATEGIES

DEFAULT_SKIP_MARGIN = 0.25  # train_settings.skip_margin; chosen by benchmarks/search_cost.py
SIZING_MFU = 140 / 312  # tflops_per_gpu default: the MFU of NeMo's 140 TFLOPS on a 312-TFLOPS A100 (45%)
MAX_SEQ_LENGTH = 1 << 20
MAX_VOCAB = 1 << 22


def _positive(obj: object, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value > 0, f"{prefix}.{name}", value, "must be positive",
                "set a positive number (or null for the default)")


def _not_empty(key: str, values: Optional[list], fix: str) -> None:
    """The one rule for list keys: null takes the default, an empty list is refused (it would search nothing,
    or silently stand for the default)."""
    require(values is None or len(values) > 0, key, values, "is an empty list", fix)


def _positive_list(obj: object, prefix: str, names: tuple[str, ...], allow_zero: bool = False) -> None:
    for name in names:
        values = getattr(obj, name, None)  # a row whose key the schema lacks is never given
        if values is None:
            continue
        key = f"{prefix}.{name}"
        _not_empty(key, values, "give at least one value, or null for the heuristic default")
        low = 0 if allow_zero else 1
        bad = [v for v in values if v < low]
        require(not bad, key, values, f"has values below {low}: {bad}", f"use integers >= {low}")


def _members(obj: object, prefix: str, name: str, allowed: tuple) -> None:
    values = getattr(obj, name, None)
    if values is None:
        return
    key = f"{prefix}.{name}"
    _not_empty(key, values, f"give some of {list(allowed)}, or null for the heuristic")
    bad = [v for v in values if v not in allowed]
    require(not bad, key, values, f"has unknown values {bad}", f"use values from {list(allowed)}")


def _length(key: str, value: Optional[int], what: str, example: str) -> None:
    if value is not None:
        require(1 <= value <= MAX_SEQ_LENGTH, key, value, f"is not a usable {what}",
                f"use a length between 1 and {MAX_SEQ_LENGTH} tokens, e.g. {example}")


def _seq_and_vocab(prefix: str, seq: Optional[int], vocab: int) -> None:
    _length(f"{prefix}.seq_length", seq, "sequence length", "2048")
    require(2 <= vocab <= MAX_VOCAB, f"{prefix}.vocab_size", vocab, "is not a usable vocabulary size",
            f"use a size between 2 and {MAX_VOCAB}, e.g. 51200")


@dataclass
class WandbConfig:
    enable: bool = False  # log trials and the summary to Weights & Biases
    api_key_file: Optional[str] = None  # file whose first line is the API key; never logged or copied
    project: str = "hp_tool"


@dataclass
class PeakTflops:
    """Dense peak per GPU in TFLOPS for each training precision (datasheet figures, without sparsity)."""

    bf16: Optional[float] = MISSING  # null: the GPU has no bf16 (V100, T4)
    fp16: float = MISSING
    fp32: float = MISSING
    # FP8 Tensor Core (Hopper, Ada): the linears' peak where train_settings.fp8 runs them in Float8 (torchao); null:
    # no fp8 tensor cores (A100, V100, CPU), and fp8 layouts are invalid there
    fp8: Optional[float] = None


@dataclass
class GpuEfficiency:
    """The GPU's compute efficiency (hp_tool/estimate/speed.py): its linears reach ``max_efficiency`` of peak
    x width / (width + width_half) x tokens / (tokens + tokens_half) (width = hidden / TP, tokens per
    micro-batch), causal flash attention ``attention_efficiency`` of peak at long sequence and head dim 128.
    Fitted per GPU generation on published runs (benchmarks/published_runs.py); each preset names its source."""

    max_efficiency: float = 0.7
    width_half: float = 384.0
    tokens_half: float = 128.0
    attention_efficiency: float = 0.6


@dataclass
class GpuConfig:
    """What one GPU (and its node) offers: a preset of the ``gpu`` group, e.g. ``gpu=h100_80gb``."""

    name: str = MISSING  # preset name, shown in plans and comparisons
    memory_gib: float = MISSING  # GPU memory, GiB
    peak_tflops: PeakTflops = field(default_factory=PeakTflops)
    intra_node_bandwidth_gbps: float = MISSING  # GB/s per GPU and direction within a node
    inter_node_bandwidth_gbps: float = MISSING  # GB/s per GPU across nodes
    host_ram_gib: Optional[float] = None  # host RAM per node, GiB; null = unknown (no offload planning)
    host_cpu_cores: Optional[float] = None  # host CPU threads (vCPUs) per node, for offload's CPU Adam; null = unknown
    # GB/s peak of the host's memory channels per node (its CPUs' channels x their rate), which bounds offload's CPU
    # Adam; null = unknown (a 2-socket, 16-channel DDR4-3200 host's)
    host_memory_bandwidth_gbps: Optional[float] = None
    pcie_bandwidth_gbps: float = MISSING  # GB/s per GPU and direction between host and GPU (offload)
    memory_bandwidth_gbps: Optional[float] = None  # GB/s of GPU memory; null = unknown (QLoRA cannot be priced)
    memory_overhead_gib: float = MISSING  # calibrated per-GPU framework overhead (context, buffers), GiB
    price_per_gpu_hour: Optional[float] = None  # USD; the shipped values are examples
    efficiency: GpuEfficiency = field(default_factory=GpuEfficiency)

    def __post_init__(self) -> None:
        if self.name == MISSING:  # the schema's placeholder, before a preset is merged in
            return
        _positive(self.efficiency, "gpu.efficiency", EFFICIENCY_FIELDS)
        for key in ("max_efficiency", "attention_efficiency"):
            require(getattr(self.efficiency, key) <= 1, f"gpu.efficiency.{key}", getattr(self.efficiency, key),
                    "is a fraction of the peak and cannot exceed 1", "give a fraction of peak, e.g. 0.6")
        _positive(self, "gpu", ("memory_gib", "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps",
                                "host_ram_gib", "pcie_bandwidth_gbps", "price_per_gpu_hour", "memory_bandwidth_gbps",
                                "host_memory_bandwidth_gbps"))
        _positive(self.peak_tflops, "gpu.peak_tflops", (*PRECISIONS, "fp8"))
        require(self.host_cpu_cores is None or self.host_cpu_cores > 0, "gpu.host_cpu_cores", self.host_cpu_cores,
                "must be a positive number of CPU threads",
                "give the node's CPU threads (vCPUs, as nproc prints them), e.g. 96 for a p4d.24xlarge, "
                "or null if unknown")
        require(0 <= self.memory_overhead_gib < self.memory_gib, "gpu.memory_overhead_gib",
                self.memory_overhead_gib, f"must be at least 0 and below gpu.memory_gib={self.memory_gib}",
                "measure the framework overhead per GPU, in GiB")

    def supports(self, precision: str) -> bool:
        """Whether this GPU computes in ``precision`` (bf16 | fp16 | fp32): it has a peak for it."""
        return getattr(self.peak_tflops, precision) is not None

    def default_precision(self) -> str:
        """The training precision when train_settings.precision is null: bf16 where the GPU has it, else
        fp16 (with dynamic loss scaling)."""
        return "bf16" if self.supports("bf16") else "fp16"

    def peak_tflops_for(self, precision: str) -> float:
        """Dense peak TFLOPS per GPU in ``precision`` (bf16 | fp16 | fp32), one this GPU supports."""
        require(self.supports(precision), f"gpu.peak_tflops.{precision}", None,
                f"gpu={self.name} has no {precision}", "use a precision the GPU has (fp16 or fp32)")
        return float(getattr(self.peak_tflops, precision))


@dataclass
class SlurmSettings:
    """How a SLURM cluster's jobs are submitted (cluster=bcm, and auto where SLURM answers): sbatch and srun
    options, as submitit passes them."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    exclusive: bool = True
    constraint: Optional[str] = None
    mem: Optional[str] = None  # sbatch --mem, e.g. "0" for the whole node
    container_image: Optional[str] = None
    container_mounts: List[str] = field(default_factory=list)
    srun_args: List[str] = field(default_factory=list)
    setup: List[str] = field(default_factory=list)  # shell lines run before each trial
    additional_sbatch_parameters: Dict[str, str] = field(default_factory=dict)


@dataclass
class RaySettings:
    """How an existing Ray cluster's jobs are submitted (cluster=ray)."""

    address: Optional[str] = None  # its job API, http://<head>:8265; null/auto: RAY_ADDRESS or local
    gpus_per_worker: Optional[float] = None  # GPUs per worker (trial process); null: 1, 0 with gpu=cpu
    accelerator_type: Optional[str] = None  # the accelerator label a worker's node must carry (A100, H100)
    runtime_env: Dict[str, Any] = field(default_factory=dict)  # jobs' runtime_env (working_dir, pip)

    def __post_init__(self) -> None:
        require(self.gpus_per_worker is None or self.gpus_per_worker >= 0, "cluster.ray.gpus_per_worker",
                self.gpus_per_worker, "is negative", "give the GPUs each Ray worker (trial process) takes, e.g. 1")


@dataclass
class ClusterConfig:
    """Where and how trials run: what every backend reads, then each backend's own keys in its section
    (``slurm``, ``ray``). Hardware is the ``gpu`` group; the run's shape is ``train_settings``."""

    type: str = "auto"  # local | bcm (SLURM) | auto (SLURM, else local if the search fits) | in_process | ray
    cpus_per_task: Optional[int] = None  # CPUs per trial process; null = SLURM: the partition's CPUs per node / tasks per node, Ray: 1
    job_name_prefix: str = "hp_tool:"
    max_parallel_runs: int = 1  # trials running at once
    max_queue_minutes: Optional[float] = None  # cancel (unschedulable) a job pending longer than this
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    ray: RaySettings = field(default_factory=RaySettings)

    def __post_init__(self) -> None:
        require(self.type in CLUSTER_TYPES, "cluster.type", self.type, "unknown cluster type",
                f"use one of {list(CLUSTER_TYPES)}")
        require(self.type != "bcm" or bool(self.slurm.partition), "cluster.slurm.partition", self.slurm.partition,
                "is required for a SLURM cluster", "add cluster.slurm.partition=<partition> to the command")
        _positive(self, "cluster", ("cpus_per_task", "max_parallel_runs", "max_queue_minutes"))


@dataclass
class LoraSettings:
    """The adapters of the lora and qlora methods (peft's LoraConfig)."""

    rank: int = 16  # r: the adapters' inner width
    alpha: float = 32.0  # the update is scaled by alpha / r
    dropout: float = LORA_DROPOUT  # dropout on the adapters' input (0, as peft and torchtune default; above 0 each adapter keeps its own copy of it and a mask)
    target_modules: Optional[List[str]] = None  # a layer's linear modules to adapt; null = every one

    def __post_init__(self) -> None:
        p = "search_config.train_settings.lora"
        require(self.rank >= 1, f"{p}.rank", self.rank, "must be at least 1",
                "use a rank such as 8, 16 or 64 (LoRA with rank 0 trains nothing)")
        require(self.alpha > 0, f"{p}.alpha", self.alpha, "must be positive", "use e.g. 2 x rank")
        require(0 <= self.dropout < 1, f"{p}.dropout", self.dropout, "must be in [0, 1)", "use e.g. 0.05")
        _not_empty(f"{p}.target_modules", self.target_modules, "give at least one of a layer's linear modules "
                   "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or null for all of them")


@dataclass
class ModelOverrides:
    """Explicit shape; null = from the family's table for the model size."""

    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None  # grouped-query attention; null = num_attention_heads
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None  # per-head width; null = hidden / heads (T5/mT5: 64)
    context_length: Optional[int] = None  # the model's longest sequence; null = no limit
    hf_config: Optional[str] = None  # fine-tuning: the model's Hugging Face config (hp_tool/hf_config.py)
    # mixture of experts (model_family moe): routed experts per layer (ffn_hidden_size each), experts per token
    num_experts: Optional[int] = None
    top_k: Optional[int] = None

    def __post_init__(self) -> None:
        _positive(self, "search_config.model", ("num_layers", "hidden_size", "num_attention_heads",
                                                "num_kv_heads", "ffn_hidden_size", "kv_channels",
                                                "context_length", "num_experts", "top_k"))
        require(self.top_k is None or self.num_experts is None or self.top_k <= self.num_experts,
                "search_config.model.top_k", self.top_k, f"exceeds num_experts={self.num_experts}",
                f"route each token to at most the {self.num_experts} experts (Mixtral: 2 of 8)")
        heads, kv = self.num_attention_heads, self.num_kv_heads
        require(heads is None or kv is None or heads % kv == 0, "search_config.model.num_kv_heads", kv,
                f"does not divide num_attention_heads={heads}",
                f"use a divisor of {heads} key/value heads (e.g. 8 for 64 heads), or null for {heads}")
        given = [self.num_layers, self.hidden_size, self.num_attention_heads]
        require(all(v is None for v in given) or all(v is not None for v in given),
                "search_config.model", given, "a partial shape was given",
                "set num_layers, hidden_size and num_attention_heads together, or none of them")

    @property
    def given(self) -> bool:
        return self.num_layers is not None


def _dimension_lists() -> list[tuple]:
    """train_settings' list of every searched dimension, from its row (hp_tool/dimensions.py: its key, its values'
    type, its doc): null searches the dimension's heuristic (hp_tool/candidates.py) or its default."""
    return [(d.key, Optional[List[d.kind]], field(default=None, metadata={"doc": d.doc})) for d in DIMENSIONS]


@dataclass
class TrainSettings(dataclasses.make_dataclass("DimensionLists", _dimension_lists())):
    """The training search. Its lists of the searched dimensions come from the dimension table (``_dimension_lists``);
    lists set to null take the heuristic defaults for the model size."""

    model_size_in_b: Optional[float] = None  # null = recommend from the budget below
    num_nodes: int = 1
    gpus_per_node: int = 8  # GPUs per node of the full run (trial processes per node)
    max_training_days: float = 5.0
    limit_search_runs: int = 100  # most trials to launch
    output_top_n: int = 10
    max_steps_per_run: int = 50
    max_minutes_per_run: float = 20.0
    stable_cv: float = 0.05  # a trial stops once 5 timed steps vary less than this; 0 runs max_steps_per_run
    tflops_per_gpu: Optional[float] = None  # achieved TFLOPS per GPU for sizing; null = SIZING_MFU x peak
    num_tokens_in_b: float = 300.0
    vocab_size: int = 51200
    seq_length: int = 2048  # T5/mT5: the encoder's length
    decoder_seq_length: Optional[int] = None  # T5/mT5 only: the decoder's length; null = 128
    global_batch_size: Optional[int] = None  # null = table default for the size and seq length
    precision: Optional[str] = "bf16"  # bf16 | fp16 | fp32; null = bf16 where the GPU has it, else fp16
    memory_margin: float = 0.05  # fraction of GPU memory kept free when pruning
    search_strategy: str = STRATEGIES[0]  # adaptive | exhaustive (hp_tool/adaptive.py)
    skip_margin: float = DEFAULT_SKIP_MARGIN  # adaptive: skip candidates calibrated this much slower than the best measured,
    # and stop a running trial measured this much slower
    confirm_top: int = 2  # the fastest trials timed again after the search (0: none), for the run-to-run spread
    min_model_parallel_size: Optional[int] = None
    max_model_parallel_size: Optional[int] = None
    lora: LoraSettings = field(default_factory=LoraSettings)  # the adapters of lora and qlora
    # the busiest expert's tokens over the mean (top_k·tokens/experts) that expert memory and compute are sized
    # at (hp_tool/families/moe.py DEFAULT_EXPERT_IMBALANCE: Switch Transformer's capacity factor 1.25)
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE
    # fine-tuning (model_family finetune): the data is the budget; the answer is hours and dollars per epoch
    global_batch_tokens: Optional[int] = None  # tokens per optimizer step at every sequence length; null = GBS x seq
    dataset_tokens_in_m: Optional[float] = None  # tokens in one epoch of the data, millions
    epochs: float = 1.0  # passes over the data

    def __post_init__(self) -> None:
        p = "search_config.train_settings"
        _positive(self, p, ("model_size_in_b", "num_nodes", "gpus_per_node",
                            "max_training_days", "limit_search_runs", "output_top_n",
                            "max_steps_per_run", "max_minutes_per_run", "tflops_per_gpu",
                            "num_tokens_in_b", "global_batch_size", "min_model_parallel_size",
                            "max_model_parallel_size", "global_batch_tokens", "dataset_tokens_in_m", "epochs"))
        _seq_and_vocab(p, self.seq_length, self.vocab_size)
        _length(f"{p}.decoder_seq_length", self.decoder_seq_length, "decoder length", "128 (or null for 128)")
        for d in DIMENSIONS:  # every searched dimension's list: known values, or integers from its least
            if d.choices is None:
                _positive_list(self, p, (d.key,), allow_zero=d.least == 0)
            else:
                _members(self, p, d.key, d.choices)
        require(self.expert_imbalance >= 1.0, f"{p}.expert_imbalance", self.expert_imbalance,
                "must be at least 1 (the busiest expert gets at least the mean of the routed tokens)",
                "use 1.0 for perfectly balanced routing, 1.25 (default) as Switch Transformer's capacity factor")
        if self.act_ckpt_modes is not None and "full" not in self.act_ckpt_modes:  # selective only: some layout runs it
            layers = max(self.act_ckpt_layers or [1])
            bad = [checkpoint_mode_problem(None, "selective", layers, engine) for engine in self.engines or ["torch"]]
            require(None in bad, f"{p}.act_ckpt_modes", self.act_ckpt_modes, bad[0],
                    "search act_ckpt_modes=[full] (or [full, selective]), or with selective the torch engine and "
                    "act_ckpt_layers above 0")
        require(self.precision is None or self.precision in PRECISIONS, f"{p}.precision", self.precision,
                "unknown precision", "use bf16, fp16 or fp32, or null for bf16 where the GPU has it, else fp16")
        if set(self.methods or ()) & {"lora", "qlora"} and importlib.util.find_spec("peft") is None:
            raise ConfigError(f"{p}.methods", self.methods, "the adapter methods need peft, which is not installed",
                              'pip install "hp_tool[finetune]" (or pip install peft), or search methods [full]')
        if "qlora" in (self.methods or ()) and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"{p}.methods", self.methods, "qlora's 4-bit NF4 weights need bitsandbytes (0.45 or "
                              "later, which also runs on CPU), which is not installed",
                              'pip install "hp_tool[finetune]" (or pip install bitsandbytes), or search methods [full, lora]')
        require(not ("qlora" in (self.methods or []) and self.precision == "fp32"), f"{p}.precision", self.precision,
                "QLoRA computes on a dequantised 16-bit copy of its 4-bit weights, not in fp32",
                "use bf16 or fp16 (null: the GPU's), or search methods [full, lora]")
        for engine in self.engines or ():
            package = engine_facts(engine).package
            if package is not None and importlib.util.find_spec(package) is None:
                raise ConfigError(f"{p}.engines", self.engines, f"the {engine} engine was asked for but {package} "
                                  "is not installed", f'pip install "hp_tool[{package}]" (or pip install {package}), '
                                  "or search engines=[torch]")
        require(self.search_strategy in STRATEGIES, f"{p}.search_strategy", self.search_strategy,
                "unknown search strategy", "use adaptive (learn from each trial, skip the hopeless) or exhaustive "
                "(launch every selected candidate)")
        require(self.skip_margin >= 0, f"{p}.skip_margin", self.skip_margin, "must be >= 0",
                "e.g. 0.25 skips candidates predicted more than 25% slower than the best measured trial")
        require(isinstance(self.confirm_top, int) and self.confirm_top >= 0, f"{p}.confirm_top", self.confirm_top,
                "must be an integer >= 0", "e.g. 2 times the two fastest trials again; 0 skips the confirmation round")
        require(0 <= self.memory_margin < 1, f"{p}.memory_margin", self.memory_margin,
                "must be a fraction in [0, 1)", "e.g. 0.05 keeps 5% of GPU memory free")
        lo, hi = self.min_model_parallel_size, self.max_model_parallel_size
        require(lo is None or hi is None or lo <= hi, f"{p}.min_model_parallel_size", lo,
                f"exceeds max_model_parallel_size={hi}", "make min <= max")


    def batch_tokens(self) -> int:
        """Tokens per optimizer step of a fine-tuning search, the same at every sequence length searched:
        ``global_batch_tokens``, else ``global_batch_size`` sequences of ``seq_length`` tokens."""
        if self.global_batch_tokens is not None:
            return self.global_batch_tokens
        return (self.global_batch_size or 0) * self.seq_length


@dataclass
class InferenceSettings:
    vocab_size: int = 51200
    start_id: int = 50256
    end_id: int = 50256
    input_seq_len: int = 60
    output_seq_len: int = 20
    max_latency_ms: float = 1200.0
    # limits on the serving-time model's predicted time to first token and time per output token
    # (hp_tool/estimate/serving.py): a layout predicted to miss one is not run (plan.csv: over_slo); null = none
    max_ttft_ms: Optional[float] = None
    max_tpot_ms: Optional[float] = None
    # what serves each layout: hp_tool (its own decode loop: CPU runs and tests) | vllm (`vllm bench latency` with
    # the layout's flags, where vLLM is installed on the nodes; the report prints the `vllm serve` line of the pick)
    engine: str = "hp_tool"
    # the checkpoint vLLM loads (a hub id or a local directory); null = a fine-tuning preset's model.hf_config
    model_path: Optional[str] = None
    # the weights' formats searched: bf16 | fp16 | fp32 | fp8 | int8 | int4 | fp4 (vLLM: fp8 quantised as it loads,
    # the others from a checkpoint quantised so); null = the served precision
    weight_formats: Optional[List[str]] = None
    kv_cache_formats: Optional[List[str]] = None  # the KV cache's: bf16 | fp16 | fp32 | fp8; null = the served precision
    # a mixture of experts' routed experts whole on the TP ranks (EP = TP, attention still TP; vLLM's
    # --enable-expert-parallel) instead of a 1/TP slice of each: false | true; null = both for a mixture of experts at
    # TP > 1 where the engine runs it (vLLM), else false
    expert_parallel: Optional[List[bool]] = None
    top_n: int = 10
    tensor_parallel_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    pipeline_parallel_sizes: List[int] = field(default_factory=lambda: [1])
    max_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 8, 16, 32, 64, 256])

    def __post_init__(self) -> None:
        p = "search_config.inference_settings"
        _positive(self, p, ("input_seq_len", "output_seq_len", "max_latency_ms", "top_n", "max_ttft_ms", "max_tpot_ms"))
        _seq_and_vocab(p, None, self.vocab_size)
        _positive_list(self, p, ("tensor_parallel_sizes", "pipeline_parallel_sizes", "max_batch_sizes"))
        require(self.engine in INFERENCE_ENGINES, f"{p}.engine", self.engine, "is not an inference engine",
                f"use one of {list(INFERENCE_ENGINES)}")
        _members(self, p, "weight_formats", WEIGHT_FORMATS)
        _members(self, p, "kv_cache_formats", KV_FORMATS)
        _members(self, p, "expert_parallel", (False, True))
        for name in ("start_id", "end_id"):
            value = getattr(self, name)
            require(0 <= value < self.vocab_size, f"{p}.{name}", value,
                    f"is not a token id of the {self.vocab_size}-token vocabulary",
                    f"use an id in [0, {self.vocab_size})")


@dataclass
class SearchConfig:
    model_family: str = "gpt3"
    model: ModelOverrides = field(default_factory=ModelOverrides)
    train_settings: TrainSettings = field(default_factory=TrainSettings)
    inference_settings: InferenceSettings = field(default_factory=InferenceSettings)

    @property
    def finetune(self) -> bool:
        """A fine-tuning search: the model is model.hf_config's, the budget the data."""
        return self.model_family == FINETUNE

    def __post_init__(self) -> None:
        planned = family_names(planner_only=True)
        require(self.model_family in planned + (FINETUNE,), "search_config.model_family", self.model_family,
                "no planner for this family yet", f"use one of {list(planned) + [FINETUNE]}")
        self._check_finetune()
        decoder_seq = self.train_settings.decoder_seq_length
        encdec = [n for n in planned if family(n).arch.encoder_decoder]
        require(decoder_seq is None or (not self.finetune and family(self.model_family).arch.encoder_decoder),
                "search_config.train_settings.decoder_seq_length", decoder_seq,
                f"only encoder-decoder families ({encdec}) have a decoder length",
                f"remove it (null): a {self.model_family} model has one sequence, train_settings.seq_length")
        context, seq = self.model.context_length, self.train_settings.seq_length
        require(context is None or seq <= context, "search_config.train_settings.seq_length", seq,
                f"is above the model's context of {context} tokens (search_config.model.context_length)",
                f"use a sequence length of at most {context}")

    def _check_finetune(self) -> None:
        """Keys that belong to one kind of search only, and the fine-tuning batch rule."""
        ts, m, p = self.train_settings, self.model, "search_config"
        if not self.finetune:
            for key, value in (("model.hf_config", m.hf_config), ("train_settings.seq_lengths", ts.seq_lengths),
                               ("train_settings.global_batch_tokens", ts.global_batch_tokens),
                               ("train_settings.dataset_tokens_in_m", ts.dataset_tokens_in_m),
                               ("train_settings.methods", ts.methods)):
                require(value is None, f"{p}.{key}", value, f"belongs to fine-tuning searches, not to a "
                        f"{self.model_family} pretraining search", "remove it (null), or search a finetune/* config")
            return
        require(m.hf_config is not None, f"{p}.model.hf_config", m.hf_config,
                "the fine-tuning search needs the model's Hugging Face config",
                "set search_config.model.hf_config=<model directory, config.json or hub id>")
        require(not m.given and m.ffn_hidden_size is None and m.num_kv_heads is None, f"{p}.model", "explicit shape",
                "a fine-tuned model's shape comes from its Hugging Face config",
                "remove the shape keys and set search_config.model.hf_config")
        require(ts.model_size_in_b is None, f"{p}.train_settings.model_size_in_b", ts.model_size_in_b,
                "the fine-tuned model's size is its config's", "remove it (null)")
        require(ts.dataset_tokens_in_m is not None, f"{p}.train_settings.dataset_tokens_in_m", None,
                "a fine-tuning search needs the data's size", "set dataset_tokens_in_m=<tokens per epoch, millions>")
        tokens = ts.global_batch_tokens
        require(tokens is not None or ts.global_batch_size is not None, f"{p}.train_settings.global_batch_tokens",
                None, "a fine-tuning search needs its batch", "set global_batch_tokens (tokens per optimizer step)")
        require(tokens is None or ts.global_batch_size is None, f"{p}.train_settings.global_batch_size",
                ts.global_batch_size, f"was given with global_batch_tokens={tokens}",
                "give one: tokens per step (the same work at every sequence length) or sequences per step")
        key = "global_batch_tokens" if tokens is not None else "global_batch_size"
        tokens = ts.batch_tokens()
        for seq in ts.seq_lengths or [ts.seq_length]:
            require(tokens % seq == 0, f"{p}.train_settings.{key}", getattr(ts, key),
                    f"is not a whole number of {seq}-token sequences",
                    f"use a multiple of every sequence length searched (e.g. {max(ts.seq_lengths or [seq]) * 64})")


@dataclass
class AppConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    search_config: SearchConfig = field(default_factory=SearchConfig)
    base_results_dir: str = "results"  # results go to <base_results_dir>/<search_config>/
    run_training_hp_search: bool = True
    run_inference_hp_search: bool = False
    dry_run: bool = False  # plan only: print the candidate table and stop
    memory_check: Optional[str] = None  # traced | analytic; null: traced when trials launch, analytic for dry runs
    detach: bool = False  # submit the trials and exit; re-run the same command to collect
    cancel: bool = False  # cancel this search's jobs that have no result yet, then exit
    wait_for_lock: bool = False  # another orchestrator holds the results folder: wait instead of exit 2
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        require(self.memory_check is None or self.memory_check in MEMORY_CHECKS, "memory_check",
                self.memory_check, "is not a memory check",
                f"use one of {list(MEMORY_CHECKS)} (traced: the engine's model under fake tensors; analytic: "
                "the formula), or null for traced when trials launch and analytic for dry runs")
        name = self.search_config.model_family
        covered = [n for n in family_names() if family(n).trial.inference]
        searched = name == FINETUNE or family(name).trial.inference  # a fine-tuning model's family: plan_inference's check
        require(not self.run_inference_hp_search or searched, "run_inference_hp_search",
                self.run_inference_hp_search, f"the inference search covers decoder-only families ({covered}), not {name}",
                f"set run_inference_hp_search=false (the training search runs for it), or search a config of "
                f"{' or '.join(covered)}")
        precision = self.search_config.train_settings.precision
        require(precision is None or self.gpu.supports(precision), "search_config.train_settings.precision",
                precision, f"gpu={self.gpu.name} has no {precision} (gpu.peak_tflops.{precision} is null)",
                "set search_config.train_settings.precision=fp16 (trained with dynamic loss scaling) or fp32, or null "
                f"for this GPU's default ({self.gpu.default_precision()})")
        methods = self.search_config.train_settings.methods or []
        require("qlora" not in methods or self.gpu.memory_bandwidth_gbps is not None, "gpu.memory_bandwidth_gbps",
                None, "QLoRA's dequantisation time needs the GPU's memory bandwidth, and the gpu preset gives none",
                "set gpu.memory_bandwidth_gbps=<GB/s, from the datasheet>")
        optimizers = self.search_config.train_settings.optimizers or []
        require("adamw_8bit" not in optimizers or self.gpu.name != "cpu", "search_config.train_settings.optimizers",
                optimizers, "adamw_8bit is bitsandbytes' 8-bit AdamW, which runs on CUDA GPUs only, and gpu=cpu",
                "search adamw, sgd or sgd_momentum on CPU, or plan for a GPU preset")
        if "bf16" in (self.search_config.train_settings.master_weights or []):
            trained = training_precision(self)
            require(self.gpu.name != "cpu", "search_config.train_settings.master_weights",
                    self.search_config.train_settings.master_weights, "bf16 master weights are a GPU recipe, and "
                    "gpu=cpu trials train in fp32", "search master_weights=[fp32] on CPU, or plan for a GPU preset")
            require(trained == "bf16", "search_config.train_settings.master_weights",
                    self.search_config.train_settings.master_weights, f"bf16 master weights need bf16 training, and "
                    f"this search trains in {trained}", "set search_config.train_settings.precision=bf16 (a GPU with "
                    "bf16), or search master_weights=[fp32]")
        activation_offload = self.search_config.train_settings.activation_offload or []
        require(True not in activation_offload or self.gpu.host_ram_gib is not None, "gpu.host_ram_gib",
                self.gpu.host_ram_gib, "activation offload keeps the saved activations in host RAM, and the gpu preset "
                "gives no host RAM per node to plan it", "set gpu.host_ram_gib=<GiB per node>, or search "
                "activation_offload=[false]")
        offload = self.search_config.train_settings.offload or []
        asked = [o for o in offload if o != "none"]
        require(not asked or self.gpu.host_ram_gib is not None, "gpu.host_ram_gib", self.gpu.host_ram_gib,
                f"offload {asked} needs the host RAM per node to plan, and the gpu preset gives none",
                "set gpu.host_ram_gib=<GiB per node>, or search offload=[none]")


def searched_methods(app: AppConfig) -> tuple[str, ...]:
    """The fine-tuning methods a search compares: train_settings.methods, or for null every one the target
    runs: full; lora where peft is installed; qlora where bitsandbytes is, in 16-bit precision, on a GPU
    preset whose memory bandwidth prices its dequantisation."""
    ts = app.search_config.train_settings
    if ts.methods is not None:
        return tuple(ts.methods)
    out = ["full"]
    if importlib.util.find_spec("peft") is not None:
        out.append("lora")
        if (importlib.util.find_spec("bitsandbytes") is not None and training_precision(app) != "fp32"
                and app.gpu.memory_bandwidth_gbps is not None):
            out.append("qlora")
    return tuple(out)


def training_precision(app: AppConfig) -> str:
    """The precision the search plans and trains in: search_config.train_settings.precision, or for null
    the GPU's default (:meth:`GpuConfig.default_precision`: bf16 where it has it, else fp16)."""
    return app.search_config.train_settings.precision or app.gpu.default_precision()


def memory_check_mode(app: AppConfig) -> str:
    """The memory check this command runs: the key's value, else traced when training trials launch and
    analytic for a dry run (which then never imports torch)."""
    if app.memory_check is not None:
        return app.memory_check
    return "traced" if app.run_training_hp_search and not app.dry_run else "analytic"


def register() -> None:
    ConfigStore.instance().store(name="hp_tool_schema", node=AppConfig)


# Keys that moved (hardware to its own config group, each launcher backend's keys to its section of the cluster
# group); a config still using one fails naming the new key.
MOVED_KEYS = {
    "cluster.gpus_per_node": "search_config.train_settings.gpus_per_node",
    "cluster.gpu_memory_gb": "gpu.memory_gib",
    "cluster.gpu_peak_tflops": "gpu.peak_tflops.bf16",
    "cluster.intra_node_bandwidth_gbps": "gpu.intra_node_bandwidth_gbps",
    "cluster.inter_node_bandwidth_gbps": "gpu.inter_node_bandwidth_gbps",
    "cluster.memory_overhead_gb": "gpu.memory_overhead_gib",
    "cluster.gpu_hour_price": "gpu.price_per_gpu_hour",
    "search_config.train_settings.gpu_memory_gb": "gpu.memory_gib",
    "search_config.train_settings.dp_sharding": "search_config.train_settings.zero_stages",
    # memory in GiB (2**30 bytes, as torch.cuda.mem_get_info reports it) rather than GB
    "gpu.memory_gb": "gpu.memory_gib",
    "gpu.memory_overhead_gb": "gpu.memory_overhead_gib",
    "gpu.host_ram_gb": "gpu.host_ram_gib",
    # each backend's own keys in its section of the cluster group
    **{f"cluster.{k}": f"cluster.{section}.{k}" for section, cls in (("slurm", SlurmSettings), ("ray", RaySettings))
       for k in (f.name for f in dataclasses.fields(cls))},
}
GIB_FIX = "memory is in GiB now (GB x 0.931; the device's total as torch.cuda.mem_get_info reports it): use {new}=<GiB>"
MOVED_FIXES = {  # keys whose new form is not a plain copy of the value
    **{old: GIB_FIX.format(new=MOVED_KEYS[old]) for old in ("gpu.memory_gb", "gpu.memory_overhead_gb", "gpu.host_ram_gb")},
    "search_config.train_settings.dp_sharding":
        "use search_config.train_settings.zero_stages=[N]: none -> [0], gradients -> [2], full -> [3]",
}
GROUPS = ("cluster", "gpu", "search_config")


def unknown_key_error(key: str, value: object) -> ConfigError:
    """The error for a key the schema does not have: where it moved, or the closest real key."""
    if key in MOVED_KEYS:
        new = MOVED_KEYS[key]
        return ConfigError(key, value, f"was moved to {new}", MOVED_FIXES.get(
            key, f"use {new}=<value>" if key.startswith("cluster.") and new.startswith("cluster.") else
            f"use {new}=<value>, or choose a preset of the gpu group, e.g. gpu=h100_80gb"))
    parent, _, name = key.rpartition(".")
    siblings = _schema_children(parent)
    close = difflib.get_close_matches(name, siblings, n=1)
    fix = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else \
        f"remove it; the keys{' of ' + parent if parent else ''} are {siblings}"
    return ConfigError(key, value, "is not an hp_tool setting", fix)


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The schema as an OmegaConf tree, built once (about 25 ms); only read, merged from or copied."""
    return OmegaConf.structured(AppConfig)


def _schema_node(path: str) -> Any:
    """The schema's node at a dotted path, or None when the schema has no such key."""
    node: Any = _schema()
    for part in [p for p in path.split(".") if p]:
        node = _child(node, part)
        if node is None:
            return None
    return node


def _child(node: Any, key: str) -> Any:
    """A DictConfig's child node, or None (also for a key a structured node does not declare)."""
    if not isinstance(node, DictConfig):
        return None
    return node._get_node(key, validate_access=False, throw_on_missing_key=False)


def _schema_children(path: str) -> list[str]:
    node = _schema_node(path)
    return sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []


def _is_structured(node: Any) -> bool:
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def _unknown_keys(cfg: Any, schema: Any, prefix: str = "") -> list[str]:
    """Dotted keys of ``cfg`` that the dataclass schema lacks (free-form dict fields may hold any key)."""
    found = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        sub_schema, sub = _child(schema, key), cfg._get_node(key)
        if sub_schema is None:  # `key in schema` is False for keys whose value is ??? (MISSING)
            found.append(path)
            continue
        if _is_structured(sub_schema) and isinstance(sub, DictConfig):
            found += _unknown_keys(sub, sub_schema, path + ".")
    return found


def check_override_keys(overrides: List[str]) -> None:
    """Command-line overrides name keys the schema has, whether or not they come with ``+``, and give
    values of the key's type. Overrides are read with Hydra's own parser; sweeps, deletions and anything
    it cannot parse are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for arg in overrides:
        if arg.startswith("-"):  # Hydra's flags (-m, --cfg, ...)
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue
        key = override.key_or_group
        if key.startswith("hydra") or key in GROUPS or "@" in key or override.package:
            continue
        node = _schema_node(key)
        value_text = arg.partition("=")[2]
        if node is None and not _in_free_form_dict(key):
            raise unknown_key_error(key, value_text)
        if node is not None and not isinstance(node, DictConfig) and not override.is_delete() \
                and not override.is_sweep_override():
            _check_type(key, node, value_text, override.value())


def _check_type(key: str, node: Any, text: str, value: Any) -> None:
    """ConfigError when ``value`` does not fit the schema ``node`` of ``key`` (checked on a copy)."""
    try:
        copy.deepcopy(node)._set_value(value)
    except OmegaConfBaseException as exc:
        wanted = getattr(node._metadata.ref_type, "__name__", None) or "the documented type"
        problem = str(exc).splitlines()[0].replace("$VALUE_TYPE", type(value).__name__)
        raise ConfigError(key, text, f"is not a valid {wanted} ({problem.replace('$VALUE', str(value))})",
                          f"give a value of type {wanted}, as documented in the config file") from None


def _in_free_form_dict(key: str) -> bool:
    """True for keys inside a Dict[str, ...] field such as cluster.slurm.additional_sbatch_parameters."""
    parent = key.rpartition(".")[0]
    node = _schema_node(parent)
    return isinstance(node, DictConfig) and not _is_structured(node)


def to_app_config(cfg: DictConfig | Dict[str, Any]) -> AppConfig:
    """Validated dataclasses from a composed config; an unknown key, a wrong type or a missing required
    value raises ConfigError naming the key."""
    schema = _schema()
    composed = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    unknown = _unknown_keys(composed, schema)
    if unknown:
        raise unknown_key_error(unknown[0], OmegaConf.select(composed, unknown[0]))
    try:
        node = OmegaConf.merge(schema, composed)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "config")
        raise ConfigError(key, OmegaConf.select(composed, key, default=None), str(exc).splitlines()[0],
                          "give a value of the type documented in the config file") from None
    missing = sorted(OmegaConf.missing_keys(node))
    if missing:
        raise ConfigError(missing[0], "???", "is required and has no value",
                          f"set it on the command line, e.g. {missing[0]}=<value>")
    try:
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    except MissingMandatoryValue as exc:  # pragma: no cover - missing_keys catches these first
        raise ConfigError(str(exc.full_key), "???", "is required", "set it") from exc


register()
