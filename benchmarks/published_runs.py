"""The step-time and memory models against published training runs, per source and GPU type.

    python benchmarks/published_runs.py            # the table per run, then per source and per GPU type
    python benchmarks/published_runs.py --summary  # the summaries only

Runs (see ``load_runs``):
- REFERENCE §12: Narayanan et al. 2021 (SC'21, arXiv:2104.04473), Table 1 — GPT on A100 80 GiB, fp16, full
  activation recompute, interleaved 1F1B where v > 1 (micro-batch sizes and virtual stages from Megatron-LM's
  examples/sc21/run_table_1.sh). Measured step time = the paper's Eq. 3 FLOPs over the GPUs' TFLOP/s.
- ``../shared/published_runs_torchtitan.json`` (a copy ships as benchmarks/data/published_runs_torchtitan.json):
  torchtitan's FSDP2 / TP / PP / CP Llama runs on A100 80 GiB and on 500 W H100 96 GiB HBM2e, bf16 and Float8,
  eager and compiled. Step time = global batch x sequence / (tokens/s per GPU x GPUs); where the global batch
  is not stated the per-GPU rate does not depend on it (one micro-batch per data-parallel rank).
- benchmarks/data/published_runs_sxm.json: bf16 runs on SXM H100 80 GB (700 W), in the same row format:
  NVIDIA's DGX Cloud Benchmarking recipes v24.11.1 (NeMo on DGX H100: Llama 3.1 8B-405B, Nemotron-4 15B and
  340B, GPT-3 175B; TP, PP, interleaved PP, CP, distributed optimizer) and MosaicML llm-foundry's MPT tables
  (760M-70B, PyTorch FSDP, 8-512 GPUs, sequences 512-65536). Step time = the stated step time where the source
  gives one, else from tokens/s as above (tokens/s of all GPUs where only that is stated).

What each run is given, and what the model cannot express (said per run in the ``note`` column):
- a Llama 3.1 405B split over PP 8 (126 layers; torchtitan splits unevenly) is priced as its busiest stage,
  16 layers per stage (128 layers); torchtitan's default micro-batch count = the pipeline's stages;
- "selective layer" checkpointing (every second layer recomputed whole) is act_ckpt_layers = layers / 2, "selective
  op" is act_ckpt_mode = selective on every layer (torchtitan's per-op policy, hp_tool's too);
- Float8 runs (torchao Float8 linears) keep bf16 weights, gradients and activations: they are the planner's fp8
  recipe choice (``train_settings.fp8``): memory priced as bf16, the linears at the GPU's fp8 peak with their
  casts at its memory bandwidth (hp_tool/estimate/speed.py ``fp8_cast_s``);
- what a run's stack does that hp_tool's engines do not is set on its Hardware from the run's settings: torch's
  asynchronous TP hides ``ASYNC_TP_HIDDEN`` of TP's collectives and NeMo's userbuffers (ub_tp_comm_overlap) all of
  them (``tp_comm_hidden``); NeMo's element-wise kernels are fused (``fused_elementwise``) and on H100 its
  attention runs in Hopper's own kernels at their measured rate (``hopper_attention``); torchtitan's fused RMSNorm
  keeps its input alone (``fused_norms``, ``FUSED_RMSNORM``);
- NeMo's distributed optimizer (one reduce-scatter of the gradients and one all-gather of the weights per step:
  an all-reduce's traffic) is ZeRO-1; Megatron's selective recompute (the core attention's forward again) is
  priced as no recompute; Nemotron-4 (squared-ReLU 4h MLP) and MPT (GeLU 4h MLP, learned positions) are the gpt3
  family's matmuls.

Per source and per GPU type: median and max |step-time error|, the rank pairs within each (source, model, GPU,
sequence length) group (a source's campaign is one software stack and cluster): of the pairs of runs whose measured
tokens/s per GPU differ by more than 5% (``RANK_TIE``; closer ones are ties, within run-to-run noise), how many the
prediction orders as measured, ties (within 5%) or reverses; median |memory error| over the runs with a measured
peak, and how many of those the planner would call "does not fit". Leave-one-source-out: the step-time constants
refitted without a source (``fit``), and that source's error under them. Targets (``TARGETS``; the script exits 1
when one is missed, naming it): step time median <= 8% on every GPU type, <= 4% over all runs and <= 8% for every
source left out of the fit; no rank pair reversed; memory median <= 10%; 0 wrong "does not fit".
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from hp_tool.architectures import Shape
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.memory import estimate_memory
from hp_tool.estimate.speed import estimate_step_time

ROOT = Path(__file__).resolve().parent.parent
TORCHTITAN = ROOT / "benchmarks/data/published_runs_torchtitan.json"
SXM = ROOT / "benchmarks/data/published_runs_sxm.json"  # SXM H100 80 GB: DGX Cloud Benchmarking (NeMo), llm-foundry
MEMORY_MARGIN = 0.05  # the planner's default train_settings.memory_margin
# TP's collectives overlapped with the GEMMs beside them (Hardware.tp_comm_hidden). Transformer Engine's userbuffers
# (NeMo's ub_tp_comm_overlap) split each all-gather and reduce-scatter into chunks, each run while the GEMM of the
# last computes: all hidden over NVLink. torch's async TP (torchtitan) does the same through symmetric memory, but
# torchtitan's three pairs of runs with and without it (Llama 3 8B and 70B, Llama 3.1 70B, 8 x H100) are 0.25,
# 1.06 and 2.32 s faster a step with it, 42%, 26% and 58% of the collectives' time priced without it: 0.4
USERBUFFERS_HIDDEN = 1.0
ASYNC_TP_HIDDEN = 0.4
# torchtitan's runs whose config set norm_type = "fused_rmsnorm" (its Triton RMSNorm, which keeps its input alone:
# Hardware.fused_norms): the performance doc's Llama 2 13B and Llama 3 8B tables, measured with
# train_configs/llama_13b.toml at 395a5262 (2024-04-18) and llama3_8b.toml at 1ea476e9 (2024-04-24), the numbers
# unchanged to the cited 6a6f755d; its 70B configs set rmsnorm, as every config did from August 2024
FUSED_RMSNORM = {("torchtitan_perf_doc_2024", "Llama 2 13B"), ("torchtitan_perf_doc_2024", "Llama 3 8B")}

# REFERENCE §12, Narayanan et al. 2021 Table 1
SEQ, VOCAB = 2048, 51200
# params (B), layers, hidden, heads, TP, PP, GPUs, batch, micro-batch, virtual stages, TFLOP/s per GPU
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    (3.6, 30, 3072, 32, 2, 1, 64, 512, 16, 1, 138),
    (7.5, 36, 4096, 32, 4, 1, 128, 512, 16, 1, 142),
    (18.4, 40, 6144, 48, 8, 1, 256, 1024, 8, 1, 135),
    (39.1, 48, 8192, 64, 8, 2, 512, 1536, 4, 1, 138),
    (76.1, 60, 10240, 80, 8, 4, 1024, 1792, 2, 3, 140),
    (145.6, 80, 12288, 96, 8, 8, 1536, 2304, 2, 2, 148),
    (310.1, 96, 16384, 128, 8, 16, 1920, 2160, 1, 2, 155),
    (529.6, 105, 20480, 128, 8, 35, 2520, 2520, 1, 3, 163),
    (1008.0, 128, 25600, 160, 8, 64, 3072, 3072, 1, 1, 163),
]

# the gpu preset each published GPU runs on
GPU_PRESETS = {"A100 80GB": "a100_80gb", "H100 96GB HBM2e (500 W)": "h100_96gb_hbm2e",
               "H100 94-95GB HBM2e lower-TDP": "h100_96gb_hbm2e", "H100 80GB SXM (DGX H100)": "h100_80gb",
               "H100 80GB SXM (MosaicML h100_80gb)": "h100_80gb"}

# the ZeRO stage each row's sharding is (FSDP2's full shard, torchtitan's every row, where not named here)
ZERO_STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2,
               # NeMo's distributed Adam: the gradients reduce-scattered and the weights all-gathered once a step
               "NeMo distributed_fused_adam (optimizer state sharded over DP)": 1}


# shapes the torchtitan rows leave out (REFERENCE §9): layers, hidden, heads, kv heads, ffn, vocabulary
LLAMA2 = {"Llama 2 13B": dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000),
          "Llama 2 70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000)}


@dataclass(frozen=True)
class Run:
    """One published run as the models see it."""

    id: str
    source: str
    model: str
    gpu: str  # gpu preset
    shape: Shape
    layout: Layout
    hw: Hardware
    nodes: int
    step_s: float  # measured seconds per optimizer step
    memory_gib: Optional[float]  # measured peak per GPU (torch's max reserved), GiB
    note: str = ""
    unjudged: str = ""  # why the planner's "fits" verdict is not judged on this run ("": judged)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.layout.global_batch_size * self.shape.seq_length / self.step_s / self.layout.gpus


def hardware(preset: str, precision: str = "bf16") -> Hardware:
    """The gpu preset as the planner builds it (8 GPUs per node), its peak in ``precision``."""
    import yaml

    p = yaml.safe_load((ROOT / f"hp_tool/conf/gpu/{preset}.yaml").read_text())
    return Hardware(gpus_per_node=8, gpu_memory_gib=p["memory_gib"], peak_tflops=p["peak_tflops"][precision],
                    intra_node_bandwidth_gbps=p["intra_node_bandwidth_gbps"],
                    inter_node_bandwidth_gbps=p["inter_node_bandwidth_gbps"],
                    memory_overhead_gib=p["memory_overhead_gib"],
                    host_ram_gib=p.get("host_ram_gib"), pcie_bandwidth_gbps=p["pcie_bandwidth_gbps"],
                    memory_bandwidth_gbps=p.get("memory_bandwidth_gbps") or 2000.0,
                    fp8_peak_tflops=p["peak_tflops"].get("fp8"), **p.get("efficiency", {}))


def narayanan_runs() -> list[Run]:
    # Megatron-LM in 2021 computed attention unfused (scores stored, non-causal matmuls): no flash kernels; its
    # fused kernels (bias + GeLU, layer norm, scaled masked softmax) fuse the element-wise work
    hw = replace(hardware("a100_80gb", "fp16"), flash_attention=False, fused_elementwise=True)
    out = []
    for size, layers, hidden, heads, tp, pp, gpus, batch, mbs, v, tflops in TABLE_1:
        shape = Shape("gpt3", layers, hidden, heads, heads, 4 * hidden, VOCAB, SEQ)
        layout = Layout.of(tp=tp, pp=pp, dp=gpus // (tp * pp), mbs=mbs, act_ckpt_layers=layers // pp,
                           global_batch_size=batch, zero_stage=0, virtual_stages=v, precision="fp16")
        # Eq. 3: F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) per iteration, over the GPUs' achieved FLOP/s
        flops = 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))
        out.append(Run(f"n{size:g}B", "narayanan_2021", f"GPT {size:g}B", "a100_80gb", shape, layout, hw, gpus // 8,
                       flops / (gpus * tflops * 1e12), None, unjudged=MEGATRON_RUNTIME))
    return out


def json_runs(path: Path) -> list[Run]:
    """The rows of a published-runs file (torchtitan's, the SXM one) as the models see them."""
    data = json.loads(path.read_text())
    out = []
    for r in data["rows"]:
        s = r["model_shape"] or LLAMA2[r["model"]]
        layers, pp, notes = s["layers"], r["pp"], []
        if layers % pp:
            layers = -(-layers // pp) * pp
            notes.append(f"{s['layers']} layers priced as the busiest stage's {layers // pp} per stage")
        seq = r["seq_length"] or 8192
        if not r["seq_length"]:
            notes.append("seq 8192 (torchtitan's config; not stated)")
        shape = Shape(s.get("family", "llama"), layers, s["hidden"], s["heads"], s["kv_heads"], s["ffn"], s["vocab"],
                      seq, tied_embeddings=s.get("tied"))
        dp, cp, tp = r["fsdp"] or r["dp"], r["cp"], r["tp"]
        mbs, gbs = r["micro_batch_size"], r["global_batch_size"]
        if pp > 1 and r["framework"].startswith("torchtitan"):
            local = gbs // dp if gbs else 8  # r015-r018: "local batch size 8"
            v = 2 if "Interleaved" in (r["pp_schedule"] or "") else 1
            microbatches = pp * v  # torchtitan's default: as many micro-batches as the pipeline has stages
            mbs, gbs = local // microbatches, local * dp
            notes.append(f"{microbatches} micro-batches of {mbs} (torchtitan's default), v={v}")
        else:
            v = r["vp"] or 1
            gbs = gbs or dp * mbs
        ac = r["activation_checkpointing"] or "none"
        per_stage = layers // pp
        if ac.startswith("selective (Megatron"):  # the core attention's forward again: priced as no recompute
            ac = "none"
            notes.append("Megatron's selective recompute priced as none")
        ckpt, mode = {"full": per_stage, "none": 0}.get(ac), "full"
        if ckpt is None:  # torchtitan's selective: every second layer whole ("layer") or the per-op policy ("op")
            ckpt, mode = (per_stage // 2, "full") if "layer" in ac else (per_stage, "selective")
        optimizations = r["other_optimizations"] or ""
        hidden = 0.0  # the share of the TP collectives the stack overlaps with the GEMMs
        if "async TP" in optimizations:
            hidden = ASYNC_TP_HIDDEN
            notes.append(f"async TP hides {ASYNC_TP_HIDDEN:.0%} of TP's collectives")
        if "ub_tp_comm_overlap" in optimizations:
            hidden = USERBUFFERS_HIDDEN
            notes.append("TP's collectives overlapped (userbuffers)")
        unjudged = ""
        if r["framework"].startswith(("NeMo", "Megatron")):
            unjudged = MEGATRON_RUNTIME
        elif "fused cross entropy" in optimizations:
            unjudged = FUSED_LOSS
            notes.append("fused cross entropy priced as torch's (verdict not judged)")
        layout = Layout.of(tp=tp, pp=pp, dp=dp, mbs=mbs, act_ckpt_layers=ckpt, global_batch_size=gbs,
                           zero_stage=ZERO_STAGES.get(r["sharding"], 3), virtual_stages=v, cp=cp,
                           sequence_parallel=bool(r["sequence_parallel"]), act_ckpt_mode=mode,
                           # Float8 linears (torchao), weights, gradients and activations in bf16: the planner's
                           # fp8 recipe choice (train_settings.fp8), priced as the planner prices it
                           fp8=r["precision"].startswith("fp8"), compile="torch.compile" in optimizations)
        preset = GPU_PRESETS[r["gpu"]]
        hw = replace(hardware(preset), tp_comm_hidden=hidden, fused_norms=(r["source"], r["model"]) in FUSED_RMSNORM)
        if hw.fused_norms:
            notes.append("torchtitan's fused RMSNorm")
        if r["framework"].startswith(("NeMo", "Megatron")):  # Transformer Engine's fused norms and activations,
            # and on Hopper its cuDNN fused attention
            hw = replace(hw, fused_elementwise=True, hopper_attention=preset.startswith(("h100", "h200")))
            notes.append("Transformer Engine's fused element-wise kernels and attention")
        gpus = r["num_gpus"]
        per_gpu = r["tokens_per_s_per_gpu"] or r["tokens_per_s_total"] / gpus
        step = r["step_time_s"] or gbs * seq / (per_gpu * gpus)
        out.append(Run(r["id"], r["source"], r["model"], preset, shape, layout, hw, gpus // 8, step,
                       r["peak_memory_gib"], "; ".join(notes), unjudged))
    return out


def torchtitan_runs() -> list[Run]:
    return json_runs(TORCHTITAN)


def sxm_runs() -> list[Run]:
    return json_runs(SXM)


def load_runs() -> list[Run]:
    return narayanan_runs() + torchtitan_runs() + sxm_runs()


def predicted_step_s(run: Run) -> float:
    return estimate_step_time(run.shape, run.layout, run.hw, run.nodes).total_s


def predicted_memory_gib(run: Run) -> float:
    return estimate_memory(run.shape, run.layout, run.hw).total_gib


def fits(run: Run) -> bool:
    """The planner's verdict: predicted peak within the GPU's memory less the margin."""
    return estimate_memory(run.shape, run.layout, run.hw).total_gib <= run.hw.usable_gib(MEMORY_MARGIN)


# runs whose memory the planner's model does not express, so its "fits" verdict is not judged on them
MEGATRON_RUNTIME = "Megatron's runtime (Megatron-LM 2021, NeMo) holds no torch pipeline buffers"
FUSED_LOSS = ("llm-foundry's loss is flash-attn's fused cross entropy; the planner prices torch's, whose logits, their "
              "fp32 copy and gradient it keeps whole")


def judged(run: Run) -> bool:
    """Whether the run's "fits" verdict is judged: it trained (every published run did) in a runtime whose memory
    the planner's model expresses (every torchtitan run), so the verdict must be "fits" (``unjudged`` says why
    not)."""
    return not run.unjudged


def wrongly_no_fit(runs: list[Run]) -> list[str]:
    """The judged runs (they trained) that the planner calls "does not fit"."""
    return [r.id for r in runs if judged(r) and not fits(r)]


# A rank claim counts only between runs whose measured rates differ by more than 5%: closer ones are ties (one
# reading each, within run-to-run noise: llm-foundry's 2023-10 groups differ by 1-4% with node count); a prediction
# within 5% of its pair is a tie too (the model claims no order between them)
RANK_TIE = 0.05


def tied(a: float, b: float) -> bool:
    """Whether two rates are within ``RANK_TIE`` of each other."""
    return max(a, b) <= min(a, b) * (1 + RANK_TIE)


def rank_pairs(measured: list[float], predicted: list[float]) -> tuple[int, int, int]:
    """(right, tied, reversed) over the pairs whose measured rates are not tied: the prediction orders the pair as
    measured, ties it, or orders it the other way."""
    right = tie = wrong = 0
    for i, j in itertools.combinations(range(len(measured)), 2):
        if tied(measured[i], measured[j]):
            continue
        if tied(predicted[i], predicted[j]):
            tie += 1
        elif (predicted[i] > predicted[j]) == (measured[i] > measured[j]):
            right += 1
        else:
            wrong += 1
    return right, tie, wrong


@dataclass
class Summary:
    runs: int
    median: float
    max: float
    pairs: tuple[int, int, int]  # rank pairs (``rank_pairs``) within its groups: right, tied, reversed
    memory_runs: int
    memory_median: Optional[float]
    wrong_no_fit: int  # judged runs (they trained) called "does not fit"
    trained: int  # runs that trained whose verdict is judged (``judged``)


def summarise(runs: list[Run], step: Callable[[Run], float]) -> Summary:
    errors = [abs(step(r) / r.step_s - 1) for r in runs]
    groups: dict[tuple[str, str, str, int], list[Run]] = {}
    for r in runs:  # the layouts of one model on one GPU at one sequence length, measured by one source
        groups.setdefault((r.source, r.model, r.gpu, r.shape.seq_length), []).append(r)
    pairs = [0, 0, 0]
    for members in groups.values():
        measured = [m.tokens_per_s_per_gpu for m in members]
        guessed = [m.layout.global_batch_size * m.shape.seq_length / step(m) / m.layout.gpus for m in members]
        pairs = [n + k for n, k in zip(pairs, rank_pairs(measured, guessed))]
    mem = [r for r in runs if r.memory_gib is not None]
    mem_errors = [abs(predicted_memory_gib(r) / r.memory_gib - 1) for r in mem]
    return Summary(len(runs), statistics.median(errors), max(errors), tuple(pairs), len(mem),
                   statistics.median(mem_errors) if mem_errors else None, len(wrongly_no_fit(runs)),
                   sum(judged(r) for r in runs))


def summary_line(name: str, s: Summary) -> str:
    ranked = " / ".join(str(n) for n in s.pairs) if sum(s.pairs) else "-"
    mem = f"{s.memory_median:6.1%} ({s.memory_runs})" if s.memory_median is not None else "-"
    return (f"| {name} | {s.runs} | {s.median:.1%} | {s.max:.1%} | {ranked} | {mem} | "
            f"{s.wrong_no_fit if s.trained else '-'} |")


SUMMARY_HEADER = ("| group | runs | step median | step max | rank pairs right / tied / reversed | memory median (runs) | "
                  "wrong \"does not fit\" |\n"
                  "|---|---|---|---|---|---|---|")


FITTED = ("max_efficiency", "attention_efficiency")  # per GPU preset; the curve's shape (width_half, tokens_half) is the prior's


def with_efficiency(runs: list[Run], gpu: str, values: dict[str, float]) -> list[Run]:
    return [replace(r, hw=replace(r.hw, **values)) if r.gpu == gpu else r for r in runs]


def fit(runs: list[Run], gpu: str) -> dict[str, float]:
    """The gpu preset's efficiency constants (``FITTED``) minimising the mean |log(predicted / measured)| step
    time over ``runs`` on that GPU: a coordinate search from Hardware's defaults (the 2021 prior), each constant
    scaled by shrinking factors in turn."""
    mine = [r for r in runs if r.gpu == gpu]
    values = {name: getattr(Hardware, name) for name in FITTED}  # from the prior, not the preset's fit

    def loss(v: dict[str, float]) -> float:
        import math
        return statistics.fmean(abs(math.log(predicted_step_s(r) / r.step_s)) for r in with_efficiency(mine, gpu, v))

    best = loss(values)
    for step in (1.5, 1.2, 1.05, 1.01):
        improved = True
        while improved:
            improved = False
            for name in FITTED:
                for factor in (step, 1 / step):
                    trial = dict(values, **{name: values[name] * factor})
                    if name.endswith("efficiency") and trial[name] > 1:
                        continue
                    score = loss(trial)
                    if score < best - 1e-9:
                        values, best, improved = trial, score, True
    return values


@dataclass(frozen=True)
class LeftOut:
    """One source's runs on one GPU type scored under that GPU's efficiency refitted without the source."""

    source: str
    gpu: str
    runs: int
    values: dict  # the constants (``FITTED``) fitted on the other sources' runs on the GPU
    median: float  # median |step-time error| of the source's runs under them
    worst: float


def left_out(runs: list[Run]) -> list[LeftOut]:
    """Each (source, GPU type) whose GPU other sources ran on: its runs' step-time error under that GPU's constants
    refitted without the source (``fit``); a source alone on its GPU type has nothing to be refitted from."""
    scored = []
    for source in sorted({r.source for r in runs}):
        for gpu in sorted({r.gpu for r in runs if r.source == source}):
            rest = [r for r in runs if r.source != source]
            if not any(r.gpu == gpu for r in rest):
                continue
            values = fit(rest, gpu)
            held = with_efficiency([r for r in runs if r.source == source and r.gpu == gpu], gpu, values)
            errors = [abs(predicted_step_s(r) / r.step_s - 1) for r in held]
            scored.append(LeftOut(source, gpu, len(held), values, statistics.median(errors), max(errors)))
    return scored


def leave_one_source_out(scored: list[LeftOut]) -> None:
    """Print ``left_out``'s table."""
    print("\nLeave one source out: each GPU's efficiency refitted without the source, the source's error under it\n")
    print("| source | GPU | runs | fitted without it (max, attention) | step median | step max |\n"
          "|---|---|---|---|---|---|")
    for s in scored:
        constants = ", ".join(f"{s.values[n]:.3g}" for n in FITTED)
        print(f"| {s.source} | {s.gpu} | {s.runs} | {constants} | {s.median:.1%} | {s.worst:.1%} |")


@dataclass(frozen=True)
class Targets:
    """What the models must reach on the published runs; ``main`` exits 1 when one is missed."""

    step_median: float = 0.08  # per GPU type: median |step-time error| at most
    reversed_pairs: int = 0  # per GPU type and per source: rank pairs (``rank_pairs``) ordered the other way, at most
    overall_median: float = 0.04  # over every run: median |step-time error| at most
    left_out_median: float = 0.08  # each source left out of the fit (``left_out``): its median |step-time error| at most
    memory_median: float = 0.10  # over the runs with a measured peak: median |memory error| at most
    wrong_no_fit: int = 0  # runs that trained the planner calls "does not fit", at most

    def text(self) -> str:
        return (f"step-time median <= {self.step_median:.0%} on every GPU type; step-time median <= "
                f"{self.overall_median:.0%} over all runs and <= {self.left_out_median:.0%} for every source left out of "
                f"the fit; no rank pair more than {RANK_TIE:.0%} apart reversed on any "
                f"GPU type or source; memory median <= {self.memory_median:.0%}; no run wrongly called \"does not fit\"")


TARGETS = Targets()


def missed_targets(runs: list[Run], targets: Targets = TARGETS,
                   scored: Optional[list[LeftOut]] = None) -> list[str]:
    """Each target the models miss on ``runs``, with the figure that misses it; [] when all are met.
    ``scored``: ``left_out(runs)`` where the caller has it."""
    missed = []
    for gpu in sorted({r.gpu for r in runs}):
        s = summarise([r for r in runs if r.gpu == gpu], predicted_step_s)
        if s.median > targets.step_median:
            missed.append(f"{gpu}: step-time median {s.median:.1%} > {targets.step_median:.0%}")
        if s.pairs[2] > targets.reversed_pairs:
            missed.append(f"{gpu}: {s.pairs[2]} rank pair(s) reversed")
    overall = summarise(runs, predicted_step_s)
    if overall.median > targets.overall_median:
        missed.append(f"all runs: step-time median {overall.median:.1%} > {targets.overall_median:.0%}")
    for source in sorted({r.source for r in runs}):
        mine = [r for r in runs if r.source == source]
        s = summarise(mine, predicted_step_s)
        if s.pairs[2] > targets.reversed_pairs:
            missed.append(f"{source}: {s.pairs[2]} rank pair(s) reversed")
    for s in left_out(runs) if scored is None else scored:
        if s.median > targets.left_out_median:
            missed.append(f"{s.source} left out ({s.gpu}): step-time median {s.median:.1%} > "
                          f"{targets.left_out_median:.0%}")
    if overall.memory_median is not None and overall.memory_median > targets.memory_median:
        missed.append(f"memory median {overall.memory_median:.1%} > {targets.memory_median:.0%}")
    if overall.wrong_no_fit > targets.wrong_no_fit:
        missed.append(f"{overall.wrong_no_fit} run(s) that trained called \"does not fit\": "
                      f"{', '.join(wrongly_no_fit(runs))}")
    return missed


def main(argv: Optional[list[str]] = None) -> int:
    """Print the tables; returns the exit code: 0 when every target is met, 1 when one is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="print the summaries only")
    parser.add_argument("--fit", action="store_true",
                        help="print each GPU preset's efficiency constants fitted on all its runs")
    args = parser.parse_args(argv)
    runs = load_runs()
    if not args.summary:
        print("| run | source | model | GPU | TP PP CP DP mbs ckpt | measured s | predicted s | error | "
              "measured GiB | predicted GiB | note |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            guess = predicted_step_s(r)
            lay = r.layout
            mem = f"{r.memory_gib:.1f} | {predicted_memory_gib(r):.1f}" if r.memory_gib else \
                f"- | {predicted_memory_gib(r):.1f}"
            print(f"| {r.id} | {r.source} | {r.model} | {r.gpu} | {lay.tp} {lay.pp} {lay.cp} {lay.dp} {lay.mbs} "
                  f"{lay.act_ckpt_layers} | {r.step_s:.2f} | {guess:.2f} | {guess / r.step_s - 1:+.1%} | {mem} | "
                  f"{r.note} |")
        print()
    print(SUMMARY_HEADER)
    for source in sorted({r.source for r in runs}):
        print(summary_line(source, summarise([r for r in runs if r.source == source], predicted_step_s)))
    for gpu in sorted({r.gpu for r in runs}):
        print(summary_line(gpu, summarise([r for r in runs if r.gpu == gpu], predicted_step_s)))
    print(summary_line("all", summarise(runs, predicted_step_s)))
    trained = [r for r in runs if judged(r)]
    wrong = wrongly_no_fit(runs)
    fused = [r for r in runs if r.unjudged == FUSED_LOSS]
    print(f"\nEvery torchtitan run trained: {len(trained) - len(wrong)} of {len(trained)} called fitting; called "
          f"\"does not fit\": {', '.join(wrong) or 'none'}. Left out: Megatron's runs (Megatron-LM 2021, NeMo: their "
          f"runtime holds no torch pipeline buffers) and llm-foundry's (flash-attn's fused cross entropy, which the "
          f"planner prices as torch's: {sum(not fits(r) for r in fused)} of its {len(fused)} would be called \"does "
          f"not fit\")")
    scored = left_out(runs)
    leave_one_source_out(scored)
    if args.fit:
        for gpu in sorted({r.gpu for r in runs}):
            print(gpu, {k: round(v, 3) for k, v in fit(runs, gpu).items()})
    missed = missed_targets(runs, scored=scored)
    print(f"\nTargets: {TARGETS.text()}: " + (f"MISSED: {'; '.join(missed)}" if missed else "met"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
