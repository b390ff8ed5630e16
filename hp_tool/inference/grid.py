"""The inference grid: TP x PP x expert parallelism x formats x batch size, the validity filter, the memory check
and the serving-time model's prediction. Pure, no torch.

Every candidate keeps its verdict and the reason: ``valid``, ``invalid`` (the layout cannot be built
for this model or node), ``over_memory`` (predicted not to fit in one GPU's memory) or ``over_slo`` (predicted to
miss ``max_ttft_ms`` or ``max_tpot_ms``: hp_tool/estimate/serving.py). Every layout that can be built carries its
predicted time to first token, time per output token, batch latency and output tokens per second per GPU. The per-config
YAML the worker reads (:class:`InferenceJobConfig`) is defined here too, so that planning and the worker
share one contract without the planner importing torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from hp_tool.architectures import Shape, layer_parameters, vocab_parallel_parameters
from hp_tool.config import InferenceSettings
from hp_tool.errors import ConfigError, require
from hp_tool.estimate.layout import GIB, Hardware, Layout
from hp_tool.estimate.serving import (KV_BYTES, WEIGHT_BYTES, ServingGpu, ServingLayout, ServingTime,
                                      expert_excess_parameters, kv_token_bytes, serving_time)
from hp_tool.contracts.inference import (SERVING_ENGINES, InferenceJobConfig, dump_job_config,  # noqa: F401
                                         load_job_config)

IS = "search_config.inference_settings"
FP32_BYTES, HALF_BYTES = 4, 2


def make_config_id(family: str, label: str, tp: int, pp: int, batch_size: int, weights: Optional[str] = None,
                   kv_cache: Optional[str] = None, expert_parallel: bool = False) -> str:
    """The only builder of inference config ids, e.g. ``gpt3_241k_tp2_pp1_bs4``; expert parallelism and a weight or
    KV cache format other than the served precision are named: ``mixtral_46.7b_tp4_pp1_bs64_ep_wfp8_kvfp8``."""
    return f"{family}_{label}_tp{tp}_pp{pp}_bs{batch_size}" + ("_ep" if expert_parallel else "") + \
        (f"_w{weights}" if weights else "") + (f"_kv{kv_cache}" if kv_cache else "")


@dataclass(frozen=True)
class InferenceCandidate:
    """One layout of the grid and the planner's verdict on it."""

    config_id: str
    tp: int
    pp: int
    batch_size: int
    status: str  # valid | invalid | over_memory | over_slo
    reason: Optional[str] = None
    memory_gib: Optional[float] = None  # predicted peak per GPU, GiB
    predicted: Optional[ServingTime] = None  # the serving-time model's, for a layout that can be built
    weights: str = "bf16"  # the weights' format (hp_tool/estimate/serving.py WEIGHT_FORMATS)
    kv_cache: str = "bf16"  # the KV cache's (KV_FORMATS)
    expert_parallel: bool = False  # a mixture of experts' experts whole on the TP ranks (EP = TP)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


def inference_shape(shape: Shape, settings: InferenceSettings) -> Shape:
    """The served model: the chosen shape with the inference vocabulary."""
    return dataclasses.replace(shape, vocab_size=settings.vocab_size)


def layout_problem(shape: Shape, tp: int, pp: int, gpus_per_node: int) -> Optional[str]:
    """Why a TP x PP layout cannot serve this model on one node, or None when it can: the training layout's
    rules (heads and kv heads over TP, the pipeline split), then the server's own (one node)."""
    problems = Layout.of(tp=tp, pp=pp).problems(shape)
    if problems:
        return problems[0].reason
    if tp * pp > gpus_per_node:
        return f"TP*PP={tp * pp} exceeds the {gpus_per_node} GPUs of one node"
    return None


def check_settings(shape: Shape, settings: InferenceSettings, gpus_per_node: int) -> None:
    """Checks that need the model: a key whose every listed value is unusable, a too-long sequence."""
    tokens = settings.input_seq_len + settings.output_seq_len
    require(tokens <= shape.seq_length, f"{IS}.output_seq_len", settings.output_seq_len,
            f"input_seq_len + output_seq_len = {tokens} tokens exceeds the model's {shape.seq_length} "
            "positions", f"keep the sum at most {shape.seq_length} (or raise train_settings.seq_length)")
    tps = settings.tensor_parallel_sizes
    bad_tp = {tp: layout_problem(shape, tp, 1, gpus_per_node) for tp in tps}
    if all(bad_tp.values()):
        raise ConfigError(f"{IS}.tensor_parallel_sizes", tps, "no value is usable: " +
                          "; ".join(bad_tp.values()),
                          f"use TP values that divide the {shape.num_attention_heads} heads and fit in "
                          f"one node of {gpus_per_node} GPUs, e.g. [1]")
    pps = settings.pipeline_parallel_sizes
    bad_pp = {pp: layout_problem(shape, 1, pp, gpus_per_node) for pp in pps}
    if all(bad_pp.values()):
        raise ConfigError(f"{IS}.pipeline_parallel_sizes", pps, "no value is usable: " +
                          "; ".join(bad_pp.values()),
                          f"use PP values that divide the {shape.num_layers} layers, e.g. [1]")
    if settings.expert_parallel and False not in settings.expert_parallel:
        bad_ep = {tp: expert_parallel_problem(shape, settings, tp) for tp in tps}
        if all(bad_ep.values()):
            raise ConfigError(f"{IS}.expert_parallel", settings.expert_parallel, "no layout can use it: " +
                              "; ".join(dict.fromkeys(bad_ep.values())),
                              "use expert_parallel=null (searched where it applies), or a list with false")


def kv_cache_bytes(shape: Shape, tp: int, pp: int, batch: int, tokens: int, bytes_per_value: float) -> float:
    """Keys and values of one stage's layers for ``batch`` x ``tokens`` positions on one GPU, bytes (the serving
    model's per token: serving.kv_token_bytes)."""
    return batch * tokens * kv_token_bytes(shape, tp, pp, bytes_per_value)


def step_activation_bytes(shape: Shape, tp: int, batch: int, seq: int, bytes_per_value: int) -> float:
    """Live activations of one forward over ``seq`` new tokens (the prompt's is the largest), bytes.

    A few hidden-size tensors, the MLP's widened tensor and the attention scores of the local heads
    (SDPA's math kernel on CPU materialises them), plus fp32 logits of the last position.
    """
    hidden = batch * seq * (4 * shape.hidden_size + shape.ffn_hidden_size / tp) * bytes_per_value
    scores = batch * (shape.num_attention_heads / tp) * seq * seq * bytes_per_value
    logits = batch * shape.vocab_size * FP32_BYTES
    return hidden + scores + logits


def weight_bytes(shape: Shape, tp: int, pp: int, bytes_per_value: float, expert_parallel: bool = False) -> float:
    """Weights on the most loaded GPU: its stage's layer shard (with expert parallelism, its experts whole:
    serving.expert_excess_parameters) plus the whole embedding and/or head."""
    stage = shape.num_layers // pp
    layers = stage * layer_parameters(shape) / tp + stage * expert_excess_parameters(shape, tp, expert_parallel)
    embed, head = vocab_parallel_parameters(shape, 1, pp)  # the server keeps the vocabulary whole on TP ranks
    first = layers + embed + (head if pp == 1 else 0.0)
    last = layers + head
    return max(first, last) * bytes_per_value


def memory_gib(shape: Shape, settings: InferenceSettings, tp: int, pp: int, batch: int,
              hw: Hardware, bytes_per_value: int, weights: Optional[str] = None, kv_cache: Optional[str] = None,
              expert_parallel: bool = False) -> float:
    """Predicted peak memory per GPU in GiB: weights (in their format, split as the layout splits them) + KV cache
    (in its) + one step's activations (in the served precision) + overhead."""
    tokens = settings.input_seq_len + settings.output_seq_len
    total = (weight_bytes(shape, tp, pp, WEIGHT_BYTES[weights] if weights else bytes_per_value, expert_parallel)
             + kv_cache_bytes(shape, tp, pp, batch, tokens, KV_BYTES[kv_cache] if kv_cache else bytes_per_value)
             + step_activation_bytes(shape, tp, batch, settings.input_seq_len, bytes_per_value))
    return total / GIB + hw.memory_overhead_gib


def serving_gpu(hw: Hardware, precision: str) -> ServingGpu:
    """The serving-time model's view of the cluster's GPU: its peak in the served precision (and fp8's)."""
    return ServingGpu(hw.gpu_memory_gib, hw.memory_bandwidth_gbps, {precision: hw.peak_tflops, "fp8": hw.fp8_peak_tflops},
                      hw.intra_node_bandwidth_gbps, hw.memory_overhead_gib)


def predict(shape: Shape, settings: InferenceSettings, tp: int, pp: int, batch: int, gpu: ServingGpu,
            precision: str, weights: Optional[str] = None, kv_cache: Optional[str] = None,
            expert_parallel: bool = False) -> ServingTime:
    """The serving-time model's TTFT, TPOT, latency and throughput of a layout serving ``batch`` requests of the
    settings' lengths on ``gpu`` (``serving_gpu``), its weights and KV cache in their formats (default: the served
    precision), its experts whole on the TP ranks where ``expert_parallel``."""
    layout = ServingLayout(tp, pp, batch, settings.input_seq_len, settings.output_seq_len, weights or precision,
                           kv_cache or precision, expert_parallel=expert_parallel)
    return serving_time(shape, layout, gpu)


def formats(settings: InferenceSettings, precision: str) -> list[tuple[Optional[str], Optional[str]]]:
    """The (weights, KV cache) formats the grid searches: the settings' lists, each left null the served precision
    (None: not named in the config id)."""
    weights = [None if w == precision else w for w in settings.weight_formats or [precision]]
    kv = [None if k == precision else k for k in settings.kv_cache_formats or [precision]]
    return [(w, k) for w in dict.fromkeys(weights) for k in dict.fromkeys(kv)]


def format_problem(settings: InferenceSettings, precision: str, weights: Optional[str], kv_cache: Optional[str],
                   hw: Hardware) -> Optional[str]:
    """Why the search's engine cannot serve these formats, or None: hp_tool's own decode loop serves the served
    precision alone; vLLM quantises to fp8 as it loads, and reads int8 / int4 / fp4 from a checkpoint quantised so
    (inference_settings.model_path); an fp8 KV cache needs fp8 tensor cores."""
    if weights is None and kv_cache is None:
        return None
    if not SERVING_ENGINES[settings.engine].formats:
        return (f"hp_tool's own decode loop serves {precision} weights and KV cache; {weights or precision} weights "
                f"and a {kv_cache or precision} KV cache need inference_settings.engine=vllm")
    if kv_cache == "fp8" and not hw.fp8_peak_tflops:
        return "an fp8 KV cache needs fp8 tensor cores (H100, H200, L4, L40S)"
    return None


def expert_parallel_values(shape: Shape, settings: InferenceSettings, tp: int) -> list[bool]:
    """Expert parallelism off and on as the grid searches it at ``tp``: the settings' list; null, both for a mixture
    of experts at TP > 1 where the engine runs it (at TP 1 it is the layout without it), else off alone (a dense
    model's grid is the same as before the dimension)."""
    if settings.expert_parallel is not None:
        return sorted(set(settings.expert_parallel))
    return [False, True] if shape.moe and tp > 1 and SERVING_ENGINES[settings.engine].expert_parallel else [False]


def expert_parallel_problem(shape: Shape, settings: InferenceSettings, tp: int) -> Optional[str]:
    """Why a layout at ``tp`` cannot split the experts whole over its TP ranks, or None: the model has experts, the
    engine runs expert parallelism (ServingEngine.expert_parallel), TP > 1 and no more ranks than experts."""
    if not shape.moe:
        return "a dense model has no experts to split (expert_parallel applies to a mixture of experts)"
    if not SERVING_ENGINES[settings.engine].expert_parallel:
        runs = [e.name for e in SERVING_ENGINES.values() if e.expert_parallel]
        return (f"inference_settings.engine={settings.engine} slices every expert over TP and does not run expert "
                f"parallelism; whole experts per TP rank need inference_settings.engine={' or '.join(runs)}")
    if tp == 1:
        return "expert parallelism splits the experts over the TP ranks, and TP=1 has one rank; use it at TP > 1"
    if tp > shape.num_experts:
        return (f"TP={tp} ranks exceed the {shape.num_experts} experts, so a rank would hold none; use TP <= "
                f"{shape.num_experts}")
    return None


def slo_problem(settings: InferenceSettings, predicted: ServingTime) -> Optional[tuple[str, str]]:
    """(the key, why) where a layout's prediction misses the settings' limit on time to first token or time per
    output token (the batch latency bound, max_latency_ms, judges the measured results), or None."""
    for key, limit, value in (("max_ttft_ms", settings.max_ttft_ms, predicted.ttft_s),
                              ("max_tpot_ms", settings.max_tpot_ms, predicted.tpot_s)):
        if limit is not None and 1e3 * value > limit:
            return key, f"predicted {key[4:].upper()} {1e3 * value:.4g} ms > {key}={limit:g}"
    return None


def build_grid(shape: Shape, label: str, settings: InferenceSettings, hw: Hardware,
               bytes_per_value: int, precision: Optional[str] = None) -> list[InferenceCandidate]:
    """Every TP x PP x expert parallelism x formats x batch candidate with its verdict and prediction, in that
    order."""
    precision = precision or ("fp32" if bytes_per_value == FP32_BYTES else "bf16")
    gpu = serving_gpu(hw, precision)
    out = []
    for tp in sorted(set(settings.tensor_parallel_sizes)):
        for pp in sorted(set(settings.pipeline_parallel_sizes)):
            problem = layout_problem(shape, tp, pp, hw.gpus_per_node)
            for ep in expert_parallel_values(shape, settings, tp):
                split = problem or (expert_parallel_problem(shape, settings, tp) if ep else None)
                for weights, kv_cache in formats(settings, precision):
                    bad = split or format_problem(settings, precision, weights, kv_cache, hw)
                    named = dict(weights=weights or precision, kv_cache=kv_cache or precision, expert_parallel=ep)
                    for bs in sorted(set(settings.max_batch_sizes)):
                        cid = make_config_id(shape.family, label, tp, pp, bs, weights, kv_cache, ep)
                        if bad:
                            out.append(InferenceCandidate(cid, tp, pp, bs, "invalid", bad, **named))
                            continue
                        need = memory_gib(shape, settings, tp, pp, bs, hw, bytes_per_value, weights, kv_cache, ep)
                        predicted = predict(shape, settings, tp, pp, bs, gpu, precision, weights, kv_cache, ep)
                        slo = slo_problem(settings, predicted)
                        if need > hw.gpu_memory_gib:
                            reason = f"needs {need:.2f} GiB per GPU, more than the {hw.gpu_memory_gib:g} GiB available"
                            status = "over_memory"
                        else:
                            status, reason = ("over_slo", slo[1]) if slo else ("valid", None)
                        out.append(InferenceCandidate(cid, tp, pp, bs, status, reason, need, predicted, **named))
    return out


def plan_grid(shape: Shape, label: str, settings: InferenceSettings, hw: Hardware,
              bytes_per_value: int, precision: Optional[str] = None) -> list[InferenceCandidate]:
    """The checked grid; ConfigError when the settings leave nothing that can run."""
    shape = inference_shape(shape, settings)
    check_settings(shape, settings, hw.gpus_per_node)
    grid = build_grid(shape, label, settings, hw, bytes_per_value, precision)
    if not any(c.status == "valid" for c in grid) and any(c.status == "over_slo" for c in grid):
        near = min((c for c in grid if c.status == "over_slo"), key=lambda c: c.predicted.ttft_s + c.predicted.tpot_s)
        key = slo_problem(settings, near.predicted)[0]
        raise ConfigError(f"{IS}.{key}", getattr(settings, key),
                          f"no layout that fits is predicted to meet it (nearest: {near.config_id}, {near.reason})",
                          f"raise {key}, or search smaller batch sizes or larger TP")
    if not any(c.status == "valid" for c in grid):
        smallest = min((c for c in grid if c.memory_gib is not None), key=lambda c: c.memory_gib)
        raise ConfigError(f"{IS}.max_batch_sizes", settings.max_batch_sizes,
                          f"no layout fits in GPU memory (smallest: {smallest.config_id}, "
                          f"{smallest.reason})", "use smaller batch sizes or larger TP / PP")
    return grid
