"""One rank's model and optimizer, built the one way both the torch engine and the memory tracer use.

Build order (torchtitan's): this rank's pipeline stage on the meta device (its v chunks under interleaved
1F1B), with the spec's training transforms applied (:mod:`hp_tool.trial.converters`) -> per chunk TP,
activation checkpointing, DDP / FSDP2 (:func:`hp_tool.trial.parallel.parallelize_stage`, still on meta) ->
a *materialiser* gives the local shards storage: ``Initialise`` allocates them on the device and fills the
layout-independent weights (a trial), then runs the converters' materialised steps, ``FakeMaterialise``
gives them fake tensors that allocate nothing (the pre-launch trace, as torchtitan's estimator ran the
trainer's own ``parallelize_fn`` under ``FakeTensorMode``) -> the optimizer over the materialised shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hp_tool.contracts import phases
from hp_tool.contracts.spec import ParallelSpec, TrialSpec
from hp_tool.sharding import master_on_host
from hp_tool.trial import optim
from hp_tool.trial.models import build_rank_stages
from hp_tool.trial.parallel import parallelize_stage
from hp_tool.trial.stage import InterleavedStages, StageModule
from hp_tool.trial.checkpoint import weight_source
from hp_tool.trial.dist import weight_dp_dim, weight_dp_size
from hp_tool.trial.converters import Converter, converters_for
from hp_tool.trial.weights import Source, hold_in, materialize


def compute_dtype(spec: TrialSpec, device: torch.device) -> Optional[torch.dtype]:
    """bf16/fp16 autocast dtype on GPU; None (fp32) on CPU or with precision fp32."""
    if device.type != "cuda" or spec.training.precision == "fp32":
        return None
    return torch.bfloat16 if spec.training.precision == "bf16" else torch.float16


def tp_mesh_of(mesh: Optional[DeviceMesh], par: ParallelSpec) -> Optional[DeviceMesh]:
    """The ``tp`` sub-mesh when the layout splits tensors, else None."""
    return mesh["tp"] if mesh is not None and par.tp > 1 else None


def group_of(mesh: Optional[DeviceMesh], par: ParallelSpec, dim: str) -> Optional[dist.ProcessGroup]:
    """The process group of mesh dimension ``dim`` ("pp", "dp", "cp" or "tp") when the layout has more than one
    rank along it, else None."""
    return mesh[dim].get_group() if mesh is not None and getattr(par, dim) > 1 else None


def weight_dp_group(mesh: Optional[DeviceMesh], par: ParallelSpec) -> Optional[dist.ProcessGroup]:
    """The group of the ranks that hold the same weights (``dist.weight_dp_dim``: dp, or dp x cp) when there
    is more than one, else None: what ZeRO-1 shards the optimizer states over."""
    return mesh[weight_dp_dim(par)].get_group() if mesh is not None and weight_dp_size(par) > 1 else None


class Materialiser(Protocol):
    """Gives a parallelized meta-device stage its (local) storage."""

    device: torch.device
    """Where the stage's tensors live (FSDP2 pins offloaded buffers only for a GPU)."""

    def __call__(self, stage: nn.Module) -> int:
        """Materialise ``stage`` in place; returns this rank's parameter element count."""


@dataclass(frozen=True)
class Initialise:
    """A trial's materialiser: the local shards allocated on ``device`` and filled with the deterministic,
    layout-independent weights of ``seed``, or with a checkpoint's (``source``, :mod:`hp_tool.trial.checkpoint`)
    (:func:`hp_tool.trial.weights.materialize`); then the materialised steps of the spec's converters
    (:mod:`hp_tool.trial.converters`: QLoRA quantises its 4-bit base)."""

    device: torch.device
    seed: int
    std: float
    source: Optional[Source] = None
    converters: tuple[Converter, ...] = ()
    compute_dtype: Optional[torch.dtype] = None  # QLoRA's 4-bit matmuls (the autocast dtype; None: fp32)
    params_device: Optional[torch.device] = None  # where the parameters live (None: ``device``)

    @classmethod
    def of(cls, spec: TrialSpec, device: torch.device, params_on_host: bool = False) -> "Initialise":
        """The spec's weights: its checkpoint's when it names one, else its seed's; on the host with
        ``params_on_host`` (FSDP2's offload keeps them there, and wants them there from the start)."""
        return cls(device, spec.training.seed, spec.model.init_method_std, weight_source(spec.model),
                   converters_for(spec.model), compute_dtype(spec, device),
                   torch.device("cpu") if params_on_host else None)

    def __call__(self, stage: nn.Module) -> int:
        """Allocate and fill ``stage``'s local shards, then run the converters' materialised steps, each timed
        as its phase; returns the shards' element count."""
        numel = materialize(stage, self.device, self.seed, self.std, self.source, self.params_device)
        phase = "weights"
        for converter in self.converters:
            if converter.phase is not None:
                phases.mark(phase, converter.phase)
                converter.materialised(stage, self.device, self.compute_dtype)
                phase = converter.phase
        phases.mark(phase, "optimizer")
        return numel


class OnMeta:
    """A materialiser that leaves the stage on the meta device (a build checked, never run)."""

    device = torch.device("cpu")

    def __call__(self, stage: nn.Module) -> int:
        return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in stage.parameters())


class FakeMaterialise:
    """The tracer's materialiser: the local shards as fake tensors on ``device`` (no memory allocated, no
    values); ``mode`` is the fake tensor mode the trace then runs in."""

    def __init__(self, device: torch.device):
        self.device = device
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def __call__(self, stage: nn.Module) -> int:
        """Give ``stage`` fake local shards; returns their element count."""
        with self.mode:
            stage.to_empty(device=self.device)
            stage.retie()
            stage.reset_buffers(self.device)
        # _local_tensor: the shard's size without dispatching an op on the fake tensors
        return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in stage.parameters())


@dataclass
class RankModel:
    """A rank's model as built: ``chunks`` (what the pipeline schedule runs: one stage, or v chunks under
    interleaved 1F1B), ``stage`` (what the optimizer, clipping and memory tracker see: the one stage or
    ``InterleavedStages``) and ``local_numel``, its parameter elements on this rank."""

    chunks: list[StageModule]
    stage: nn.Module
    local_numel: int


def build_rank_model(spec: TrialSpec, mesh: Optional[DeviceMesh], pp_rank: int, materialise: Materialiser,
                     param_dtype: Optional[torch.dtype]) -> RankModel:
    """Pipeline rank ``pp_rank``'s model of ``spec``: built on meta, parallelized per chunk (TP, then
    checkpointing of ``act_ckpt_layers / v`` layers, then DP; ``param_dtype`` is FSDP2's compute dtype),
    then materialised by ``materialise``."""
    par = spec.parallel
    chunks = build_rank_stages(spec.model, par.pp, pp_rank, par.virtual_stages)
    chunk_par = dataclasses.replace(par, act_ckpt_layers=par.act_ckpt_layers // par.virtual_stages)
    for chunk in chunks:
        if param_dtype is not None:  # 16-bit training: an adapter method's base, or everything with bf16 masters
            # bf16 masters, or the optimizer's offload, whose fp32 master is on the host: trained weights too
            hold_in(chunk, param_dtype, trained=spec.parallel.master_weights == "bf16"
                    or master_on_host(spec.parallel.engine, spec.parallel.offload))
        parallelize_stage(chunk, chunk_par, mesh, param_dtype, materialise.device, fp8=spec.model.fp8)
    stage = chunks[0] if len(chunks) == 1 else InterleavedStages(chunks)
    phases.mark("model_build", "weights")
    return RankModel(chunks, stage, materialise(stage))


def build_rank_optimizer(spec: TrialSpec, stage: nn.Module, mesh: Optional[DeviceMesh],
                         device: torch.device) -> torch.optim.Optimizer:
    """AdamW over ``stage``'s materialised parameters for the spec's ZeRO stage and offload (ZeRO-1 shards
    its states over the ranks holding the same weights, ``weight_dp_group``)."""
    par = spec.parallel
    optim.use_host_threads(spec, device)
    return optim.build_optimizer(stage, spec.training, device, par.zero_stage, weight_dp_group(mesh, par),
                                 offload=par.offload)
