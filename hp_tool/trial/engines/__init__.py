"""The trial engines, keyed by a TrialSpec's ``parallel.engine``: each implements
:class:`~hp_tool.trial.engines.base.Engine` (``build`` one rank's engine, one ``step``, what it measures).

    base.py           the ``Engine`` protocol, the failure-injection test hook
    torch_engine.py   ``TorchEngine``: torch's TP, FSDP2 / replicate, pipeline schedules
    ds_engine.py      ``DeepSpeedEngine``: ``deepspeed.initialize`` with ZeRO, offload and AutoTP
"""

from __future__ import annotations

from typing import Optional

import torch

from hp_tool.contracts.spec import TrialSpec
from hp_tool.errors import require
from hp_tool.trial.dist import DistEnv
from hp_tool.trial.engines.base import Engine, maybe_inject_failure
from hp_tool.trial.engines.ds_engine import DeepSpeedEngine
from hp_tool.trial.engines.torch_engine import TorchEngine

# The registry: the engine named by a spec's parallel.engine builds each rank.
ENGINES: dict[str, type[Engine]] = {"torch": TorchEngine, "deepspeed": DeepSpeedEngine}


def build_engine(spec: TrialSpec, env: DistEnv, device: torch.device) -> Engine:
    """This rank's engine of the kind ``spec.parallel.engine`` names."""
    engine = spec.parallel.engine
    require(engine in ENGINES, "parallel.engine", engine, "the trial engine has no implementation of it",
            f"use one of {list(ENGINES)}")
    return ENGINES[engine].build(spec, env, device)


def validate_build(spec: TrialSpec) -> None:
    """Build ``spec``'s layout the way its engine does, without memory and without other processes (a fake
    process group of the layout's world size): raises whatever the engine's build would refuse. The
    layout's rules themselves run when the spec is made (``TrialSpec``: ``Layout.problems``, the planner's
    rules)."""
    engine = spec.parallel.engine
    require(engine in ENGINES, "parallel.engine", engine, "the trial engine has no implementation of it",
            f"use one of {list(ENGINES)}")
    ENGINES[engine].validate(spec)


def engine_needs_process_group(spec: TrialSpec) -> bool:
    """Whether the spec's engine needs a process group even in one process (then the trial makes a
    one-rank group): DeepSpeed always, the torch engine for FSDP2's CPU offload."""
    engine = ENGINES.get(spec.parallel.engine)
    return engine is not None and engine.needs_process_group(spec.parallel)


def train_step(engine: Engine, step: int) -> Optional[torch.Tensor]:
    """One optimizer step (``step`` is 0-based) of any engine; this rank's mean loss (None off the last
    stage)."""
    maybe_inject_failure(engine.env, step + 1)
    return engine.step(step)


__all__ = ["ENGINES", "Engine", "build_engine", "engine_needs_process_group", "train_step",
           "validate_build"]
