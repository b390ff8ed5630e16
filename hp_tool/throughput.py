"""Throughput of one optimizer step: the one definition of tokens/s, model TFLOPS per GPU and MFU that the
engine (result.json), the planner (predictions) and the collector (tables, optimal config) all use.

MFU = model FLOPs per second / (GPUs x dense peak FLOPS), model FLOPs counted matmul by matmul per family
(hp_tool/architectures.py; recomputation is not counted, so MFU does not reward checkpointing).
"""

from __future__ import annotations

from typing import Optional

from hp_tool.architectures import Shape, model_flops_per_step
from hp_tool.recipe import Adapters


def throughput(shape: Shape, global_batch_size: int, step_time_s: float, num_gpus: int,
               peak_tflops_per_gpu: float, lora: Optional[Adapters] = None) -> dict[str, float]:
    """samples_per_s, tokens_per_s, tokens_per_s_per_gpu, model_tflops_per_gpu (TFLOPS) and mfu of a step
    of ``global_batch_size`` sequences taking ``step_time_s`` seconds on ``num_gpus`` GPUs, training
    adapters ``lora`` over a frozen base (None: every weight)."""
    tokens_per_s = global_batch_size * shape.seq_length / step_time_s
    tflops = model_flops_per_step(shape, global_batch_size, lora) / step_time_s / num_gpus / 1e12
    return {"samples_per_s": global_batch_size / step_time_s, "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / num_gpus, "model_tflops_per_gpu": tflops,
            "mfu": tflops / peak_tflops_per_gpu}
