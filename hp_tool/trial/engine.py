"""One rank's training engine: its model stage, optimizer, pipeline schedule and data, and one step.

Build order: mesh -> this rank's pipeline stage on meta (its v chunks under interleaved 1F1B) -> TP,
activation checkpointing, DP per chunk (still on meta) -> materialise only the local shards ->
deterministic init -> optimizer. One optimizer step runs
``grad_accum_steps`` micro-batches (through the pipeline schedule when PP > 1), syncs tied gradients
across the first and last stages, clips with the model-wide norm and steps AdamW.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hp_tool.trial import optim
from hp_tool.trial.data import TokenBatches
from hp_tool.trial.dist import DistEnv, build_mesh
from hp_tool.trial.models import (InterleavedStages, StageModule, build_rank_stages, loss_parallel_context,
                                  make_loss_fn)
from hp_tool.trial.parallel import (build_schedule, needs_grad_sync_control, parallelize_stage,
                                    set_grad_sync)
from hp_tool.contracts.spec import TrialSpec
from hp_tool.trial.weights import materialize

log = logging.getLogger(__name__)

# Test hook: the rank named here raises at optimizer step HP_TOOL_TRIAL_FAIL_STEP (1-based, default 1),
# to check that a failure on one rank leaves a status on disk and no rank hangs.
FAIL_RANK_ENV = "HP_TOOL_TRIAL_FAIL_RANK"
FAIL_STEP_ENV = "HP_TOOL_TRIAL_FAIL_STEP"


@dataclass
class Engine:
    spec: TrialSpec
    env: DistEnv
    device: torch.device
    mesh: Optional[DeviceMesh]
    stage: StageModule  # or InterleavedStages: the rank's chunks under interleaved 1F1B
    optimizer: torch.optim.Optimizer
    batches: TokenBatches
    schedule: object = None  # torch.distributed.pipelining schedule when pp > 1
    pp_rank: int = 0
    tied_param: Optional[torch.nn.Parameter] = None  # tied embedding/head copy held by this stage
    tied_group: Optional[dist.ProcessGroup] = None
    local_numel: int = 0  # parameter elements materialised on this rank
    ds: object = None  # the DeepSpeedEngine when spec.parallel.engine == "deepspeed" (ds_engine.py)
    grad_norm: Optional[float] = None  # the last step's whole-model gradient norm before clipping

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.spec.parallel.pp - 1

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        return tp_mesh_of(self.mesh, self.spec.parallel)

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        return group_of(self.mesh, self.spec.parallel, "pp")


def tp_mesh_of(mesh: Optional[DeviceMesh], par) -> Optional[DeviceMesh]:
    """The ``tp`` sub-mesh when the layout splits tensors, else None."""
    return mesh["tp"] if mesh is not None and par.tp > 1 else None


def group_of(mesh: Optional[DeviceMesh], par, dim: str) -> Optional[dist.ProcessGroup]:
    """The process group of mesh dimension ``dim`` ("pp" or "dp") when the layout has more than one rank
    along it, else None."""
    return mesh[dim].get_group() if mesh is not None and getattr(par, dim) > 1 else None


def compute_dtype(spec: TrialSpec, device: torch.device) -> Optional[torch.dtype]:
    """bf16/fp16 autocast dtype on GPU; None (fp32) on CPU or with precision fp32."""
    if device.type != "cuda" or spec.training.precision == "fp32":
        return None
    return torch.bfloat16 if spec.training.precision == "bf16" else torch.float16


def _tied_group(mesh: DeviceMesh, pp: int) -> Optional[dist.ProcessGroup]:
    """The group {first stage, last stage} at this rank's (dp, tp) coordinate; every rank creates all."""
    ranks = mesh.mesh  # [pp, dp, tp] global ranks
    mine = None
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[0, d, t]), int(ranks[pp - 1, d, t])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
    return mine


def build_engine(spec: TrialSpec, env: DistEnv, device: torch.device) -> Engine:
    """Everything this rank needs to train; allocates only this rank's shard of the model."""
    if spec.parallel.engine == "deepspeed":
        from hp_tool.trial.ds_engine import build_ds_engine

        return build_ds_engine(spec, env, device)
    par = spec.parallel
    mesh = build_mesh(par, env, device)
    pp_rank = mesh["pp"].get_local_rank() if mesh is not None else 0
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    chunks = build_rank_stages(spec.model, par.pp, pp_rank, par.virtual_stages)
    chunk_par = dataclasses.replace(par, act_ckpt_layers=par.act_ckpt_layers // par.virtual_stages)
    for chunk in chunks:
        parallelize_stage(chunk, chunk_par, mesh, compute_dtype(spec, device), device)
    stage = chunks[0] if len(chunks) == 1 else InterleavedStages(chunks)
    numel = materialize(stage, device, spec.training.seed, spec.model.init_method_std)
    log.info("rank %d: stage %d holds %d parameter elements", env.rank, pp_rank, numel)
    dp_group = group_of(mesh, par, "dp")
    optimizer = optim.build_optimizer(stage, spec.training, device, par.zero_stage, dp_group,
                                      offload=par.offload != "none")
    engine = Engine(spec, env, device, mesh, stage, optimizer,
                    TokenBatches(spec, dp_rank, device), pp_rank=pp_rank, local_numel=numel)
    if par.pp > 1:
        engine.schedule = build_schedule(chunks, par, mesh, pp_rank, spec.grad_accum_steps, device,
                                         make_loss_fn(engine.tp_mesh))
        if stage.tied:
            engine.tied_group = _tied_group(mesh, par.pp)
            engine.tied_param = stage.embed_tokens.weight if stage.is_first else stage.lm_head.weight
    return engine


def _maybe_inject_failure(env: DistEnv, step: int) -> None:
    if os.environ.get(FAIL_RANK_ENV) == str(env.rank) and int(os.environ.get(FAIL_STEP_ENV, "1")) == step:
        raise RuntimeError(f"injected failure on rank {env.rank} at step {step} ({FAIL_RANK_ENV})")


def _autocast(engine: Engine):
    dtype = compute_dtype(engine.spec, engine.device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=engine.device.type, dtype=dtype)


def _accumulate(engine: Engine, step: int) -> Optional[torch.Tensor]:
    """Forward and backward of all micro-batches of one step (no PP); returns their mean loss."""
    micro = engine.batches.micro_batches(step)
    control_sync = needs_grad_sync_control(engine.spec.parallel)
    compute_loss = make_loss_fn(engine.tp_mesh)
    total = torch.zeros((), device=engine.device)
    for i, (inputs, labels) in enumerate(micro):
        if control_sync:
            set_grad_sync(engine.stage, i == len(micro) - 1)
        with loss_parallel_context(engine.tp_mesh):
            with _autocast(engine):
                loss = compute_loss(engine.stage(*inputs), labels)
            (loss / len(micro)).backward()
        total += loss.detach()
    return total / len(micro)


def _pipeline(engine: Engine, step: int) -> Optional[torch.Tensor]:
    """One step through the pipeline schedule; the mean micro-batch loss on the last stage, else None."""
    inputs, labels = engine.batches.replica_batch(step)
    losses: list = []
    first, last = engine.pp_rank == 0, engine.is_last_stage
    args = inputs if first else ()
    kwargs = {"target": labels, "losses": losses} if last else {}
    with loss_parallel_context(engine.tp_mesh), _autocast(engine):
        engine.schedule.step(*args, return_outputs=False, **kwargs)
    return torch.stack(losses).mean().detach() if last else None


def train_step(engine: Engine, step: int) -> Optional[torch.Tensor]:
    """One optimizer step (``step`` is 0-based); returns this stage's mean loss (None off the last stage)."""
    _maybe_inject_failure(engine.env, step + 1)
    if engine.ds is not None:
        from hp_tool.trial.ds_engine import ds_train_step

        return ds_train_step(engine, step)
    optim.set_lr(engine.optimizer, optim.lr_at(step, engine.spec.training))
    loss = _pipeline(engine, step) if engine.schedule is not None else _accumulate(engine, step)
    optim.sync_tied_grads(engine.tied_param, engine.tied_group)
    skip = frozenset({id(engine.tied_param)}) if engine.tied_param is not None and engine.is_last_stage \
        else frozenset()
    norm = optim.clip_grad_norm(engine.stage, engine.spec.training.grad_clip, engine.pp_group, skip, engine.device)
    engine.grad_norm = float(norm)
    optim.optimizer_step(engine.optimizer)
    return loss
