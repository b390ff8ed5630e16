"""Inputs shared by the memory and speed models: a candidate's layout and the cluster's hardware."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9  # hp_tool reports memory in GB of 1e9 bytes, as GPU vendors label their memory

BYTES_PER_VALUE = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Layout:
    """One candidate's parallel layout for the full run."""

    tp: int
    pp: int
    dp: int
    mbs: int
    act_ckpt_layers: int  # layers per pipeline stage whose activations are recomputed
    global_batch_size: int
    dp_sharding: str = "full"  # none (DDP) | gradients (ZeRO-2-like) | full (FSDP / ZeRO-3)
    sequence_parallel: bool = False

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel replica."""
        return self.global_batch_size // (self.mbs * self.dp)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class Hardware:
    """What the cluster offers per GPU; bandwidths in GB/s per GPU, peak in TFLOPS."""

    gpus_per_node: int
    gpu_memory_gb: float
    peak_tflops: float
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float
    memory_overhead_gb: float  # framework overhead: CUDA context, allocator slack, comm buffers
    precision: str = "bf16"
    flash_attention: bool = True  # attention scores are not stored (SDPA / flash kernels)

    @property
    def bytes_per_value(self) -> int:
        return BYTES_PER_VALUE[self.precision]
