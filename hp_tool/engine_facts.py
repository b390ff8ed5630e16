"""What each trial engine can do, as data: the rules (hp_tool/sharding.py), the memory and step-time models,
the configuration checks and the results read these facts, never an engine's name.

Pure, no torch. The engines themselves (``hp_tool/trial/engines/``) implement what their record says; a
new engine is one record here and one implementation there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hp_tool.vocab import OPTIMIZERS, ZERO_STAGES


@dataclass(frozen=True)
class EngineFacts:
    """One trial engine."""

    name: str  # its train_settings.engines value
    code: str  # how a trial id spells it
    package: Optional[str]  # the Python package it needs beyond torch (the config check names it), or None
    # memory savers: the offloads it runs (the others' reason in ``offload_note``), the ZeRO stages it composes
    # with TP > 1, and with PP > 1 (None: it runs no pipeline)
    offloads: tuple[str, ...]
    offload_note: str
    offload_min_zero_stage: int  # the lowest ZeRO stage it offloads at
    tp_zero_stages: tuple[int, ...]
    pp_zero_stages: Optional[tuple[int, ...]]
    # optimizers: those it steps offloaded states with (why not the others: ``offload_step_note``), and those
    # its ZeRO-1 shards (None: any)
    offloaded_optimizers: tuple[str, ...]
    offload_step_note: str
    zero1_optimizers: Optional[tuple[str, ...]]
    # what it runs
    expert_parallel: bool  # splits a mixture of experts' experts over EP ranks
    experts_with_tp: bool  # runs a mixture of experts with TP > 1
    adapters_with_tp: bool  # runs LoRA / QLoRA with TP > 1
    qlora_zero_stages: tuple[int, ...]  # ZeRO stages it runs QLoRA's 4-bit weights with (no offload)
    context_parallel: bool
    sequence_parallel: bool
    chunked_loss: bool
    activation_offload: bool
    selective_checkpointing: bool
    fp8_linears: bool  # converts the layers' linears to Float8 (torchao) before parallelising
    compiles: bool  # runs the layers under torch.compile (the recipe's compile)
    # how it holds and moves the model (the memory and step-time models read these):
    # the fp32 parameter is the master weight, autocast or FSDP2's mixed precision computing in 16 bits (torch);
    # else 16-bit weights and gradients with the fp32 master among the optimizer states (DeepSpeed)
    fp32_weights: bool
    bf16_master: bool  # trains bf16 weights with bf16 optimizer states and no fp32 master (master_weights bf16)
    zero2_shards_weights: bool  # ZeRO-2 shards the weights between steps too (FSDP2 without resharding after forward)
    pipeline_defers_reshard: bool  # under PP the stage is gathered and reduced once per step, not per micro-batch
    zero2_gathers_each_forward: bool  # ZeRO-2 gathers in each forward (else once after the step)
    recompute_gathers: bool  # ZeRO-3 gathers a checkpointed layer again for its recompute forward
    host_offload_bytes: tuple[tuple[str, int], ...]  # (offload, host bytes per parameter shard it keeps in RAM)
    reduce_bytes: Optional[int]  # bytes per reduced gradient value (None: the training precision's)
    # ZeRO-2 and 3 reduce gradients through a GPU buffer of this many elements beside the partition (None: none)
    reduce_bucket_elements: Optional[int]
    # ZeRO-2 and 3 with the optimizer offloaded hold the gradient partition in host RAM, not on the GPU
    offload_moves_gradients: bool
    # the offloads under which each micro-batch's gradients go to the host and are added there (under the others
    # they accumulate on the GPU and go down once per step, with the optimizer's step)
    offloads_moving_each_microbatch: tuple[str, ...]
    # bytes per trained parameter value its parameter offload uploads for each gather (None: the training
    # precision's; the frozen base of an adapter method is uploaded in it either way)
    offload_upload_bytes: Optional[int]
    # host seconds its own Python hooks add to every micro-batch (hp_tool/estimate/host.py), by ZeRO stage: per trained
    # parameter tensor (the gradient hook's bucketing and reduction bookkeeping), and per parameter-holding module and
    # pass, forward, backward and a checkpointed layer's recompute (ZeRO-3's fetch and release hooks); measured by
    # benchmarks/host_overhead.py. Stages not named add nothing
    gradient_hook_s: tuple[tuple[int, float], ...]
    module_hook_s: tuple[tuple[int, float], ...]
    builds_ops: bool  # C++ ops built before its first trial (DeepSpeed's CPU Adam)
    traceable: bool  # the memory check traces its rank build under fake tensors
    config_file: Optional[str]  # what the optimal config's folder holds beside it for this engine (name pattern)

    def host_bytes(self, offload: str) -> int:
        """Host bytes per parameter shard that ``offload`` keeps in RAM (0 without offload)."""
        return dict(self.host_offload_bytes).get(offload, 0)

    def hook_seconds(self, zero_stage: int) -> tuple[float, float]:
        """(per trained tensor, per module and pass) host seconds of its hooks at ``zero_stage`` (``gradient_hook_s``,
        ``module_hook_s``)."""
        return dict(self.gradient_hook_s).get(zero_stage, 0.0), dict(self.module_hook_s).get(zero_stage, 0.0)


# DeepSpeed's hooks on the host (``gradient_hook_s``, ``module_hook_s``): seconds per trained tensor per micro-batch
# and per parameter-holding module per pass. benchmarks/host_overhead.py times a DeepSpeed 0.19.8 micro-batch of the
# tiny Llama stage on one CPU rank (one core of a 2-core x86 cloud VM) against its plain forward and backward: 96 us
# per trained tensor at ZeRO-2 and, at ZeRO-3, 295 us per module and pass beyond it, from full training without
# checkpointing; the model is then within 0.87-1.45 of the seven other cases (LoRA, checkpointed, ZeRO-2 and 3).
# Not yet measured on a GPU host, where each fetch also launches an all-gather.
GRADIENT_HOOK_S = 100e-6
ZERO3_MODULE_HOOK_S = 300e-6

TORCH = EngineFacts(
    name="torch", code="torch", package=None,
    # optimizer: FSDP2 shards 16-bit weights and gradients on the GPU, the host holds the fp32 master and the
    # optimizer's states (optim.HostOffloadedOptimizer); optimizer_and_params: FSDP2's CPUOffloadPolicy
    offloads=("none", "optimizer", "optimizer_and_params"), offload_note="", offload_min_zero_stage=2,
    tp_zero_stages=ZERO_STAGES, pp_zero_stages=ZERO_STAGES,
    offloaded_optimizers=tuple(o for o in OPTIMIZERS if o != "adamw_8bit"),
    offload_step_note="bitsandbytes' 8-bit AdamW runs on the GPU only",
    zero1_optimizers=("adamw", "sgd", "sgd_momentum"),
    expert_parallel=True, experts_with_tp=True, adapters_with_tp=False, qlora_zero_stages=(0, 1),
    context_parallel=True, sequence_parallel=True, chunked_loss=True, activation_offload=True,
    selective_checkpointing=True, fp8_linears=True, compiles=True, fp32_weights=True, bf16_master=True,
    zero2_shards_weights=True,
    pipeline_defers_reshard=True,
    zero2_gathers_each_forward=True, recompute_gathers=False,
    # FSDP2's CPUOffloadPolicy keeps the fp32 parameter as the master: fp32 master, m, v and the fp32 gradient
    # the optimizer's offload: fp32 master, m, v and an fp32 gradient buffer, and a 16-bit staging copy for the
    # transfers (optim.HostOffloadedOptimizer), allocated once
    host_offload_bytes=(("optimizer", 18), ("optimizer_and_params", 16)),
    reduce_bytes=4,  # FSDP2's reduce_dtype; DDP's fp32 grads
    reduce_bucket_elements=None, offload_moves_gradients=False,  # FSDP2 reduce-scatters the gradients in place
    # FSDP2's CPUOffloadPolicy copies each micro-batch's reduced fp32 gradient shard to the host and adds it there,
    # and the fp32 shard up for each gather; the optimizer's offload keeps 16-bit gradients sharded on the GPU
    # until the host step (optim.HostOffloadedOptimizer)
    offloads_moving_each_microbatch=("optimizer_and_params",), offload_upload_bytes=4,
    # DDP's and FSDP2's hooks run per bucket and per layer, not per parameter: left out
    gradient_hook_s=(), module_hook_s=(),
    builds_ops=False, traceable=True, config_file=None,
)
DEEPSPEED = EngineFacts(
    name="deepspeed", code="ds", package="deepspeed",
    offloads=("none", "optimizer", "optimizer_and_params"), offload_note="", offload_min_zero_stage=1,
    tp_zero_stages=(0, 1, 2), pp_zero_stages=None,
    offloaded_optimizers=("adamw",), offload_step_note="DeepSpeed steps offloaded states with its CPU Adam",
    zero1_optimizers=None,
    expert_parallel=False, experts_with_tp=False, adapters_with_tp=True, qlora_zero_stages=(),
    context_parallel=False, sequence_parallel=False, chunked_loss=False, activation_offload=False,
    selective_checkpointing=False, fp8_linears=False, compiles=False, fp32_weights=False, bf16_master=False,
    zero2_shards_weights=False,
    pipeline_defers_reshard=False,
    zero2_gathers_each_forward=False, recompute_gathers=True,
    # fp32 master, m, v and gradient (16); parameter offload adds the 16-bit parameter (18: REFERENCE §5)
    host_offload_bytes=(("optimizer", 16), ("optimizer_and_params", 18)), reduce_bytes=None,
    # its reduce_bucket_size default (hp_tool's config leaves it): the contiguous IPG buffer of ZeRO-2 and 3; with
    # offload_optimizer each bucket is copied into the host's fp32 gradient partition and freed (ZeRO-Offload;
    # stage_1_and_2.copy_grads_in_partition, stage3's grad_partitions_flat_buffer on the host)
    reduce_bucket_elements=500_000_000, offload_moves_gradients=True,
    # ZeRO-Offload copies each micro-batch's reduced bucket into the host's fp32 partition and adds it there; its
    # parameter offload keeps the 16-bit parameters on the host and uploads those
    offloads_moving_each_microbatch=("optimizer", "optimizer_and_params"), offload_upload_bytes=None,
    # ZeRO-2 and 3: each trained tensor's gradient hook copies it into the bucket and books its partition (about 14
    # operators); ZeRO-3's pre- and post-hooks on every module fetch, wait for and release its partitioned
    # parameters (Python bookkeeping more than operators). ZeRO-0 and 1 reduce once per step, at the boundary
    gradient_hook_s=((2, GRADIENT_HOOK_S), (3, GRADIENT_HOOK_S)), module_hook_s=((3, ZERO3_MODULE_HOOK_S),),
    builds_ops=True, traceable=False, config_file="ds_config",
)
ENGINE_FACTS = {e.name: e for e in (TORCH, DEEPSPEED)}


def engine_facts(name: str) -> EngineFacts:
    """The record of engine ``name`` (one of vocab.ENGINES)."""
    return ENGINE_FACTS[name]
