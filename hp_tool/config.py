"""Typed schemas of hp_tool's Hydra config, registered with the ConfigStore.

An unknown key or a wrong type fails while Hydra composes (the message names the key); the checks in
``__post_init__`` run when the composed config is turned into these dataclasses (``to_app_config``),
before anything is planned, written or submitted. Each failure names the key, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from hp_tool.errors import ConfigError, require

CLUSTER_TYPES = ("local", "bcm", "auto")
FAMILIES = ("gpt3",)  # families the planner can size today
MAX_SEQ_LENGTH = 1 << 20
MAX_VOCAB = 1 << 22


def _positive(obj: object, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value > 0, f"{prefix}.{name}", value, "must be positive",
                "set a positive number (or null for the default)")


def _positive_list(obj: object, prefix: str, names: tuple[str, ...], allow_zero: bool = False) -> None:
    for name in names:
        values = getattr(obj, name)
        if values is None:
            continue
        key = f"{prefix}.{name}"
        require(len(values) > 0, key, values, "is an empty list",
                "give at least one value, or null for the heuristic default")
        low = 0 if allow_zero else 1
        bad = [v for v in values if v < low]
        require(not bad, key, values, f"has values below {low}: {bad}", f"use integers >= {low}")


def _seq_and_vocab(prefix: str, seq: Optional[int], vocab: int) -> None:
    if seq is not None:
        require(1 <= seq <= MAX_SEQ_LENGTH, f"{prefix}.seq_length", seq, "is not a usable sequence length",
                f"use a length between 1 and {MAX_SEQ_LENGTH} tokens, e.g. 2048")
    require(2 <= vocab <= MAX_VOCAB, f"{prefix}.vocab_size", vocab, "is not a usable vocabulary size",
            f"use a size between 2 and {MAX_VOCAB}, e.g. 51200")


@dataclass
class WandbConfig:
    enable: bool = False  # log trials and the summary to Weights & Biases
    api_key_file: Optional[str] = None  # file whose first line is the API key; never logged or copied
    project: str = "hp_tool"


@dataclass
class ClusterConfig:
    """Where trials run and what each node offers."""

    type: str = "auto"  # local | bcm (SLURM) | auto (SLURM when sbatch is reachable, else local)
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    exclusive: bool = True
    constraint: Optional[str] = None
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    gpu_peak_tflops: float = 312.0  # dense bf16 peak per GPU (A100 312, H100/H200 989)
    intra_node_bandwidth_gbps: float = 200.0  # GB/s per GPU within a node
    inter_node_bandwidth_gbps: float = 25.0  # GB/s per GPU across nodes
    memory_overhead_gb: float = 3.0  # calibrated per-GPU framework overhead (context, buffers)
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None  # sbatch --mem, e.g. "0" for the whole node
    job_name_prefix: str = "hp_tool:"
    container_image: Optional[str] = None
    container_mounts: List[str] = field(default_factory=list)
    srun_args: List[str] = field(default_factory=list)
    setup: List[str] = field(default_factory=list)  # shell lines run before each trial
    additional_sbatch_parameters: Dict[str, str] = field(default_factory=dict)
    gpu_hour_price: Optional[float] = None  # dollars per GPU-hour, for cost estimates
    max_parallel_runs: int = 1  # trials running at once

    def __post_init__(self) -> None:
        require(self.type in CLUSTER_TYPES, "cluster.type", self.type, "unknown cluster type",
                f"use one of {list(CLUSTER_TYPES)}")
        require(self.type != "bcm" or bool(self.partition), "cluster.partition", self.partition,
                "is required for a SLURM cluster", "add cluster.partition=<partition> to the command")
        _positive(self, "cluster", ("gpus_per_node", "gpu_memory_gb", "gpu_peak_tflops",
                                    "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps",
                                    "cpus_per_task", "gpu_hour_price", "max_parallel_runs"))
        require(self.memory_overhead_gb >= 0, "cluster.memory_overhead_gb", self.memory_overhead_gb,
                "must not be negative", "measure the framework overhead per GPU, in GB")
        require(self.memory_overhead_gb < self.gpu_memory_gb, "cluster.memory_overhead_gb",
                self.memory_overhead_gb, f"leaves nothing of gpu_memory_gb={self.gpu_memory_gb}",
                "use a value well below the GPU memory")


@dataclass
class ModelOverrides:
    """Explicit shape; null = from the family's table for the model size."""

    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    ffn_hidden_size: Optional[int] = None

    def __post_init__(self) -> None:
        _positive(self, "search_config.model", ("num_layers", "hidden_size", "num_attention_heads",
                                                "ffn_hidden_size"))
        given = [self.num_layers, self.hidden_size, self.num_attention_heads]
        require(all(v is None for v in given) or all(v is not None for v in given),
                "search_config.model", given, "a partial shape was given",
                "set num_layers, hidden_size and num_attention_heads together, or none of them")

    @property
    def given(self) -> bool:
        return self.num_layers is not None


@dataclass
class TrainSettings:
    """The training search. Lists set to null take the heuristic defaults for the model size."""

    model_size_in_b: Optional[float] = None  # null = recommend from the budget below
    num_nodes: int = 1
    gpus_per_node: Optional[int] = None  # null = cluster.gpus_per_node
    gpu_memory_gb: Optional[float] = None  # null = cluster.gpu_memory_gb
    max_training_days: float = 5.0
    limit_search_runs: int = 100  # most trials to launch
    output_top_n: int = 10
    max_steps_per_run: int = 50
    max_minutes_per_run: float = 20.0
    tflops_per_gpu: float = 140.0  # achieved TFLOPS per GPU assumed for sizing and days to train
    num_tokens_in_b: float = 300.0
    vocab_size: int = 51200
    seq_length: int = 2048
    global_batch_size: Optional[int] = None  # null = table default for the size and seq length
    precision: str = "bf16"
    dp_sharding: str = "full"  # none (DDP) | gradients | full (FSDP2)
    memory_margin: float = 0.05  # fraction of GPU memory kept free when pruning
    tensor_parallel_sizes: Optional[List[int]] = None
    pipeline_parallel_sizes: Optional[List[int]] = None
    micro_batch_sizes: Optional[List[int]] = None
    act_ckpt_layers: Optional[List[int]] = None  # layers per pipeline stage recomputed
    min_model_parallel_size: Optional[int] = None
    max_model_parallel_size: Optional[int] = None

    def __post_init__(self) -> None:
        p = "search_config.train_settings"
        _positive(self, p, ("model_size_in_b", "num_nodes", "gpus_per_node", "gpu_memory_gb",
                            "max_training_days", "limit_search_runs", "output_top_n",
                            "max_steps_per_run", "max_minutes_per_run", "tflops_per_gpu",
                            "num_tokens_in_b", "global_batch_size", "min_model_parallel_size",
                            "max_model_parallel_size"))
        _seq_and_vocab(p, self.seq_length, self.vocab_size)
        _positive_list(self, p, ("tensor_parallel_sizes", "pipeline_parallel_sizes", "micro_batch_sizes"))
        _positive_list(self, p, ("act_ckpt_layers",), allow_zero=True)
        require(self.precision in ("bf16", "fp16", "fp32"), f"{p}.precision", self.precision,
                "unknown precision", "use bf16, fp16 or fp32")
        require(self.dp_sharding in ("none", "gradients", "full"), f"{p}.dp_sharding", self.dp_sharding,
                "unknown sharding", "use none (DDP), gradients or full (FSDP)")
        require(0 <= self.memory_margin < 1, f"{p}.memory_margin", self.memory_margin,
                "must be a fraction in [0, 1)", "e.g. 0.05 keeps 5% of GPU memory free")
        lo, hi = self.min_model_parallel_size, self.max_model_parallel_size
        require(lo is None or hi is None or lo <= hi, f"{p}.min_model_parallel_size", lo,
                f"exceeds max_model_parallel_size={hi}", "make min <= max")


@dataclass
class InferenceSettings:
    vocab_size: int = 51200
    start_id: int = 50256
    end_id: int = 50256
    input_seq_len: int = 60
    output_seq_len: int = 20
    max_latency_ms: float = 1200.0
    top_n: int = 10
    tensor_parallel_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    pipeline_parallel_sizes: List[int] = field(default_factory=lambda: [1])
    max_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 8, 16, 32, 64, 256])

    def __post_init__(self) -> None:
        p = "search_config.inference_settings"
        _positive(self, p, ("input_seq_len", "output_seq_len", "max_latency_ms", "top_n"))
        _seq_and_vocab(p, None, self.vocab_size)
        _positive_list(self, p, ("tensor_parallel_sizes", "pipeline_parallel_sizes", "max_batch_sizes"))
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

    def __post_init__(self) -> None:
        require(self.model_family in FAMILIES, "search_config.model_family", self.model_family,
                "no planner for this family yet", f"use one of {list(FAMILIES)}")


@dataclass
class AppConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    search_config: SearchConfig = field(default_factory=SearchConfig)
    base_results_dir: str = "results"  # results go to <base_results_dir>/<search_config>/
    run_training_hp_search: bool = True
    run_inference_hp_search: bool = False
    dry_run: bool = False  # plan only: print the candidate table and stop
    detach: bool = False  # submit the trials and exit; re-run the same command to collect
    cancel: bool = False  # cancel this search's jobs that have no result yet, then exit
    wandb: WandbConfig = field(default_factory=WandbConfig)


def register() -> None:
    ConfigStore.instance().store(name="hp_tool_schema", node=AppConfig)


def to_app_config(cfg: DictConfig | Dict[str, Any]) -> AppConfig:
    """Validated dataclasses from a composed config; a missing required value names its key."""
    node = OmegaConf.structured(AppConfig)
    node = OmegaConf.merge(node, cfg)
    missing = sorted(OmegaConf.missing_keys(node))
    if missing:
        raise ConfigError(missing[0], "???", "is required and has no value",
                          f"set it on the command line, e.g. {missing[0]}=<value>")
    try:
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    except MissingMandatoryValue as exc:  # pragma: no cover - missing_keys catches these first
        raise ConfigError(str(exc.full_key), "???", "is required", "set it") from exc


register()
