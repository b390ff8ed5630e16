"""Analytic time of one optimizer step for a training layout. Pure arithmetic, no torch.

compute   = (model + recompute FLOPs) / (GPUs · peak · efficiency), efficiency growing with the matmul
            sizes a micro-batch gives each GPU;
bubble    = compute · (PP − 1) / m for m micro-batches per replica (1F1B, Narayanan et al. 2021);
TP comm   = ring all-reduces of the layer activations, 2 in forward and 2 in backward per layer, plus
            2 per recomputed layer;
PP comm   = point-to-point activations and gradients between stages;
DP comm   = gradient reduction (and parameter gathers under FSDP), partly hidden behind backward.
The constants are deliberately few; trials measure the truth and calibrate them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hp_tool.architectures import (Shape, layer_parameters, model_flops_per_step, recompute_flops_per_step,
                                   vocab_parallel_parameters)
from hp_tool.estimate.layout import GB, Hardware, Layout

MAX_EFFICIENCY = 0.6  # best achievable fraction of peak for large dense matmuls
TOKENS_SCALE = 1024.0  # tokens per micro-batch at which efficiency reaches 63% of its saturation
WIDTH_SCALE = 512.0  # hidden columns per TP rank at which efficiency reaches 63% of its saturation
DP_OVERLAP = 0.5  # fraction of data-parallel communication hidden behind compute


@dataclass(frozen=True)
class StepTimeEstimate:
    """Seconds per optimizer step, by part."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s


def matmul_efficiency(shape: Shape, layout: Layout) -> float:
    """Fraction of peak a GPU reaches for this micro-batch and TP width (0 < e <= MAX_EFFICIENCY)."""
    tokens = layout.mbs * shape.seq_length
    width = shape.hidden_size / layout.tp
    return MAX_EFFICIENCY * (1 - math.exp(-tokens / TOKENS_SCALE)) * (1 - math.exp(-width / WIDTH_SCALE))


def _ring_allreduce_s(nbytes: float, ranks: int, bandwidth_gbps: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / (bandwidth_gbps * GB) if ranks > 1 else 0.0


def dp_comm_s(shape: Shape, layout: Layout, hw: Hardware, num_nodes: int) -> float:
    """Exposed data-parallel communication per step: gradient reduction, plus two parameter gathers
    under full sharding (FSDP), over the node interconnect when the job spans nodes."""
    if layout.dp == 1:
        return 0.0
    embed, head = vocab_parallel_parameters(shape, layout.tp, layout.pp)  # vocab matrices split over TP
    params = shape.num_layers // layout.pp * layer_parameters(shape) / layout.tp + embed + head
    volume = {"none": 1.0, "gradients": 1.0, "full": 1.5}[layout.dp_sharding]  # in all-reduces
    bandwidth = hw.inter_node_bandwidth_gbps if num_nodes > 1 else hw.intra_node_bandwidth_gbps
    return (1 - DP_OVERLAP) * volume * _ring_allreduce_s(2 * params, layout.dp, bandwidth)


def estimate_step_time(shape: Shape, layout: Layout, hw: Hardware, num_nodes: int) -> StepTimeEstimate:
    """Predicted seconds per optimizer step of the full run on ``num_nodes`` nodes."""
    gpus = layout.tp * layout.pp * layout.dp
    m = layout.num_microbatches
    flops = model_flops_per_step(shape, layout.global_batch_size)
    flops += recompute_flops_per_step(shape, layout.global_batch_size, layout.act_ckpt_layers * layout.pp)
    compute = flops / (gpus * hw.peak_tflops * 1e12 * matmul_efficiency(shape, layout))
    bubble = compute * (layout.pp - 1) / m

    activation_bytes = layout.mbs * shape.seq_length * shape.hidden_size * hw.bytes_per_value
    layers = shape.num_layers // layout.pp
    tp_bw = hw.intra_node_bandwidth_gbps if layout.tp <= hw.gpus_per_node else hw.inter_node_bandwidth_gbps
    allreduces = m * (4 * layers + 2 * layout.act_ckpt_layers)
    tp_comm = allreduces * _ring_allreduce_s(activation_bytes, layout.tp, tp_bw)

    pp_comm = 0.0
    if layout.pp > 1:
        spans_nodes = layout.model_parallel > hw.gpus_per_node
        pp_bw = hw.inter_node_bandwidth_gbps if spans_nodes else hw.intra_node_bandwidth_gbps
        pp_comm = 2 * (m + layout.pp - 1) * activation_bytes / layout.tp / (pp_bw * GB)

    return StepTimeEstimate(compute, bubble, tp_comm, pp_comm, dp_comm_s(shape, layout, hw, num_nodes))


def extrapolate_step_time_s(measured_step_time_s: float, shape: Shape, trial: Layout, full: Layout,
                            hw: Hardware, trial_nodes: int, full_nodes: int) -> float:
    """Step time of the full run from a trial's measurement on fewer nodes: each replica does the same
    work, so only the data-parallel communication differs, and that difference is modelled."""
    extra = dp_comm_s(shape, full, hw, full_nodes) - dp_comm_s(shape, trial, hw, trial_nodes)
    return measured_step_time_s + max(0.0, extra)
