"""Inputs shared by the memory and speed models: a candidate's layout and the cluster's hardware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    zero_stage: int = 3  # ZeRO stage over the data-parallel group (hp_tool/sharding.py)
    offload: str = "none"  # none | optimizer | optimizer_and_params
    engine: str = "torch"  # torch | deepspeed
    sequence_parallel: bool = False
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)

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
    host_ram_gb: Optional[float] = None  # host RAM per node; None = unknown (offload cannot be planned)
    pcie_bandwidth_gbps: float = 25.0  # GB/s per GPU and direction between host and GPU (offload traffic)
    flash_attention: bool = True  # attention scores are not stored (SDPA / flash kernels)

    @property
    def bytes_per_value(self) -> int:
        return BYTES_PER_VALUE[self.precision]
