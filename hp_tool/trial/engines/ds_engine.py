"""The DeepSpeed trial engine: the same model, weights, data and stop rule as the torch engine, trained by
``deepspeed.initialize`` with the TrialSpec's ZeRO stage, offload and AutoTP tensor parallelism.

Build: the stage of the whole model (no pipeline parallelism) on meta -> activation checkpointing of the
first k layers -> materialise on this rank's device -> the deterministic layout-independent init
(:mod:`hp_tool.trial.weights`), so a DeepSpeed trial starts from the torch engine's weights -> with TP,
DeepSpeed's AutoTP shards the linear layers -> ``deepspeed.initialize`` with the config of
:func:`hp_tool.contracts.ds_config.ds_config` and hp_tool's own optimizer: torch AdamW with the torch
engine's parameter groups, or DeepSpeed's CPU Adam (AdamW mode) when the optimizer is offloaded, which is
what DeepSpeed runs there in production. One optimizer step: ``backward`` and ``step`` per micro-batch
(DeepSpeed divides by the accumulation steps and steps the optimizer on the last one, clipping first);
the learning rate of the TrialSpec's schedule is set on the optimizer's groups before each step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from hp_tool.contracts.ds_config import ds_config
from hp_tool.contracts import phases
from hp_tool.contracts.spec import ParallelSpec, TrialSpec
from hp_tool.trial import optim
from hp_tool.trial.data import TokenBatches
from hp_tool.trial.dist import DistEnv, solo_or_fake_group
from hp_tool.trial.models import build_stage, loss_fn
from hp_tool.trial.parallel import apply_activation_checkpointing
from hp_tool.trial.rank import Initialise
from hp_tool.trial.stage import canonical_name
from hp_tool.vocab import trial_device

log = logging.getLogger(__name__)


def engine_config(spec: TrialSpec, device: torch.device) -> dict:
    """The DeepSpeed config the trial runs: the spec's, in fp32 on CPU (as the torch engine), pinned
    host buffers only with a GPU, and no batch-size total under AutoTP (DeepSpeed checks it against the
    whole world before it knows the TP groups; micro-batch and accumulation steps define it)."""
    config = ds_config(spec, with_optimizer=False, pin_memory=device.type == "cuda")
    if device.type != "cuda":
        config["bf16"] = {"enabled": False}
        config["fp16"] = {"enabled": False}
    if spec.parallel.tp > 1:
        del config["train_batch_size"]
    return config


def _optimizer(module: torch.nn.Module, spec: TrialSpec, device: torch.device) -> torch.optim.Optimizer:
    """The torch engine's AdamW; DeepSpeed's CPU Adam (AdamW mode) on the same groups when offloaded."""
    t = spec.training
    if spec.parallel.offload == "none":
        return optim.build_optimizer(module, t, device)
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # DeepSpeed is optional: imported only when it runs

    optim.use_host_threads(spec, device)  # CPU Adam's OpenMP threads

    return DeepSpeedCPUAdam(optim.param_groups(module, t.weight_decay), lr=optim.lr_at(0, t),
                            betas=tuple(t.betas), eps=1e-8, weight_decay=t.weight_decay, adamw_mode=True)


@dataclass
class DeepSpeedEngine:
    """One rank's DeepSpeed engine (:class:`hp_tool.trial.engines.base.Engine`): the whole model on every
    rank (no pipeline), ``ds`` the ``DeepSpeedEngine`` that steps it."""

    spec: TrialSpec
    env: DistEnv
    device: torch.device
    stage: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: TokenBatches
    ds: object  # deepspeed.DeepSpeedEngine
    local_numel: int = 0  # parameter elements on this rank (ZeRO-3: its partition)
    grad_norm: Optional[float] = None  # the last step's gradient norm (None at ZeRO-0, which keeps none)
    is_last_stage: ClassVar[bool] = True  # no pipeline: every rank computes the loss
    measures_tensor_peak: ClassVar[bool] = False  # the pre-launch trace models the torch engine only

    @classmethod
    def build(cls, spec: TrialSpec, env: DistEnv, device: torch.device) -> "DeepSpeedEngine":
        """This rank's DeepSpeed engine; DeepSpeed (an optional dependency) is imported only here."""
        import deepspeed  # optional dependency: a torch-engine trial never imports it

        par = spec.parallel
        stage = build_stage(spec.model, 1, 0)
        if par.act_ckpt_layers > 0:
            apply_activation_checkpointing(stage, par.act_ckpt_layers)
        phases.mark("model_build", "weights")
        Initialise.of(spec, device)(stage)
        if par.tp > 1:
            stage = deepspeed.tp_model_init(stage, tp_size=par.tp, dtype=torch.float32 if device.type != "cuda"
                                            else {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                                                spec.training.precision, torch.float32))
        ds, optimizer, _, _ = deepspeed.initialize(model=stage, optimizer=_optimizer(stage, spec, device),
                                                   config=engine_config(spec, device),
                                                   dist_init_required=False)
        phases.mark("optimizer", "first_forward")
        numel = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in stage.parameters())
        dp_rank = env.rank // par.tp  # the TP ranks of one replica read the same batch
        log.info("rank %d: DeepSpeed ZeRO-%d offload=%s tp=%d over %d parameter elements", env.rank,
                 par.zero_stage, par.offload, par.tp, numel)
        return cls(spec, env, device, stage, optimizer, TokenBatches(spec, dp_rank, device), ds, local_numel=numel)

    @classmethod
    def validate(cls, spec: TrialSpec) -> None:
        """DeepSpeed's own check of the config the trial runs (batch sizes over the world, ZeRO stage and
        offload), over a fake process group of the layout's world size."""
        import deepspeed.comm
        from deepspeed.runtime.config import DeepSpeedConfig

        par = spec.parallel
        world = par.pp * par.dp * par.cp * par.tp
        target = torch.device(trial_device(spec.resources.gpu))
        with solo_or_fake_group(world, cls.needs_process_group(par)):
            deepspeed.comm.init_distributed(dist_backend="gloo", dist_init_required=False, auto_mpi_discovery=False)
            DeepSpeedConfig(engine_config(spec, target))

    @classmethod
    def needs_process_group(cls, par: ParallelSpec) -> bool:
        """``deepspeed.initialize`` asks for an initialised process group, one process included."""
        return True

    def step(self, step: int) -> Optional[torch.Tensor]:
        """One optimizer step: ``backward`` and ``step`` per micro-batch (DeepSpeed steps the optimizer on
        the last); the mean micro-batch loss on this rank."""
        ds = self.ds
        optim.set_lr(ds.optimizer, optim.lr_at(step, self.spec.training))
        micro = self.batches.micro_batches(step)
        total = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(micro):
            first = step == 0 and i == 0
            loss = loss_fn(ds(*inputs), labels)
            if first:
                phases.mark("first_forward", "first_backward")
            ds.backward(loss)
            if first:
                phases.mark("first_backward", "first_step")
            ds.step()
            total += loss.detach()
        norm = ds.get_global_grad_norm()  # None at ZeRO-0, which keeps no norm
        self.grad_norm = None if norm is None else float(norm)
        return total / len(micro)  # under AutoTP every TP rank holds the same loss

    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> Optional[dict[str, torch.Tensor]]:
        """Every parameter, whole and cast to ``dtype``, on rank 0: DeepSpeed's own consolidation where the
        weights are split (ZeRO-3 partitions, AutoTP shards), else the module's parameters as they are."""
        names = {n for n, _ in self.stage.named_parameters(remove_duplicate=False)}
        par = self.spec.parallel
        if par.zero_stage == 3 or par.tp > 1:
            state = self.ds._consolidated_16bit_state_dict()  # collective; None off rank 0
        else:
            state = dict(self.stage.named_parameters()) if self.env.rank == 0 else None
        if state is None:
            return None
        return {canonical_name(n, self.stage.tied): t.detach().to(dtype).cpu().clone()
                for n, t in state.items() if n in names}
