"""The torch trial engine: one rank's model stage, optimizer, pipeline schedule and data, and one step.

Build: mesh -> this rank's model through :func:`hp_tool.trial.rank.build_rank_model` (stage on meta, TP, EP or
CP, activation checkpointing, DP per chunk, then the real materialiser: only the local shards, deterministic
init) -> optimizer -> with PP the pipeline schedule and the tied embedding/head pair. With context parallelism
each rank trains on its part of the replica's sequences (:mod:`hp_tool.trial.context_parallel`). One
optimizer step runs ``grad_accum_steps`` micro-batches (through the pipeline schedule when PP > 1),
completes the experts' gradients (expert parallelism, :func:`hp_tool.trial.parallel.complete_expert_grads`),
syncs tied gradients across the first and last stages, clips with the model-wide norm and steps AdamW. In
fp16 on GPU the loss is scaled before each backward and the gradients unscaled before clipping; a step whose
gradients overflowed is skipped (:func:`hp_tool.trial.optim.loss_scaler`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hp_tool.contracts import phases
from hp_tool.contracts.spec import ParallelSpec, TrialSpec
from hp_tool.trial import optim
from hp_tool.trial.activation_offload import saved_tensors_offload
from hp_tool.trial.context_parallel import whole_sequence_mean
from hp_tool.trial.data import TokenBatches
from hp_tool.vocab import trial_device
from hp_tool.trial.dist import DistEnv, build_mesh, solo_or_fake_group
from hp_tool.trial.models import loss_parallel_context, stage_loss_fn
from hp_tool.trial.stage import canonical_name
from hp_tool.trial.parallel import build_schedule, complete_expert_grads, needs_grad_sync_control, set_grad_sync
from hp_tool.trial.rank import (Initialise, OnMeta, build_rank_model, build_rank_optimizer, compute_dtype, group_of,
                                tp_mesh_of)

log = logging.getLogger(__name__)


@dataclass
class TorchEngine:
    """One rank's torch engine (:class:`hp_tool.trial.engines.base.Engine`)."""

    spec: TrialSpec
    env: DistEnv
    device: torch.device
    mesh: Optional[DeviceMesh]
    stage: torch.nn.Module  # a StageModule, or InterleavedStages: the rank's chunks under interleaved 1F1B
    optimizer: torch.optim.Optimizer
    batches: TokenBatches
    schedule: object = None  # torch.distributed.pipelining schedule when pp > 1
    pp_rank: int = 0
    tied_param: Optional[torch.nn.Parameter] = None  # tied embedding/head copy held by this stage
    tied_group: Optional[dist.ProcessGroup] = None
    local_numel: int = 0  # parameter elements materialised on this rank
    grad_norm: Optional[float] = None  # the last step's whole-model gradient norm before clipping
    scaler: Optional[torch.amp.GradScaler] = None  # fp16's dynamic loss scaler; None in bf16 and fp32
    compute_loss: Optional[object] = None  # (output, labels) -> loss: the spec's loss (models.stage_loss_fn)
    measures_tensor_peak: ClassVar[bool] = True  # the engine the pre-launch trace models

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.spec.parallel.pp - 1

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        return tp_mesh_of(self.mesh, self.spec.parallel)

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        return group_of(self.mesh, self.spec.parallel, "pp")

    @classmethod
    def needs_process_group(cls, par: ParallelSpec) -> bool:
        """FSDP2 offloads (``CPUOffloadPolicy``) over a device mesh: one process offloads over a mesh of one."""
        return par.offload != "none"

    @classmethod
    def validate(cls, spec: TrialSpec) -> None:
        """Each pipeline rank's model built by ``build_rank_model`` on meta (parallelized, never
        materialised) over a fake group of the world size: the first and last stages (embeddings, head)."""
        par = spec.parallel
        world = par.pp * par.dp * par.cp * par.tp
        target = torch.device(trial_device(spec.resources.gpu))  # the dtype the run computes in
        with solo_or_fake_group(world, cls.needs_process_group(par)):
            for pp_rank in sorted({0, par.pp - 1}):
                env = DistEnv(pp_rank * (world // par.pp), world, 0)
                mesh = build_mesh(par, env, torch.device("cpu"))
                build_rank_model(spec, mesh, pp_rank, OnMeta(), compute_dtype(spec, target))

    @classmethod
    def build(cls, spec: TrialSpec, env: DistEnv, device: torch.device) -> "TorchEngine":
        """Everything this rank needs to train; allocates only this rank's shard of the model."""
        par = spec.parallel
        mesh = build_mesh(par, env, device)
        pp_rank = mesh["pp"].get_local_rank() if mesh is not None else 0
        dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        cp_rank = mesh["cp"].get_local_rank() if par.cp > 1 else 0
        model = build_rank_model(spec, mesh, pp_rank, Initialise.of(spec, device, par.offload == "optimizer_and_params"),
                                 compute_dtype(spec, device))
        log.info("rank %d: stage %d holds %d parameter elements", env.rank, pp_rank, model.local_numel)
        optimizer = build_rank_optimizer(spec, model.stage, mesh, device)
        phases.mark("optimizer", "first_forward" if par.pp == 1 else "first_step")
        engine = cls(spec, env, device, mesh, model.stage, optimizer, TokenBatches(spec, dp_rank, device, cp_rank),
                     pp_rank=pp_rank, local_numel=model.local_numel,
                     scaler=optim.loss_scaler(device, compute_dtype(spec, device)))
        engine.compute_loss = stage_loss_fn(model.stage, par, engine.tp_mesh)
        if par.pp > 1:
            engine.schedule = build_schedule(model.chunks, par, mesh, pp_rank, spec.grad_accum_steps, device,
                                             engine._scaled(engine.compute_loss))
            if model.stage.tied:
                engine.tied_group = _tied_group(mesh, par.pp)
                engine.tied_param = model.stage.embed_tokens.weight if model.stage.is_first \
                    else model.stage.lm_head.weight
        return engine

    def step(self, step: int) -> Optional[torch.Tensor]:
        """One optimizer step (``step`` is 0-based); this stage's mean loss (None off the last stage), over whole
        sequences with context parallelism (``whole_sequence_mean``)."""
        optim.set_lr(self.optimizer, optim.lr_at(step, self.spec.training))
        loss = self._pipeline(step) if self.schedule is not None else \
            whole_sequence_mean(self._accumulate(step), group_of(self.mesh, self.spec.parallel, "cp"))
        complete_expert_grads(self.stage, self.spec.parallel.ep, group_of(self.mesh, self.spec.parallel, "tp"))
        optim.sync_tied_grads(self.tied_param, self.tied_group)
        optim.unscale_grads(self.optimizer, self.scaler)
        skip = frozenset({id(self.tied_param)}) if self.tied_param is not None and self.is_last_stage \
            else frozenset()
        norm = optim.clip_grad_norm(self.stage, self.spec.training.grad_clip, self.pp_group, skip, self.device)
        self.grad_norm = float(norm)  # inf or NaN on a step the loss scaler skips
        optim.optimizer_step(self.optimizer, self.scaler)
        return loss

    def _scaled(self, compute_loss):
        """``compute_loss`` multiplied by the loss scale (fp16), for a backward the pipeline schedule runs."""
        if self.scaler is None:
            return compute_loss
        return lambda output, target: self.scaler.scale(compute_loss(output, target))

    def _unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss the scaled loss function returned, divided by the loss scale again."""
        return loss if self.scaler is None else loss / self.scaler.get_scale()

    def _saved_tensors(self):
        """Where autograd keeps the tensors saved for backward: in (pinned, on a GPU) host memory with
        ``parallel.activation_offload`` (copied out in forward, back in backward), else where they are made;
        the trace applies the same rule (:mod:`hp_tool.trial.activation_offload`)."""
        return saved_tensors_offload(self.spec.parallel, self.device)

    def _autocast(self):
        """The precision's autocast on GPU; a no-op in fp32."""
        dtype = compute_dtype(self.spec, self.device)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _accumulate(self, step: int) -> torch.Tensor:
        """Forward and backward of all micro-batches of one step (no PP); returns their mean loss."""
        micro = self.batches.micro_batches(step)
        control_sync = needs_grad_sync_control(self.spec.parallel)
        compute_loss = self.compute_loss
        total = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(micro):
            if control_sync:
                set_grad_sync(self.stage, i == len(micro) - 1)
            with loss_parallel_context(self.tp_mesh), self._saved_tensors():
                with self._autocast():
                    loss = compute_loss(self.stage(*inputs), labels)
                first = step == 0 and i == 0
                if first:
                    phases.mark("first_forward", "first_backward")
                share = loss / len(micro)
                (share if self.scaler is None else self.scaler.scale(share)).backward()
                if first:
                    phases.mark("first_backward", "first_step")
            total += loss.detach()
        return total / len(micro)

    def _pipeline(self, step: int) -> Optional[torch.Tensor]:
        """One step through the pipeline schedule; the mean micro-batch loss on the last stage, else None."""
        inputs, labels = self.batches.replica_batch(step)
        losses: list = []
        first, last = self.pp_rank == 0, self.is_last_stage
        args = inputs if first else ()
        kwargs = {"target": labels, "losses": losses} if last else {}
        with loss_parallel_context(self.tp_mesh), self._saved_tensors(), self._autocast():
            self.schedule.step(*args, return_outputs=False, **kwargs)
        return self._unscaled(torch.stack(losses).mean().detach()) if last else None

    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> Optional[dict[str, torch.Tensor]]:
        """Every parameter, unsharded (each DTensor gathered over its mesh) and cast to ``dtype``, from one
        rank per pipeline stage (data-, context- and tensor-parallel rank 0) to rank 0."""
        mine = {}
        for name, param in self.stage.named_parameters():
            if not param.is_floating_point():  # QLoRA's packed 4-bit weights: saved as the base checkpoint is
                continue
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            mine[canonical_name(name, self.stage.tied)] = full.to(dtype).cpu()
        if self.mesh is None:
            return mine
        replicas = ("dp", "cp", "tp") if self.spec.parallel.cp > 1 else ("dp", "tp")
        keeps = all(self.mesh[dim].get_local_rank() == 0 for dim in replicas)
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine if keeps else {}, parts, dst=0)
        return None if parts is None else {k: v for part in parts for k, v in part.items()}


def _tied_group(mesh: DeviceMesh, pp: int) -> Optional[dist.ProcessGroup]:
    """The group {first stage, last stage} at this rank's coordinate in the other mesh dimensions ((dp, tp),
    or (edp, ep, tp) with expert parallelism); every rank creates all."""
    ranks = mesh.mesh.reshape(pp, -1)  # [pp, every other coordinate] global ranks
    mine = None
    for column in range(ranks.shape[1]):
        pair = [int(ranks[0, column]), int(ranks[pp - 1, column])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
