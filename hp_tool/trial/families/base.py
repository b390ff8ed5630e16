"""The torch half of a model family: what the trial engine needs to build, shard and trace one family's
model, as one frozen record per family, and the lookup every engine module goes through.

A family module (``gpt3.py``, ``llama.py``, ``t5.py``) builds its records and calls ``register``; the
package imports every module in this folder, so adding a family is one file here. The record is the only
place that names the modules of a family's layers: the shared engine code asks it for its tensor- and
sequence-parallel plans, the attention module context parallelism switches to the ring, and what its
stage's forward computes beyond calling its modules (``stage_hooks``), as torchtitan's per-model
``parallelize.py``. Planning facts about a family (shapes, parameter and FLOP counts) live on the pure
side, in ``hp_tool.architectures``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from torch import nn

from hp_tool.contracts.spec import ModelSpec, TrialSpec
from hp_tool.registry import Registry
from hp_tool.trial.causal import DecoderHooks
from hp_tool.trial.stage import StageModule

TPStyle = Literal["colwise", "rowwise"]
FakeBatch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True)
class SequencePlan:
    """Sequence parallelism of one layer on top of its TP plan (Korthikanti et al. 2022; torchtitan's plan):
    the ``sharded`` modules (the norms) run on sequence shards, each ``gathered`` module gathers the whole
    sequence at its input, and the TP plan's row-split projections reduce-scatter their outputs back to
    shards (an all-reduce becomes an all-gather and a reduce-scatter of the same volume). Names are relative
    to the layer."""

    sharded: tuple[str, ...]
    gathered: dict[str, Optional[str]]
    """Module -> the keyword argument its hidden states come in by (None: its first positional argument)."""


@dataclass(frozen=True)
class TorchFamily:
    """How the trial engine builds, shards and traces one model family."""

    name: str
    """``model.family`` in a TrialSpec."""
    config: Callable[[ModelSpec], object]
    """The transformers config for a spec's shape: dropout off, no KV cache (every layout computes the same
    numbers)."""
    model_class: type
    """The transformers model class the whole model is built from, on the meta device."""
    cut_stage: Callable[[ModelSpec, nn.Module, int, int, DecoderHooks], StageModule]
    """``(model spec, whole model on meta, pp, stage, the record's stage_hooks)`` -> that pipeline stage; the
    rest is dropped."""
    layer_plan: Callable[[nn.Module], dict[str, TPStyle]]
    """Tensor parallelism of one layer (Megatron's): module name (relative to the layer) -> split by
    columns or by rows, in the order ``parallelize_module`` applies them."""
    shard_heads: Callable[[nn.Module, int], None]
    """After a layer's TP split, make its attention modules count the heads one of ``tp`` ranks holds (the
    attributes transformers reshapes with); a no-op where the modules infer it from the weights."""
    sequence_plan: Optional[SequencePlan]
    """Sequence parallelism of one layer (with ``layer_plan``); None: the engine has none for the family's layers
    (``hp_tool.families``' ``sequence_parallel`` says so to the planner)."""
    attention: Optional[str]
    """One layer's attention module (relative to the layer): context parallelism runs its attention function
    as the ring (:mod:`hp_tool.trial.context_parallel`); None: the family's attention is not split that way."""
    fake_batch: Callable[[TrialSpec, int, Optional[torch.dtype]], FakeBatch]
    """``(spec, stage index, compute dtype or None)`` -> one micro-batch of that stage's inputs and the
    labels, for the memory tracer (fake tensors: shapes and dtypes only)."""
    stacks: int = 1
    """Layer stacks a single stage (PP = 1) holds: 1 decoder-only, 2 encoder-decoder. The tracer's unit of
    depth is one layer per stack (``trace.extrapolate.stage_units``)."""
    hf_key: Optional[Callable[[str], str]] = None
    """A canonical parameter name -> its key in a Hugging Face checkpoint (``hp_tool.trial.checkpoint``);
    None: this family loads no checkpoint."""
    hf_parts: Callable[[ModelSpec, str], Optional["StoredParts"]] = lambda model, key: None
    """``(model spec, checkpoint key)`` -> where a checkpoint stores that tensor in parts, when it is not
    stored whole (a mixture of experts' published files keep each expert's projections apart; transformers'
    model fuses them into 3-D tensors); None: stored whole, as every dense family stores every tensor."""
    stack_starts: Callable[[int], tuple[int, ...]] = lambda pp: (0,)
    """``pp`` -> the first pipeline stage of each stack (T5: the encoder's at 0, the decoder's at PP/2):
    where the layers a stage holds change kind, so the tracer traces those stages."""
    expert_plan: Optional[dict[str, str]] = None
    """Expert parallelism of one layer of a mixture of experts: parameter or module name (relative to the
    layer) -> the style of transformers' expert-parallel plan (``grouped_gemm`` shards an experts tensor by
    expert, ``ep_dispatch_experts`` sends the module's tokens to the experts' ranks); None for a dense
    family, which has no experts to split."""
    stage_hooks: DecoderHooks = DecoderHooks()
    """What a decoder stage of the family computes beyond calling its modules (embedding scale, final logit
    soft-cap, each layer's attention window); the defaults, Llama's, add nothing. ``cut_stage`` gets them."""


@dataclass(frozen=True)
class StoredParts:
    """A tensor a checkpoint stores in parts: ``groups[i]`` are the keys concatenated along dim 0 into slice i;
    the slices stacked into a new first dimension (``stacked``: one per expert), or the one slice itself."""

    groups: tuple[tuple[str, ...], ...]
    stacked: bool = True


_FAMILIES: Registry[TorchFamily] = Registry("torch family")


def register(family: TorchFamily) -> TorchFamily:
    """Make ``family`` known to the engine under its name; a name registered twice is a programming error."""
    return _FAMILIES.add(family.name, family)


def known_families() -> tuple[str, ...]:
    """The families the trial engine can train, in registration order."""
    return tuple(name for name, _ in _FAMILIES.items())


def torch_family(name: str) -> TorchFamily:
    """The record of family ``name``; ConfigError (key ``model.family``) naming the known ones otherwise."""
    return _FAMILIES.get(name, "model.family", "the trial engine has no model class for this family",
                         ", or add hp_tool/trial/families/<family>.py registering it")
