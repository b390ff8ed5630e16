"""Model size and the runnable base training config for it. Pure, no I/O.

The base config is a TrialSpec in ``full`` mode: the shape, optimizer and schedule, global batch size
and the table's starting TP/PP for the whole cluster, on the torch engine with FSDP2 full sharding
(ZeRO-3), which runs every TP/PP; the search then finds the engine, stage and offload.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from hp_tool.architectures import (Shape, active_parameters, count_parameters, lr_for, pipeline_problem,
                                   shape_for_size)
from hp_tool.config import (SIZING_MFU, trial_device, AppConfig, LoraSettings, ModelOverrides, TrainSettings, searched_methods,
                            training_precision)
from hp_tool.families.methods import linear_shapes
from hp_tool.errors import ConfigError, require
from hp_tool.estimate.layout import EFFICIENCY_FIELDS, Hardware
from hp_tool.recipe import Adapters, Recipe
from hp_tool.sizing import days_to_train, format_days, recommend_model_size_b, size_label
from hp_tool.families import family
from hp_tool.hf_config import HFModel, load_hf_model
from hp_tool.tables import lookup
from hp_tool.contracts.spec import (FullRunSpec, LoraSpec, ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec,
                                TrialSpec)
from hp_tool.dimensions import trial_id
from hp_tool.words import plural, processes

TS = "search_config.train_settings"

# Fine-tuning a published model (model_family finetune): AdamW at finetune_lr(method) with 3% warm-up, then cosine
# decay to a tenth of the peak.
FINETUNE_WARMUP_RATIO = 0.03
MIN_LR_RATIO = 0.1  # the cosine decay ends at this fraction of the peak learning rate


def finetune_lr(method: str) -> float:
    """The peak learning rate of fine-tuning by ``method``, the one default of every fine-tuning spec (the base
    config, each candidate, ``python3 -m hp_tool.train``): full fine-tuning 2e-5, the recipe of Stanford Alpaca
    and of Llama 2's and Mistral's chat fine-tunes; LoRA and QLoRA 2e-4, peft's and Meta's llama-recipes' (the
    adapters start at zero and are few: they need a larger step than the whole model)."""
    return 2e-5 if method == "full" else 2e-4


def with_lr(training: TrainingSpec, lr: float) -> TrainingSpec:
    """``training`` at peak learning rate ``lr``, its cosine decay ending at ``MIN_LR_RATIO`` of it."""
    return replace(training, lr=lr, min_lr=round(MIN_LR_RATIO * lr, 10))


@dataclass(frozen=True)
class Cluster:
    """The full run's machines: its shape (train_settings) on the GPUs of the ``gpu`` preset."""

    num_nodes: int
    hw: Hardware
    gpu_hour_price: float | None
    gpu_name: str
    sizing_tflops_per_gpu: float  # achieved TFLOPS per GPU assumed for the size and days-to-train rule

    @property
    def gpus(self) -> int:
        return self.num_nodes * self.hw.gpus_per_node


def resolve_cluster(app: AppConfig) -> Cluster:
    ts, gpu = app.search_config.train_settings, app.gpu
    precision = training_precision(app)
    peak = gpu.peak_tflops_for(precision)
    hw = Hardware(
        gpus_per_node=ts.gpus_per_node,
        gpu_memory_gib=gpu.memory_gib,
        peak_tflops=peak,
        intra_node_bandwidth_gbps=gpu.intra_node_bandwidth_gbps,
        inter_node_bandwidth_gbps=gpu.inter_node_bandwidth_gbps,
        memory_overhead_gib=gpu.memory_overhead_gib,
        host_ram_gib=gpu.host_ram_gib,
        host_cpu_cores=gpu.host_cpu_cores,
        host_memory_bandwidth_gbps=gpu.host_memory_bandwidth_gbps,
        pcie_bandwidth_gbps=gpu.pcie_bandwidth_gbps,
        memory_bandwidth_gbps=gpu.memory_bandwidth_gbps or Hardware.memory_bandwidth_gbps,
        fp8_peak_tflops=gpu.peak_tflops.fp8,
        device_is_host=trial_device(gpu.name) == "cpu",
        **{name: float(getattr(gpu.efficiency, name)) for name in EFFICIENCY_FIELDS},
    )
    sizing = ts.tflops_per_gpu if ts.tflops_per_gpu is not None else round(SIZING_MFU * peak, 1)
    return Cluster(ts.num_nodes, hw, gpu.price_per_gpu_hour, gpu.name, sizing)


@dataclass(frozen=True)
class ModelChoice:
    shape: Shape
    size_b: float  # requested (or recommended) size in billions; a mixture of experts' active parameters
    num_parameters: int  # of the shape actually built (a mixture of experts: all its experts)
    lr: float
    recommended: bool
    label: str  # for file names: 5b, 126m, ...
    hf: Optional[HFModel] = None  # fine-tuning: the Hugging Face config the model comes from
    seq_lengths: tuple[int, ...] = ()  # fine-tuning: the sequence lengths searched (the shape has the longest)
    methods: tuple[str, ...] = ("full",)  # fine-tuning: the methods searched
    lora: Optional[LoraSettings] = None  # the adapters of lora and qlora

    def at(self, seq: int) -> Shape:
        """The model's shape at ``seq`` tokens per sequence."""
        return replace(self.shape, seq_length=seq)

    def recipe(self, method: str, precision: str) -> Recipe:
        """The recipe every layout of this model trained by ``method`` (with its adapters, if any) in
        ``precision`` starts from; the grid sets the rest."""
        if method == "full":
            return Recipe(precision=precision)
        lora = Adapters(self.lora.rank, self.lora.alpha, self.lora.dropout, lora_targets(self.shape, self.lora))
        return Recipe(precision=precision, method=method, lora=lora)

    @property
    def parameters_text(self) -> str:
        """"46.7B parameters" (a mixture of experts: ", 12.9B active" and its experts)."""
        text = f"{size_label(self.num_parameters).upper()} parameters"
        if self.shape.moe:
            text += (f", {size_label(active_parameters(self.shape)).upper()} active: top-{self.shape.top_k} of "
                     f"{self.shape.num_experts} experts")
        return text

    def sentence(self, days: float, cluster: Cluster, ts: TrainSettings, best: Optional[tuple[float, float]] = None
                 ) -> str:
        """The plan's headline: the model and the time to train it. ``days`` is the sizing estimate at
        ``tflops_per_gpu``; ``best``, (days, achieved TFLOPS per GPU) of the best predicted layout, gives the
        one time the headline states when there is one, and the sizing estimate is then named as the
        assumption it is."""
        gpus = processes(cluster.gpus, cluster.hw.device_is_host, f"{cluster.gpu_name} GPU")
        assumed = f"{cluster.sizing_tflops_per_gpu:g} TFLOPS per GPU (tflops_per_gpu)"
        if best is None:
            when = f"at {assumed} takes about {format_days(days)}"
        else:
            other = (f"the size was chosen assuming {assumed}, at which it would take" if self.recommended else
                     f"assuming {assumed} instead, it would take")
            when = (f"takes about {format_days(best[0])} with the best predicted layout ({best[1]:.3g} TFLOPS per "
                    f"GPU); {other} {format_days(days)}")
        if self.hf is not None:
            epochs = plural(float(ts.epochs), "epoch")
            return (f"Fine-tuning {self.hf.source} ({self.hf.model_type}, {self.parameters_text}, "
                    f"{self.shape.num_layers} layers x {self.shape.hidden_size} hidden) on "
                    f"{ts.dataset_tokens_in_m:g}M tokens x {epochs} at sequence lengths "
                    f"{list(self.seq_lengths)} with {gpus} {when}.")
        how = "Recommended model size" if self.recommended else "Model size"
        per_stack = " per stack" if self.shape.encoder_decoder else ""
        return (f"{how}: {self.parameters_text} ({self.shape.num_layers} layers{per_stack} x "
                f"{self.shape.hidden_size} hidden); training on {ts.num_tokens_in_b:g}B tokens with "
                f"{gpus} {when}.")


def choose_model(app: AppConfig, cluster: Cluster) -> ModelChoice:
    """The model to search for: an explicit shape, the given size, or the size the budget affords."""
    sc = app.search_config
    ts, ov = sc.train_settings, sc.model
    if sc.finetune:
        return finetune_model(ts, ov.hf_config, searched_methods(app))
    experts = _experts(facts := family(sc.model_family, "search_config.model_family"), ov, ts)
    decoder_seq = (ts.decoder_seq_length or facts.sizing.default_decoder_seq) if facts.arch.encoder_decoder else None
    if ov.given:
        heads = ov.num_attention_heads
        ffn = ov.ffn_hidden_size or facts.sizing.default_ffn(ov.hidden_size)
        kv = ov.kv_channels or facts.sizing.default_kv_channels
        shape = Shape(sc.model_family, ov.num_layers, ov.hidden_size, heads, ov.num_kv_heads or heads,
                      ffn, ts.vocab_size, ts.seq_length, kv, decoder_seq, **experts)
        _check_shape(shape)
        n, size = count_parameters(shape), active_parameters(shape) / 1e9
        return ModelChoice(shape, size, n, lr_for(sc.model_family, size), False, size_label(n))
    size, recommended = ts.model_size_in_b, False
    if size is None:
        size = recommend_model_size_b(sc.model_family, ts.max_training_days, cluster.gpus,
                                      cluster.sizing_tflops_per_gpu, ts.num_tokens_in_b)
        recommended = True
        require(size > 0, f"{TS}.max_training_days", ts.max_training_days,
                "the budget affords no model at all", "raise the days, nodes or TFLOPS, or set model_size_in_b")
    try:
        shape, lr = shape_for_size(sc.model_family, size, ts.vocab_size, ts.seq_length, decoder_seq)
    except ValueError as exc:
        raise ConfigError(f"{TS}.model_size_in_b", size, str(exc),
                          "choose another size or give search_config.model explicitly") from exc
    shape = replace(shape, **experts)
    return ModelChoice(shape, size, count_parameters(shape), lr, recommended, size_label(size * 1e9))


def _experts(facts, ov: ModelOverrides, ts: TrainSettings) -> dict:
    """A mixture of experts' Shape fields from search_config.model (an explicit shape, or over the sized
    one) and the planning imbalance; none for a dense family, where giving experts is an error."""
    if not facts.arch.moe:
        require(ov.num_experts is None and ov.top_k is None, "search_config.model.num_experts", ov.num_experts,
                f"model_family {facts.name} is dense", "use model_family moe for a mixture of experts, or null")
        return {}
    out = {"expert_imbalance": ts.expert_imbalance}
    if ov.num_experts is not None:
        out["num_experts"] = ov.num_experts
    if ov.top_k is not None:
        out["top_k"] = ov.top_k
    if ov.given:
        require(ov.num_experts is not None and ov.top_k is not None, "search_config.model.num_experts",
                ov.num_experts, "an explicit mixture-of-experts shape needs its experts and top_k",
                "set search_config.model.num_experts and top_k (Mixtral: 8 and 2)")
    return out


def finetune_model(ts: TrainSettings, hf_config: str, methods: tuple[str, ...] = ("full",)) -> ModelChoice:
    """The published model a fine-tuning search takes, from its Hugging Face config, at the longest sequence
    length searched (each checked against the model's positions), trained by ``methods``."""
    hf = load_hf_model(hf_config)
    seqs = tuple(sorted(set(ts.seq_lengths or [ts.seq_length])))
    for seq in seqs:
        hf.check_seq_length(seq, f"{TS}.seq_lengths" if ts.seq_lengths else f"{TS}.seq_length")
    shape = hf.shape(seqs[-1], ts.expert_imbalance)
    n = count_parameters(shape)
    if set(methods) - {"full"}:
        lora_targets(shape, ts.lora)  # checked before anything is written
    # the size the grid tables and the compute take: the parameters a token runs through (a mixture of experts'
    # active ones)
    return ModelChoice(shape, active_parameters(shape) / 1e9, n, finetune_lr("full"), False, size_label(n), hf, seqs,
                       methods, ts.lora)


def lora_targets(shape: Shape, lora: LoraSettings) -> tuple[str, ...]:
    """The linear modules the adapters go on (null: every linear of a layer), checked against the model:
    an unknown name, or a rank above a target's narrower side, is a ConfigError naming the key."""
    linears = linear_shapes(shape)
    targets = tuple(lora.target_modules or linears)
    unknown = [t for t in targets if t not in linears]
    require(not unknown, f"{TS}.lora.target_modules", list(targets), f"{unknown} are not linear modules of a "
            f"{shape.family} layer", f"use some of {list(linears)}, or null for all of them")
    narrowest = min(min(linears[t]) for t in targets)
    require(lora.rank <= narrowest, f"{TS}.lora.rank", lora.rank, f"exceeds the narrowest adapted width "
            f"({narrowest}): a low-rank update cannot be wider than the matrix", f"use a rank below {narrowest}")
    return targets


def run_tokens_b(sc) -> float:
    """Tokens the full run trains on, billions: a fine-tuning search's data times its epochs, else
    num_tokens_in_b."""
    ts = sc.train_settings
    return ts.dataset_tokens_in_m * ts.epochs / 1e3 if sc.finetune else ts.num_tokens_in_b


def _check_shape(shape: Shape) -> None:
    require(shape.kv_channels is not None or shape.hidden_size % shape.num_attention_heads == 0,
            "search_config.model.hidden_size", shape.hidden_size,
            f"not divisible by num_attention_heads={shape.num_attention_heads}",
            "use a multiple of the head count, or set search_config.model.kv_channels")


def _gbs_tp_pp(family_name: str, size_b: float) -> tuple[int, int, int]:
    """(the family's table batch: sequences at its reference length or tokens, per global batch),
    starting TP, starting PP."""
    return lookup(family(family_name).sizing.gbs_tp_pp, size_b, inclusive=True)


def global_batch_size(family_name: str, ts: TrainSettings, size_b: float, seq: Optional[int] = None,
                      finetune: bool = False) -> int:
    """The family's table GBS for the size at the run's sequence length (GPT-3's and T5's sequences halved
    for each doubling of the length beyond 2048 and 512; Llama's tokens per batch over the length). A
    fine-tuning search keeps the tokens per step (``TrainSettings.batch_tokens``) at every length ``seq``."""
    if finetune:
        return ts.batch_tokens() // (seq or ts.seq_length)
    if ts.global_batch_size is not None:
        return ts.global_batch_size
    return family(family_name).sizing.global_batch(_gbs_tp_pp(family_name, size_b)[0], ts.seq_length)


def schedule(family_name: str, tokens_b: float, seq: int, gbs: int, finetune: bool = False) -> tuple[int, int, int]:
    """(max_steps, warmup_steps, constant_steps) of the full run at the family's warm-up and constant
    fractions (NeMo's GPT-3: 0.15% warm-up, 16.6% constant; T5/mT5: 1% warm-up, no constant phase);
    fine-tuning: 3% warm-up, no constant phase."""
    facts = family(family_name)
    max_steps = max(1, int(tokens_b * 1e9 / (seq * gbs)))
    if finetune:
        return max_steps, int(FINETUNE_WARMUP_RATIO * max_steps), 0
    return max_steps, int(facts.sizing.warmup_ratio * max_steps), int(facts.sizing.constant_ratio * max_steps)


def base_spec(app: AppConfig, model: ModelChoice, cluster: Cluster) -> TrialSpec:
    """The runnable full-mode training config for the chosen model on the whole cluster."""
    sc = app.search_config
    ts, s = sc.train_settings, model.shape
    gbs = global_batch_size(s.family, ts, model.size_b, s.seq_length, sc.finetune)
    tokens_b = run_tokens_b(sc)
    max_steps, warmup, constant = schedule(s.family, tokens_b, s.seq_length, gbs, sc.finetune)
    _, tp, pp = _gbs_tp_pp(s.family, model.size_b)
    tp, pp = _fit_base_layout(s, tp, pp, cluster.gpus, cluster.hw.gpus_per_node)
    dp = cluster.gpus // (tp * pp)
    require(gbs % dp == 0, f"{TS}.global_batch_size", gbs,
            f"not divisible by the {dp} data-parallel replicas of the base layout (TP={tp}, PP={pp})",
            f"use a multiple of {dp}, or change num_nodes")
    return TrialSpec(
        trial_id=trial_id(s.family, model.label, dict(tp=tp, pp=pp, mbs=1, act_ckpt_layers=0, engine="torch",
                                                      zero_stage=3, seq_length=model_seq(model, s),
                                                      ep=1 if s.moe else None)),
        model=model_spec(s, model.num_parameters, model.hf),
        parallel=ParallelSpec(tp=tp, pp=pp, dp=dp, mbs=1, act_ckpt_layers=0, engine="torch", zero_stage=3),
        training=with_lr(TrainingSpec(global_batch_size=gbs, precision=training_precision(app), warmup_steps=warmup,
                                      constant_steps=constant, max_steps=max_steps), model.lr),
        resources=ResourcesSpec.of(cluster.hw, cluster.num_nodes, cluster.gpu_hour_price, cluster.gpu_name),
        run=RunSpec(mode="full", max_minutes=ts.max_training_days * 24 * 60, max_steps=max_steps,
                    stable_cv=0.0),
        full_run=FullRunSpec(cluster.num_nodes, dp, gbs, tokens_b, max_steps, ts.epochs if sc.finetune else None),
    )


def model_seq(model: ModelChoice, shape: Shape) -> Optional[int]:
    """The sequence length a trial id names: a fine-tuning search's (it searches several), else none."""
    return shape.seq_length if model.hf is not None else None


def model_spec(s: Shape, num_parameters: int, hf: Optional[HFModel] = None, method: str = "full",
               lora: Optional[LoraSpec] = None, fp8: bool = False) -> ModelSpec:
    """The TrialSpec model section of a shape (with the Hugging Face config it comes from, and what trains: the
    method and its adapters, whether its linears run in Float8; a layout's ``section_values(layout, "model")``)."""
    return ModelSpec(s.family, s.num_layers, s.hidden_size, s.num_attention_heads, s.num_kv_heads,
                     s.ffn_hidden_size, s.vocab_size, s.seq_length, init_method_std=init_std(s),
                     num_parameters=num_parameters, kv_channels=s.kv_channels,
                     decoder_seq_length=s.decoder_seq_length, qkv_bias=s.qkv_bias,
                     tied_embeddings=s.tied_embeddings, hf_config=None if hf is None else dict(hf.config),
                     method=method, lora=lora, fp8=fp8, num_experts=s.num_experts, top_k=s.top_k,
                     shared_expert_ffn_hidden_size=s.shared_expert_ffn)


def init_std(shape: Shape) -> float:
    """Weight init std, the family's: GPT-3 0.64/sqrt(h) (NeMo); Llama 0.02 (Meta's and transformers'
    default); T5/mT5 0.015 (NeMo)."""
    return shape.facts.sizing.init_std(shape)


def _fit_base_layout(s: Shape, tp: int, pp: int, gpus: int, gpn: int) -> tuple[int, int]:
    """The table's TP/PP, reduced until valid for this shape and cluster (small clusters, odd shapes)."""
    while tp > 1 and (s.num_attention_heads % tp or s.num_kv_heads % tp or tp > gpn or gpus % tp):
        tp //= 2
    while pp > 1 and (pipeline_problem(s, pp) or gpus % (tp * pp)):
        pp -= 1
    require(gpus % (tp * pp) == 0, f"{TS}.num_nodes", gpus // gpn,
            f"{gpus} GPUs cannot hold a TP={tp} x PP={pp} layout", "use a node count that is a power of two")
    return tp, pp


def days_for(model: ModelChoice, app: AppConfig, cluster: Cluster) -> float:
    return days_to_train(model.shape.family, model.size_b, cluster.gpus, cluster.sizing_tflops_per_gpu,
                         run_tokens_b(app.search_config), ndigits=None)
