"""The step-time model against published training runs: median error and rank correlation.

    python benchmarks/published_runs.py

REFERENCE §12: Narayanan et al. 2021 (SC'21, arXiv:2104.04473), Table 1 — GPT on A100 80 GiB with full
activation recompute, interleaved 1F1B where v > 1, micro-batch sizes and virtual stages from Megatron-LM's
examples/sc21/run_table_1.sh. The measured step time is the paper's per-iteration FLOPs (its Eq. 3, recompute
included) over the GPUs' achieved TFLOP/s. The prediction is hp_tool.estimate.speed.estimate_step_time on the
``a100_80gb`` gpu preset. Prints one line per run and the median absolute error and Spearman's rank
correlation (target: median <= 10%, Spearman >= 0.9).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from hp_tool.architectures import Shape
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.speed import estimate_step_time

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


def a100() -> Hardware:
    preset = yaml.safe_load((Path(__file__).resolve().parent.parent / "hp_tool/conf/gpu/a100_80gb.yaml").read_text())
    return Hardware(gpus_per_node=8, gpu_memory_gib=preset["memory_gib"], peak_tflops=preset["peak_tflops"]["fp16"],
                    intra_node_bandwidth_gbps=preset["intra_node_bandwidth_gbps"],
                    inter_node_bandwidth_gbps=preset["inter_node_bandwidth_gbps"],
                    memory_overhead_gib=preset["memory_overhead_gib"], precision="fp16",
                    pcie_bandwidth_gbps=preset["pcie_bandwidth_gbps"])


def measured_step_s(layers: int, hidden: int, gpus: int, batch: int, tflops: float) -> float:
    """Eq. 3: F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) per iteration, over the GPUs' achieved FLOP/s."""
    flops = 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))
    return flops / (gpus * tflops * 1e12)


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main() -> None:
    hw = a100()
    measured, predicted, errors = [], [], []
    print(f"{'params':>8} {'TP':>3} {'PP':>3} {'v':>2} {'GPUs':>5} {'measured s':>11} {'predicted s':>12} {'error':>7}")
    for size, layers, hidden, heads, tp, pp, gpus, batch, mbs, v, tflops in TABLE_1:
        shape = Shape("gpt3", layers, hidden, heads, heads, 4 * hidden, VOCAB, SEQ)
        dp = gpus // (tp * pp)
        layout = Layout(tp, pp, dp, mbs, -(-layers // pp), batch, zero_stage=0, virtual_stages=v)
        truth = measured_step_s(layers, hidden, gpus, batch, tflops)
        guess = estimate_step_time(shape, layout, hw, num_nodes=gpus // 8).total_s
        measured.append(truth)
        predicted.append(guess)
        errors.append(abs(guess - truth) / truth)
        print(f"{size:7.1f}B {tp:3d} {pp:3d} {v:2d} {gpus:5d} {truth:11.2f} {guess:12.2f} {guess / truth - 1:+7.1%}")
    print(f"median |error| {statistics.median(errors):.1%} (target <= 10%), max {max(errors):.1%}; "
          f"Spearman {spearman(measured, predicted):.3f} (target >= 0.9) over {len(errors)} runs")


if __name__ == "__main__":
    main()
