"""The serving-time model (hp_tool/estimate/serving.py) against published serving runs: a scorecard and the fit of
its efficiencies.

    python3 benchmarks/published_serving_runs.py             # every row, then the summaries
    python3 benchmarks/published_serving_runs.py --summary   # the summaries only
    python3 benchmarks/published_serving_runs.py --fit       # the fitted ServingEfficiency constants only

It exits 1 when a target (``Targets``) is missed: the median |error| of throughput per GPU and of TPOT at most 15%
fitted on every row and at most 25% for each engine's rows fitted on the other engines'; the median Spearman over
groups at least 0.85; the pick within 5% of the best published layout in at least 80% of the groups.

Data: ``benchmarks/data/published_serving_runs.json`` (``--data`` for another copy): published LLM serving
measurements (FasterTransformer and Megatron-LM at fixed batches, TensorRT-LLM's performance tables and blogs,
LMDeploy, vLLM, SGLang, NVIDIA NIM, MLPerf) with the layout behind each: the model, its weights' format, the GPU,
TP and PP, the batch or the requests in flight, the prompt and output lengths, and what was measured (output
tokens/s, time to first token, time per output token, end-to-end latency). Values the source did not state are
written {"value": ..., "inferred": true, "from": ...}; ``value`` reads them.

How a row becomes a question (``express``; a row it cannot ask raises ``Unexpressible``, whose ``kind`` groups the
rows in the summary, never dropped):
- the model: a FasterTransformer GPT row's stated architecture (``Shape("gpt3", ...)``, FFN 4 x hidden), a shipped
  Hugging Face config (``hp_tool/hf_configs/``) or, for the published models hp_tool ships none for, the shape of
  their ``config.json`` (``SHAPES``, with the repository named); else kind "model";
- the GPU: its ``gpu`` preset (``GPU_PRESETS``) read into a ``ServingGpu``: memory, memory bandwidth, dense peaks
  by precision, NVLink bandwidth, the framework's overhead; an A100 whose memory the row does not state is the 80 GB
  part; GPUs without a preset (B200, GB200, RTX PRO 6000 Blackwell): kind "gpu";
- the weights' format from the row's quantization and precision (none + fp16 / bf16, fp8, int8 / int4
  weight-only, nvfp4 as fp4), the KV cache in fp8 where the row says the build quantised it or the weights are
  fp8 / fp4 (those recipes quantise the cache with them), else 16-bit;
- TP and PP as stated (kind "layout" where the row does not give them); prompt and output lengths as stated (kind
  "lengths" for variable-length datasets such as ShareGPT);
- the requests in flight: the row's batch, else its concurrency, else (offline throughput, all requests queued)
  the number of prompts up to what the KV cache holds (``max_concurrency``); a continuous-batching server given
  more requests than its KV cache holds runs that many and queues the rest (its TTFT, queueing included, is then
  not compared); an online run at a request rate without a concurrency: kind "request rate".

What is compared (``measured``), each as predicted / measured - 1:
- output tokens/s per GPU: the row's throughput in output tokens, per GPU or per system over its GPUs (total-token
  throughput times output / (input + output)); where the row does not say per GPU or per system, its derived
  per-GPU figure if it has one, else not compared (counted in the summary); a fixed-batch latency row without a
  printed throughput compares its derived batch x output / latency (the same measurement as its latency);
- TPOT (ms): the row's time per output token, else its inter-token latency (p50, else mean, else as printed);
- TTFT (ms); end-to-end latency (ms) of 'latency at fixed batch' rows (``ServingTime.latency_s``).

Scores: the median |error| of each figure with its row count; within each group of rows (same source, engine,
model, GPU, weights and KV formats, input and output lengths), Spearman's rank correlation of throughput per GPU
over the layouts (TP, PP, requests in flight) of groups with at least 3 of them (the median over groups and the
share at 0.85 or more), and the pick: in groups with several layouts, whether the layout the model predicts
fastest per GPU is the measured fastest or within ``TIE`` of it.

The fit: ServingEfficiency's bandwidth, compute, allreduce_s and step_s minimising the median |log error| over all
compared figures (a derived throughput whose row's latency is compared counts once), by coordinate descent over
log-spaced grids; in-sample on every row, and leaving one engine out (``engine_family``): refit on the other
engines' rows, scored on its own. The printed constants are ServingEfficiency's defaults to copy.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # published_rows

from published_rows import Unexpressible, print_unexpressible, rows_of, value  # noqa: E402,F401
from hp_tool.architectures import count_parameters  # noqa: E402
from hp_tool.estimate.serving import (ServingEfficiency, ServingGpu, ServingLayout, ServingTime,  # noqa: E402
                                      max_concurrency, serving_time)
from hp_tool.families.shape import Shape  # noqa: E402
from hp_tool.hf_config import load_hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "published_serving_runs.json"
GPU_CONF = ROOT / "hp_tool" / "conf" / "gpu"

FT_SEQ_LENGTH = 2048  # FasterTransformer GPT's position table (the Megatron GPT checkpoints it serves)

# model name (as the rows print it) -> a shipped Hugging Face config, or a key of SHAPES; first match wins
MODELS = [
    (r"gpt-j", "gptj_6b"),
    (r"falcon-180b", "falcon_180b"),
    (r"opt-13b", "opt_13b"),
    (r"internlm-chat-20b|internlm-20b", "internlm_20b"),
    (r"llama-2-7b", "llama2_7b"),
    (r"llama-2-13b", "llama2_13b"),
    (r"llama-2-70b", "llama2_70b"),
    (r"meta-llama-3-8b\b", "llama3_8b"),
    (r"llama-3\.1-8b", "llama3_1_8b"),
    (r"llama-3(\.[13])?-70b|meta-llama-3-70b", "llama3_70b"),
    (r"llama-3\.1-405b", "llama3_1_405b"),
    (r"mixtral-8x7b", "mixtral_8x7b"),
    (r"mistral-7b", "mistral_7b"),
    (r"qwen3-30b-a3b", "qwen3_30b_a3b"),
    (r"qwen3-235b-a22b", "qwen3_235b_a22b"),
]
# the published models hp_tool ships no config for: the shape of their config.json (family, layers, hidden, heads,
# kv heads, FFN width, vocabulary, tied embeddings, head dim or None, experts, top-k), from the repository named
SHAPES = {
    "gptj_6b": ("gpt3", 28, 4096, 16, 16, 16384, 50400, False, None, 0, 0),  # EleutherAI/gpt-j-6b
    "falcon_180b": ("gpt3", 80, 14848, 232, 8, 59392, 65024, False, None, 0, 0),  # tiiuae/falcon-180B
    "opt_13b": ("gpt3", 40, 5120, 40, 40, 20480, 50272, True, None, 0, 0),  # facebook/opt-13b
    "internlm_20b": ("llama", 60, 5120, 40, 40, 13824, 103168, False, None, 0, 0),  # internlm/internlm-chat-20b
    "llama3_70b": ("llama", 80, 8192, 64, 8, 28672, 128256, False, None, 0, 0),  # meta-llama/Llama-3.1-70B, -3.3-70B
    "llama3_1_405b": ("llama", 126, 16384, 128, 8, 53248, 128256, False, None, 0, 0),  # meta-llama/Llama-3.1-405B
    "qwen3_235b_a22b": ("qwen3_moe", 94, 4096, 64, 4, 1536, 151936, False, 128, 128, 8),  # Qwen/Qwen3-235B-A22B
}

# the GPU as the rows name it -> its gpu preset; first match wins (an A100 of 40 GB by its stated memory)
GPU_PRESETS = [(r"\bh200\b", "h200"), (r"\bh100\b", "h100_80gb"), (r"\bl40s\b", "l40s"),
               (r"a100.*\b40 ?gb?\b", "a100_40gb"), (r"\ba100\b", "a100_80gb")]
NO_PRESET = [r"\bgb?200\b", r"\bb200\b", r"rtx pro 6000"]

# an engine's rows by the first word of its name: the leave-one-engine-out groups
ENGINE_FAMILIES = ["TensorRT-LLM", "FasterTransformer", "LMDeploy", "vLLM", "SGLang", "Megatron-LM", "NVIDIA NIM"]

TIE = 0.05  # the pick: the predicted fastest layout within 5% of the measured fastest counts as found
SPEARMAN_GOOD = 0.85
FIGURES = ("throughput", "tpot", "ttft", "latency")
FIGURE_NAMES = {"throughput": "throughput/GPU", "tpot": "TPOT", "ttft": "TTFT", "latency": "e2e latency"}
FITTED = ("bandwidth", "compute", "allreduce_s", "step_s")
# the fit's search ranges (log-spaced grids)
FIT_RANGES = {"bandwidth": (0.2, 1.0), "compute": (0.05, 1.0), "allreduce_s": (1e-7, 3e-4), "step_s": (1e-6, 3e-2)}


def load_rows(path: Path = DATA) -> list[dict]:
    return rows_of(path)


def engine_family(name: str) -> str:
    """The engine a row ran on, by the first word of its name ("LMDeploy (TurboMind)" -> "LMDeploy")."""
    name = str(value(name) or "")
    return next((e for e in ENGINE_FAMILIES if name.startswith(e)), name.split()[0] if name.split() else "?")


# ------------------------------------------------------------------------------------------ the question

@dataclass
class Case:
    """One row as the serving model sees it, with what was measured."""

    id: str
    source: str
    engine: str  # engine_family
    engine_name: str  # name and version as the row prints them
    model: str  # MODELS / SHAPES key, or the FasterTransformer model's name
    gpu_name: str  # gpu preset
    shape: Shape
    layout: ServingLayout
    gpu: ServingGpu
    mode: str
    measured: dict[str, float]  # FIGURES -> measured (tokens/s per GPU, ms)
    fit_weight: dict[str, bool]  # FIGURES -> whether the figure counts in the fit
    stated_concurrency: Optional[int]  # the batch / concurrency the row states (None: from the KV cache)
    model_max_concurrency: int  # what the model's KV cache holds at these lengths
    oom: Optional[bool]
    notes: list[str] = field(default_factory=list)

    @property
    def group(self) -> tuple:
        """Rows whose layouts are compared with each other (Spearman, the pick)."""
        lay = self.layout
        return (self.source, self.engine_name, self.model, self.gpu_name, lay.weights, lay.kv_cache, lay.input_len,
                lay.output_len)

    @property
    def layout_key(self) -> tuple:
        return self.layout.tp, self.layout.pp, self.layout.concurrency


def model_key(row: dict) -> str:
    name = str(value(row["model"]["name"])).lower()
    key = next((k for pattern, k in MODELS if re.search(pattern, name)), None)
    if key is None:
        raise Unexpressible("model", str(value(row["model"]["name"])))
    return key


@lru_cache(maxsize=None)
def shipped_shape(key: str, seq: int) -> Shape:
    return load_hf_model(key).shape(seq)


def model_shape(row: dict, seq: int) -> tuple[Shape, str]:
    """The row's model: a FasterTransformer GPT's stated architecture, a SHAPES entry or a shipped config."""
    arch = row["model"].get("architecture")
    if isinstance(arch, dict) and arch.get("head_num"):
        heads, hidden = int(arch["head_num"]), int(arch["head_num"]) * int(arch["size_per_head"])
        return (Shape("gpt3", int(arch["num_layers"]), hidden, heads, heads, 4 * hidden, int(arch["vocab_size"]),
                      FT_SEQ_LENGTH), str(value(row["model"]["name"])))
    key = model_key(row)
    if key in SHAPES:
        fam, layers, hidden, heads, kv, ffn, vocab, tied, head_dim, experts, top_k = SHAPES[key]
        return Shape(fam, layers, hidden, heads, kv, ffn, vocab, seq, kv_channels=head_dim, tied_embeddings=tied,
                     pretrained=True, num_experts=experts, top_k=top_k), key
    return shipped_shape(key, seq), key


def gpu_preset(row: dict) -> tuple[str, list[str]]:
    hw = row["hardware"]
    name = str(value(hw.get("gpu")) or "")
    low = name.lower()
    memory = value(hw.get("gpu_memory_gb"))
    if any(re.search(p, low) for p in NO_PRESET):
        raise Unexpressible("gpu", name)
    if re.search(r"\ba100\b", low) and isinstance(memory, (int, float)):
        return ("a100_40gb" if memory <= 40 else "a100_80gb"), []
    for pattern, preset in GPU_PRESETS:
        if re.search(pattern, low):
            notes = ["A100 memory not stated: the 80 GB part"] if preset == "a100_80gb" and memory is None else []
            return preset, notes
    raise Unexpressible("gpu", name)


@lru_cache(maxsize=None)
def serving_gpu(preset: str) -> ServingGpu:
    """The preset's GPU as the serving model reads it (hp_tool/conf/gpu/<preset>.yaml)."""
    conf = yaml.safe_load((GPU_CONF / f"{preset}.yaml").read_text())
    peaks = {k: float(v) for k, v in (conf.get("peak_tflops") or {}).items() if v is not None}
    return ServingGpu(float(conf["memory_gib"]), float(conf["memory_bandwidth_gbps"]), peaks,
                      float(conf["intra_node_bandwidth_gbps"]), float(conf.get("memory_overhead_gib", 3.0)))


def formats(row: dict) -> tuple[str, str]:
    """(weights, KV cache) formats of the row's build."""
    quant = str(value(row["model"].get("quantization")) or "none").lower()
    precision = str(value(row.get("precision")) or "").lower()
    activation = "bf16" if "bf16" in precision else "fp16"
    if "fp4" in quant or precision.startswith("fp4"):
        weights = "fp4"
    elif "fp8" in quant:
        weights = "fp8"
    elif re.search(r"int4|w4a16|awq|gptq", quant):
        weights = "int4"
    elif re.search(r"int8|w8a16|smoothquant", quant):
        weights = "int8"
    elif quant in ("none", ""):
        if "fp16" not in precision and "bf16" not in precision:
            raise Unexpressible("weights", precision or "precision not stated")
        weights = activation
    else:
        raise Unexpressible("weights", quant)
    # an fp8 / fp4 build (TensorRT-LLM's and ModelOpt's fp8 and nvfp4 recipes, the checkpoints NIM and trtllm-bench
    # serve) quantises the KV cache to fp8 with the weights; weight-only int8 / int4 keep a 16-bit cache. The rows with
    # fp8 or fp4 weights are TensorRT-LLM and NIM builds: vLLM keeps a 16-bit cache beside fp8 weights unless given
    # --kv-cache-dtype fp8, which a vLLM row would have to state ("fp8 kv")
    if "fp8 kv" in precision or weights in ("fp8", "fp4"):
        kv = "fp8"
    else:
        kv = "bf16" if weights not in ("fp16", "bf16") else weights
    return weights, kv


def integer(x: Any) -> Optional[int]:
    x = value(x)
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def statistic(d: Any, keys: tuple[str, ...] = ("p50", "mean", "value")) -> Optional[float]:
    """A latency's figure: its median, else its mean, else the one printed without naming the statistic."""
    if not isinstance(d, dict):
        return None
    for k in keys:
        v = value(d.get(k))
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def measured_throughput(row: dict, gpus: int, input_len: int, output_len: int) -> tuple[Optional[float], list[str],
                                                                                         bool]:
    """Measured output tokens/s per GPU, the notes on how it was read, and whether it is derived from a latency."""
    tp = row["outcome"].get("throughput_tokens_per_s")
    derived = row.get("derived") or {}
    per_gpu = value(derived.get("output_tokens_per_s_per_gpu"))
    system = value(derived.get("output_tokens_per_s_system"))
    if isinstance(tp, dict) and isinstance(value(tp), (int, float)):
        raw, tokens, per = float(value(tp)), str(value(tp.get("tokens")) or ""), str(value(tp.get("per")) or "")
        if tokens == "total":
            raw *= output_len / (input_len + output_len)
        elif tokens != "output":
            return None, ["throughput: tokens not stated"], False
        if per.startswith("GPU"):
            return raw, [], False
        if per == "system":
            return raw / gpus, [], False
        if isinstance(per_gpu, (int, float)):
            return float(per_gpu), ["throughput scope not stated: the derived per-GPU figure"], False
        return None, ["throughput scope not stated: not compared"], False
    if isinstance(per_gpu, (int, float)):
        return float(per_gpu), ["throughput derived from the latency"], True
    if isinstance(system, (int, float)):
        return float(system) / gpus, ["throughput derived from the latency"], True
    return None, [], False


def express(row: dict, eff: ServingEfficiency = ServingEfficiency()) -> Case:
    """The row as a question to the serving model, or ``Unexpressible``."""
    work, hw, par = row["workload"], row["hardware"], row["parallelism"]
    mode = str(value(work.get("mode")))
    input_len, output_len = integer(work.get("input_len")), integer(work.get("output_len"))
    seq = (input_len or 0) + (output_len or 0)
    shape, model = model_shape(row, max(seq, 1))
    preset, notes = gpu_preset(row)
    gpu = serving_gpu(preset)
    weights, kv = formats(row)
    tp, pp = integer(par.get("tp")), integer(par.get("pp")) or 1
    if tp is None:
        raise Unexpressible("layout", "TP not stated")
    stated = integer(work.get("batch_size"))
    if stated is None:
        stated = integer(work.get("concurrency"))
    rate = value(work.get("request_rate"))
    if stated is None and mode == "online serving" and rate is not None:
        raise Unexpressible("request rate", f"{rate} requests/s"[:40])
    if input_len is None or output_len is None or input_len < 1 or output_len < 1:
        raise Unexpressible("lengths", f"{value(work.get('input_len'))} / {value(work.get('output_len'))}"[:60])
    params = value(row["model"].get("params_b"))
    if isinstance(params, (int, float)) and abs(count_parameters(shape) / (params * 1e9) - 1) > 0.1:
        notes.append(f"shape has {count_parameters(shape) / 1e9:.1f}B parameters, the row {params}B")
    probe = ServingLayout(tp, pp, 1, input_len, output_len, weights, kv)
    most = max_concurrency(shape, probe, gpu, eff)
    batching = str(value(work.get("batching")) or "").lower()
    queued = False
    if stated is not None:
        concurrency = stated
        if stated > most and re.match(r"continuous|inflight", batching):
            concurrency, queued = max(1, most), True
            notes.append(f"{stated} requests, the KV cache holds {most}: the rest queue")
    elif mode == "offline throughput":
        prompts = integer(work.get("num_prompts"))
        concurrency = max(1, min(prompts, most) if prompts else most)
        if prompts and prompts <= most:
            notes.append(f"requests in flight: all {prompts} prompts")
        else:
            notes.append(f"requests in flight: {concurrency}, what the KV cache holds, of {prompts or 'all'} queued")
    else:
        raise Unexpressible("concurrency", "neither batch, concurrency nor request rate")
    # a server's steady state, requests joining as others finish: its throughput runs; a batch of requests sent
    # together and timed to the end (a latency run) is a static batch to the model whatever the engine batches by
    continuous = mode != "latency at fixed batch" and not batching.startswith("static")
    layout = ServingLayout(tp, pp, concurrency, input_len, output_len, weights, kv,
                           "continuous" if continuous else "static")
    if concurrency > most:
        notes.append(f"the model's KV cache holds {most} requests of this length, the batch is {concurrency}")
    gpus = integer(hw.get("total_gpus")) or tp * pp * (integer(par.get("dp")) or 1)
    out = row["outcome"]
    measured, in_fit = {}, {}
    thr, more, from_latency = measured_throughput(row, gpus, input_len, output_len)
    notes += more
    if thr is not None:
        measured["throughput"], in_fit["throughput"] = thr, True
    tpot = statistic(out.get("tpot_ms"))
    if tpot is None:
        tpot = statistic(out.get("itl_ms"))
    if tpot is not None and output_len > 1:
        measured["tpot"], in_fit["tpot"] = tpot, True
    ttft = statistic(out.get("ttft_ms"))
    if ttft is not None:
        if queued:
            notes.append("TTFT includes queueing: not compared")
        else:
            measured["ttft"], in_fit["ttft"] = ttft, True
    latency = statistic(out.get("e2e_latency_ms"))
    if latency is not None and mode == "latency at fixed batch":
        measured["latency"], in_fit["latency"] = latency, True
        if from_latency and "throughput" in measured:
            in_fit["throughput"] = False
    oom = value(out.get("oom"))
    return Case(row["id"], row["source_key"], engine_family(row["engine"]["name"]),
                f"{value(row['engine']['name'])} {value(row['engine'].get('version')) or ''}".strip(), model, preset,
                shape, layout, gpu, mode, measured, in_fit, stated, most, oom if isinstance(oom, bool) else None,
                notes)


def predicted(t: ServingTime) -> dict[str, float]:
    """The model's figures, in the units ``Case.measured`` holds."""
    return {"throughput": t.tokens_per_s_per_gpu, "tpot": t.tpot_s * 1e3, "ttft": t.ttft_s * 1e3,
            "latency": t.latency_s * 1e3}


_PREDICTIONS: dict[tuple, dict[str, float]] = {}


def predict(case: Case, eff: ServingEfficiency) -> dict[str, float]:
    """The model's figures for the case at ``eff`` (kept per case, layout and efficiencies)."""
    key = (case.id, case.layout, case.shape, case.gpu_name, eff)
    if key not in _PREDICTIONS:
        _PREDICTIONS[key] = predicted(serving_time(case.shape, case.layout, case.gpu, eff))
    return _PREDICTIONS[key]


# ------------------------------------------------------------------------------------------------ scoring

@dataclass
class Scorecard:
    rows: int
    cases: list[Case]  # every expressible row (with or without a figure to compare)
    unexpressible: list[tuple[str, str, str, str]]  # id, source, kind, detail

    def reasons(self) -> Counter:
        return Counter(kind for _, _, kind, _ in self.unexpressible)

    @property
    def scored(self) -> list[Case]:
        return [c for c in self.cases if c.measured]


def score(rows: list[dict]) -> Scorecard:
    cases, skipped = [], []
    for row in rows:
        try:
            cases.append(express(row))
        except Unexpressible as why:
            skipped.append((row["id"], row["source_key"], why.kind, why.detail))
    return Scorecard(len(rows), cases, skipped)


def errors(cases: list[Case], eff: ServingEfficiency) -> dict[str, list[float]]:
    """FIGURES -> predicted / measured - 1 over the cases' compared figures."""
    out: dict[str, list[float]] = {f: [] for f in FIGURES}
    for c in cases:
        p = predict(c, eff)
        for f, m in c.measured.items():
            out[f].append(p[f] / m - 1)
    return out


def median_abs(errs: list[float]) -> Optional[float]:
    return statistics.median(abs(e) for e in errs) if errs else None


def ranks(xs: list[float]) -> list[float]:
    """Ranks from 1, ties at their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(measured: list[float], predicted_: list[float]) -> Optional[float]:
    """Spearman's rank correlation (Pearson's of the ranks, ties averaged); None under 3 points or when the
    measured values are all equal; 0 when the predictions are (the model tells the layouts apart in no order)."""
    if len(measured) < 3 or len(set(measured)) < 2:
        return None
    if len(set(predicted_)) < 2:
        return 0.0
    a, b = ranks(measured), ranks(predicted_)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))


def pick_hit(pairs: list[tuple[float, float]], tie: float = TIE) -> bool:
    """Whether the layout predicted fastest ((measured, predicted) pairs) is the measured fastest or within ``tie``
    of it."""
    best = max(m for m, _ in pairs)
    chosen = max(pairs, key=lambda mp: mp[1])[0]
    return chosen >= best * (1 - tie) * (1 - 1e-12)


@dataclass
class RankScores:
    spearman: list[float]  # one per group of 3+ layouts
    picks: list[bool]  # one per group of 2+ layouts

    @property
    def spearman_median(self) -> Optional[float]:
        return statistics.median(self.spearman) if self.spearman else None

    @property
    def spearman_share(self) -> Optional[float]:
        return sum(s >= SPEARMAN_GOOD for s in self.spearman) / len(self.spearman) if self.spearman else None

    @property
    def pick_share(self) -> Optional[float]:
        return sum(self.picks) / len(self.picks) if self.picks else None


def rank_scores(groups: dict[Any, list[tuple[float, float]]], tie: float = TIE) -> RankScores:
    """Spearman and the pick over groups of (measured, predicted) throughput per layout."""
    rho, picks = [], []
    for pairs in groups.values():
        if len(pairs) >= 2:
            picks.append(pick_hit(pairs, tie))
        r = spearman([m for m, _ in pairs], [p for _, p in pairs])
        if r is not None:
            rho.append(r)
    return RankScores(rho, picks)


def throughput_groups(cases: list[Case], eff: ServingEfficiency) -> dict[tuple, list[tuple[float, float]]]:
    """Group -> (measured, predicted) throughput per GPU of each distinct layout (repeated layouts: their mean)."""
    by: dict[tuple, dict[tuple, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for c in cases:
        if "throughput" in c.measured:
            by[c.group][c.layout_key].append((c.measured["throughput"], predict(c, eff)["throughput"]))
    return {g: [(statistics.fmean(m for m, _ in v), statistics.fmean(p for _, p in v)) for v in layouts.values()]
            for g, layouts in by.items()}


# ---------------------------------------------------------------------------------------------------- fit

class Linear:
    """The cases' predicted figures as functions of the fitted efficiencies, read off the model by probing it:
    ttft = max(Pc / compute, Pr / bandwidth) + Pa * allreduce_s + Ps * step_s + P0, tpot likewise (D*), latency =
    ttft + k * tpot, tokens/s per GPU = q / latency. ``check`` compares it with the model itself."""

    def __init__(self, cases: list[Case]):
        inf = math.inf
        base = ServingEfficiency(bandwidth=inf, compute=inf, allreduce_s=0.0, step_s=1.0)  # a step of 1 s: no 0 s
        cols = defaultdict(list)
        for c in cases:
            def probe(**kw: float) -> ServingTime:
                return serving_time(c.shape, c.layout, c.gpu, replace(base, **kw))
            zero = probe()
            for name, kw in (("c", {"compute": 1.0}), ("r", {"bandwidth": 1.0}), ("a", {"allreduce_s": 1.0}),
                             ("s", {"step_s": 2.0})):
                t = probe(**kw)
                cols["P" + name].append(t.ttft_s - zero.ttft_s)
                cols["D" + name].append(t.tpot_s - zero.tpot_s)
            cols["P0"].append(zero.ttft_s - cols["Ps"][-1])
            cols["D0"].append(zero.tpot_s - cols["Ds"][-1])
            t = serving_time(c.shape, c.layout, c.gpu, ServingEfficiency())
            cols["k"].append((t.latency_s - t.ttft_s) / t.tpot_s)
            cols["q"].append(t.tokens_per_s_per_gpu * t.latency_s)
        self.cols = {k: np.array(v, dtype=float) for k, v in cols.items()}

    def figures(self, eff: ServingEfficiency) -> dict[str, np.ndarray]:
        v = self.cols
        ttft = np.maximum(v["Pc"] / eff.compute, v["Pr"] / eff.bandwidth) + v["Pa"] * eff.allreduce_s + \
            v["Ps"] * eff.step_s + v["P0"]
        tpot = np.maximum(v["Dc"] / eff.compute, v["Dr"] / eff.bandwidth) + v["Da"] * eff.allreduce_s + \
            v["Ds"] * eff.step_s + v["D0"]
        latency = ttft + v["k"] * tpot
        return {"throughput": v["q"] / latency, "tpot": tpot * 1e3, "ttft": ttft * 1e3, "latency": latency * 1e3}


class Objective:
    """The median |log(predicted / measured)| over the fitted figures of the cases ``keep`` accepts (all: None),
    from ``linear`` (built for ``cases`` when not given)."""

    def __init__(self, cases: list[Case], keep: Optional[Callable[[Case], bool]] = None,
                 linear: Optional[Linear] = None):
        self.cases = cases
        self.linear = linear or Linear(cases)
        self.index: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # figure -> (case rows, log measured)
        for f in FIGURES:
            rows = [(i, math.log(c.measured[f])) for i, c in enumerate(cases)
                    if (keep is None or keep(c)) and f in c.measured and c.fit_weight.get(f) and c.measured[f] > 0]
            self.index[f] = (np.array([i for i, _ in rows], dtype=int), np.array([m for _, m in rows], dtype=float))

    def __call__(self, eff: ServingEfficiency) -> float:
        fig = self.linear.figures(eff)
        logs = [np.abs(np.log(fig[f][rows]) - meas) for f, (rows, meas) in self.index.items() if len(rows)]
        return float(np.median(np.concatenate(logs))) if logs else 0.0

    def check(self, eff: ServingEfficiency, every: int = 7) -> float:
        """The largest relative gap between ``Linear`` and the model itself at ``eff`` (on every ``every``-th case
        and the last: the model's form, not each case, is what is checked)."""
        fig = self.linear.figures(eff)
        gap = 0.0
        for i in sorted(set(range(0, len(self.cases), every)) | {len(self.cases) - 1}):
            if i < 0:
                continue
            p = predict(self.cases[i], eff)
            gap = max(gap, max(abs(fig[f][i] / p[f] - 1) for f in FIGURES))
        return gap


def grid(name: str, n: int) -> list[float]:
    low, high = FIT_RANGES[name]
    return [low * (high / low) ** (i / (n - 1)) for i in range(n)]


def fit(cases: list[Case], start: ServingEfficiency = ServingEfficiency(), passes: int = 6, points: int = 41,
        objective: Optional[Objective] = None) -> tuple[ServingEfficiency, float]:
    """Coordinate descent of ``FITTED`` over log-spaced grids (then finer ones around the best) minimising
    ``objective`` (default: ``Objective(cases)``); returns the efficiencies and their median |log error|. When the
    model is not of ``Linear``'s form, ``fit_direct`` descends on the model itself."""
    objective = objective or Objective(cases)
    best, best_score = start, objective(start)
    for span in (None, 4.0, 1.5):
        for _ in range(passes):
            improved = False
            for name in FITTED:
                now = getattr(best, name)
                if span is None:
                    candidates = grid(name, points)
                else:
                    candidates = [now * span ** (2 * i / (points - 1) - 1) for i in range(points)]
                for v in candidates:
                    trial = replace(best, **{name: v})
                    s = objective(trial)
                    if s < best_score - 1e-12:
                        best, best_score, improved = trial, s, True
            if not improved:
                break
    if objective.check(best) > 1e-6:
        kept = sorted({int(i) for rows, _ in objective.index.values() for i in rows})
        best, best_score = fit_direct([objective.cases[i] for i in kept], best)
    return best, best_score


def fit_direct(cases: list[Case], start: ServingEfficiency, points: int = 15) -> tuple[ServingEfficiency, float]:
    """``fit`` on the model's own predictions (slow): one pass of each coordinate over its grid."""
    def objective(eff: ServingEfficiency) -> float:
        logs = []
        for c in cases:
            p = predict(c, eff)
            logs += [abs(math.log(p[f] / m)) for f, m in c.measured.items() if c.fit_weight.get(f) and m > 0]
        return statistics.median(logs) if logs else 0.0
    best, best_score = start, objective(start)
    for name in FITTED:
        for v in grid(name, points):
            trial = replace(best, **{name: v})
            s = objective(trial)
            if s < best_score:
                best, best_score = trial, s
    return best, best_score


@dataclass
class FitResult:
    in_sample: ServingEfficiency
    in_sample_score: float
    left_out: dict[str, ServingEfficiency]  # engine -> fitted without its rows


def fit_all(cases: list[Case]) -> FitResult:
    """The in-sample fit and one fit leaving out each engine's rows."""
    scored = [c for c in cases if c.measured]
    linear = Linear(scored)
    eff, s = fit(scored, objective=Objective(scored, linear=linear))
    left = {}
    for engine in sorted({c.engine for c in scored}):
        if any(c.engine != engine for c in scored):
            left[engine] = fit(scored, eff, objective=Objective(scored, lambda c: c.engine != engine, linear))[0]
        else:
            left[engine] = eff
    return FitResult(eff, s, left)


# --------------------------------------------------------------------------------------------- printing

def pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.0%}"


def part(errs: list[float]) -> str:
    if not errs:
        return "- (0)"
    return f"{median_abs(errs):.0%} ({statistics.median(errs):+.0%}, {len(errs)})"


def eff_text(eff: ServingEfficiency) -> str:
    return ", ".join(f"{f.name}={getattr(eff, f.name):.3g}" for f in fields(eff))


def print_rows(card: Scorecard, eff: ServingEfficiency) -> None:
    print("| id | engine | model | GPU | weights/KV | TP | PP | requests | in/out | figure: measured / predicted "
          "(error) | note |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for c in card.cases:
        p = predict(c, eff)
        figs = "; ".join(f"{FIGURE_NAMES[f]}: {m:.4g} / {p[f]:.4g} ({pct(p[f] / m - 1)})"
                         for f, m in c.measured.items())
        lay = c.layout
        print(f"| {c.id} | {c.engine_name} | {c.model} | {c.gpu_name} | {lay.weights}/{lay.kv_cache} | {lay.tp} | "
              f"{lay.pp} | {lay.concurrency} | {lay.input_len}/{lay.output_len} | {figs or '-'} | "
              f"{'; '.join(c.notes)} |")


def score_line(name: str, cases: list[Case], eff: ServingEfficiency) -> str:
    e = errors(cases, eff)
    return f"| {name} | {len(cases)} | " + " | ".join(part(e[f]) for f in FIGURES) + " |"


SCORE_HEADER = ("| rows | scored | " + " | ".join(f"{FIGURE_NAMES[f]} median abs (median, n)" for f in FIGURES) +
                " |\n|---|---|---|---|---|---|")


@dataclass
class Report:
    card: Scorecard
    fitted: FitResult

    @property
    def eff(self) -> ServingEfficiency:
        return self.fitted.in_sample

    def left_out_errors(self, engine: str) -> dict[str, list[float]]:
        return errors([c for c in self.card.scored if c.engine == engine], self.fitted.left_out[engine])

    def ranks(self, eff: Optional[ServingEfficiency] = None) -> RankScores:
        return rank_scores(throughput_groups(self.card.scored, eff or self.eff))


def print_summaries(report: Report) -> None:
    card, eff = report.card, report.eff
    scored = card.scored
    print(f"\n{card.rows} rows: {len(card.cases)} expressible ({len(scored)} with a figure compared), "
          f"{len(card.unexpressible)} not expressible\n")
    print("Median |predicted / measured - 1| (median signed error, figures compared)\n")
    print(SCORE_HEADER)
    print(score_line("all, ServingEfficiency() priors", scored, ServingEfficiency()))
    print(score_line("all, fitted in-sample", scored, eff))
    printed = [c for c in scored if c.fit_weight.get("throughput")]
    e = errors(printed, eff)["throughput"]
    print(f"\nThroughput per GPU of the rows that print one (not derived from a latency), fitted: {part(e)}")

    print("\nBy engine: in-sample (fitted on every row) and left out (fitted on the other engines' rows)\n")
    print("| engine | scored | " + " | ".join(f"in-sample {FIGURE_NAMES[f]}" for f in FIGURES) + " | " +
          " | ".join(f"left out {FIGURE_NAMES[f]}" for f in FIGURES) + " |\n|" + "---|" * 10)
    for engine in sorted({c.engine for c in scored}):
        mine = [c for c in scored if c.engine == engine]
        inside, out = errors(mine, eff), report.left_out_errors(engine)
        print(f"| {engine} | {len(mine)} | " + " | ".join(part(inside[f]) for f in FIGURES) + " | " +
              " | ".join(part(out[f]) for f in FIGURES) + " |")
    print("\nFitted without each engine:")
    for engine, e in report.fitted.left_out.items():
        print(f"- without {engine}: {eff_text(e)}")
    print("\nThe same layouts measured on two engines (what no constant shared between engines can predict): the "
          "engine's throughput per GPU over the other's, median (range, pairs)")
    for engine in sorted({c.engine for c in scored}):
        for other, ratios in sorted(twin_ratios(scored, engine).items()):
            print(f"- {engine} / {other}: x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}, "
                  f"{len(ratios)})")

    print("\nBy source (fitted in-sample)\n")
    print(SCORE_HEADER.replace("| rows |", "| source |", 1))
    for source in sorted({c.source for c in scored}):
        print(score_line(source, [c for c in scored if c.source == source], eff))

    for title, e in (("priors", ServingEfficiency()), ("fitted", eff)):
        r = report.ranks(e)
        print(f"\nLayout ranking of throughput per GPU within groups (source, engine, model, GPU, formats, lengths), "
              f"{title}: Spearman median {fmt(r.spearman_median, '.2f')} over {len(r.spearman)} groups of 3+ "
              f"layouts, {fmt(r.spearman_share, '.0%')} at {SPEARMAN_GOOD} or more; the pick (predicted fastest "
              f"within {TIE:.0%} of the measured fastest) in {sum(r.picks)} of {len(r.picks)} groups of 2+ layouts "
              f"({fmt(r.pick_share, '.0%')})")
    groups = throughput_groups(scored, eff)
    worst = sorted((spearman([m for m, _ in v], [p for _, p in v]), g) for g, v in groups.items()
                   if spearman([m for m, _ in v], [p for _, p in v]) is not None)[:5]
    for rho, g in worst:
        print(f"- lowest: {rho:+.2f} {' / '.join(map(str, g))}")
    missed = [g for g, v in groups.items() if len(v) >= 2 and not pick_hit(v)]
    for g in missed[:8]:
        v = groups[g]
        chosen = max(v, key=lambda mp: mp[1])[0]
        print(f"- pick missed: {' / '.join(map(str, g))}: picked {chosen:.4g}, best {max(m for m, _ in v):.4g}")

    fits_wrong = [c.id for c in card.cases if c.oom is not True and c.stated_concurrency is not None
                  and c.layout.concurrency > c.model_max_concurrency]
    oom_missed = [c.id for c in card.cases if c.oom is True and c.stated_concurrency is not None
                  and c.stated_concurrency <= c.model_max_concurrency]
    print(f"\nMemory (information, not a target): {len(fits_wrong)} rows ran a static batch above the "
          f"model's max_concurrency ({', '.join(fits_wrong[:6])}{', ...' if len(fits_wrong) > 6 else ''}); "
          f"{len(oom_missed)} measured OOM rows the model says fit "
          f"({', '.join(oom_missed[:6])}{', ...' if len(oom_missed) > 6 else ''})")

    notes = Counter(n for c in card.cases for n in c.notes
                    if not re.match(r"^\d+ requests|requests in flight|the model's KV cache holds", n))
    print("\nFigures and notes:")
    for n, k in notes.most_common():
        print(f"- {n}: {k} rows")
    empty = Counter("measured OOM" if c.oom else "no figure stated or readable" for c in card.cases if not c.measured)
    print(f"- no figure to compare: {len(card.cases) - len(scored)} expressible rows "
          f"({', '.join(f'{k}: {n}' for k, n in sorted(empty.items()))})")

    print_unexpressible(card.unexpressible)

    print(f"\nFitted in-sample (median |log error| {report.fitted.in_sample_score:.3f}): {eff_text(eff)}")
    print(constants_text(eff))


def twin_ratios(cases: list[Case], engine: str) -> dict[str, list[float]]:
    """Per other engine, the measured throughput per GPU of ``engine``'s rows over the other engine's on the same
    layout (model, GPU, formats, TP, PP, requests in flight, lengths): how far the engines themselves differ."""
    def key(c: Case) -> tuple:
        return (c.model, c.gpu_name, c.layout)

    others: dict[tuple, list[Case]] = {}
    for c in cases:
        if c.engine != engine and "throughput" in c.measured:
            others.setdefault(key(c), []).append(c)
    out: dict[str, list[float]] = {}
    for c in cases:
        if c.engine == engine and "throughput" in c.measured:
            for twin in others.get(key(c), []):
                out.setdefault(twin.engine, []).append(c.measured["throughput"] / twin.measured["throughput"])
    return out


def fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def constants_text(eff: ServingEfficiency) -> str:
    return "ServingEfficiency(" + ", ".join(f"{n}={getattr(eff, n):.3g}" for n in FITTED) + ")"


@dataclass(frozen=True)
class Targets:
    """What the model must reach on the rows it expresses; ``main`` exits 1 when one is missed."""

    in_sample_median: float = 0.15  # throughput per GPU and TPOT, fitted on every row
    left_out_median: float = 0.25  # throughput per GPU and TPOT of each engine, fitted without it
    spearman_median: float = SPEARMAN_GOOD  # median over groups of 3+ layouts
    pick_share: float = 0.80  # groups of 2+ layouts whose predicted fastest is the measured fastest (within TIE)


TARGETS = Targets()


def target_lines(report: Report, targets: Targets = TARGETS) -> list[tuple[str, bool]]:
    """(line, met) for each target."""
    lines = []
    inside = errors(report.card.scored, report.eff)
    for f in ("throughput", "tpot"):
        m = median_abs(inside[f])
        lines.append((f"{FIGURE_NAMES[f]} median in-sample {fmt(m, '.1%')} <= {targets.in_sample_median:.0%}",
                      m is None or m <= targets.in_sample_median))
    for engine in sorted(report.fitted.left_out):
        out = report.left_out_errors(engine)
        for f in ("throughput", "tpot"):
            m = median_abs(out[f])
            if m is not None:
                lines.append((f"{FIGURE_NAMES[f]} median, {engine} left out {m:.1%} <= {targets.left_out_median:.0%}",
                              m <= targets.left_out_median))
    r = report.ranks()
    rho = r.spearman_median
    lines.append((f"Spearman median over {len(r.spearman)} groups {fmt(rho, '.2f')} >= {targets.spearman_median}",
                  rho is None or rho >= targets.spearman_median))
    lines.append((f"the pick within {TIE:.0%} of the best in {fmt(r.pick_share, '.0%')} of {len(r.picks)} groups >= "
                  f"{targets.pick_share:.0%}", r.pick_share is None or r.pick_share >= targets.pick_share))
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    """Print the rows, the summaries and the targets; returns 0 when every target is met, 1 when one is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="print the summaries only")
    parser.add_argument("--fit", action="store_true", help="print the fitted ServingEfficiency constants only")
    parser.add_argument("--data", type=Path, default=DATA, help="the published runs (JSON)")
    args = parser.parse_args(argv)
    card = score(load_rows(args.data))
    if args.fit:
        eff, s = fit(card.scored)
        print(f"# median |log error| {s:.3f} over {len(card.scored)} rows")
        print(constants_text(eff))
        return 0
    report = Report(card, fit_all(card.cases))
    if not args.summary:
        print_rows(card, report.eff)
    print_summaries(report)
    lines = target_lines(report)
    print("\nTargets:")
    for line, met in lines:
        print(f"- {line}: {'met' if met else 'MISSED'}")
    missed = sum(not met for _, met in lines)
    print(f"Targets: {len(lines) - missed} of {len(lines)} met" + (f", {missed} missed" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
