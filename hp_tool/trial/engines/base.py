"""What the training loop needs of a trial engine, whichever runs the step (torch, DeepSpeed)."""

from __future__ import annotations

import os
from typing import Optional, Protocol

import torch
from torch import nn

from hp_tool.contracts.spec import ParallelSpec, TrialSpec
from hp_tool.trial.dist import DistEnv

# Test hook: the rank named here raises at optimizer step HP_TOOL_TRIAL_FAIL_STEP (1-based, default 1),
# to check that a failure on one rank leaves a status on disk and no rank hangs.
FAIL_RANK_ENV = "HP_TOOL_TRIAL_FAIL_RANK"
FAIL_STEP_ENV = "HP_TOOL_TRIAL_FAIL_STEP"


class Engine(Protocol):
    """One rank's engine: built by its class's ``build`` (``ENGINES[spec.parallel.engine]``), then one
    ``step`` per optimizer step. The loop reads what it measures from these attributes."""

    spec: TrialSpec
    env: DistEnv
    device: torch.device
    stage: nn.Module
    """This rank's model (a stage, or the rank's chunks as one module)."""
    optimizer: torch.optim.Optimizer
    local_numel: int
    """Parameter elements materialised on this rank."""
    grad_norm: Optional[float]
    """The last step's whole-model gradient norm before clipping (None where the engine keeps none)."""

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (the last pipeline stage)."""

    @property
    def measures_tensor_peak(self) -> bool:
        """Whether the loop measures this engine's tensor peak with ``TensorPeak`` over the first untimed
        steps (the count the pre-launch trace of the torch engine makes)."""

    @classmethod
    def needs_process_group(cls, par: ParallelSpec) -> bool:
        """Whether this engine needs a process group to run ``par`` even on one process (the trial then
        makes a one-rank group)."""

    @classmethod
    def validate(cls, spec: TrialSpec) -> None:
        """Build ``spec`` as ``build`` does, on the meta device over a fake process group of the layout's
        world size (no memory, no other process); raises what ``build`` would refuse."""

    @classmethod
    def build(cls, spec: TrialSpec, env: DistEnv, device: torch.device) -> "Engine":
        """Everything this rank needs to train; allocates only this rank's shard of the model."""

    def step(self, step: int) -> Optional[torch.Tensor]:
        """One optimizer step (``step`` is 0-based); this rank's mean micro-batch loss, None off the last
        stage."""

    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> Optional[dict[str, torch.Tensor]]:
        """Every parameter of the whole model, unsharded and cast to ``dtype``, by canonical name (CPU) on
        rank 0; None on the other ranks. Collective: every rank calls it."""


def maybe_inject_failure(env: DistEnv, step: int) -> None:
    """Raise on the rank and 1-based step the test hook's environment names (``FAIL_RANK_ENV``)."""
    if os.environ.get(FAIL_RANK_ENV) == str(env.rank) and int(os.environ.get(FAIL_STEP_ENV, "1")) == step:
        raise RuntimeError(f"injected failure on rank {env.rank} at step {step} ({FAIL_RANK_ENV})")
