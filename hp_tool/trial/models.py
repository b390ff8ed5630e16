"""The trial's model: the spec's family's transformers model built on the meta device and cut into this
rank's pipeline stage (or its chunks under interleaved 1F1B), and the loss.

What differs by family (config, model class, how a stage is cut) is the family's record,
:func:`hp_tool.trial.families.torch_family`; the stage modules are :mod:`hp_tool.trial.causal`'s and
:mod:`hp_tool.trial.encdec`'s, their base class :mod:`hp_tool.trial.stage`'s.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from hp_tool.contracts.spec import ModelSpec
from hp_tool.recipe import LOSS_CHUNK_TOKENS
from hp_tool.trial.families import torch_family
from hp_tool.trial.converters import convert_stage
from hp_tool.trial.stage import StageModule


def hf_config(model: ModelSpec):
    """The transformers config for a spec's shape: dropout off, no KV cache (the family's record)."""
    return torch_family(model.family).config(model)


def build_full_model_on_meta(model: ModelSpec) -> nn.Module:
    """The whole transformers model on the meta device: no memory, whatever the size."""
    family = torch_family(model.family)
    config = family.config(model)
    with torch.device("meta"):
        return family.model_class(config)


def build_stage(model: ModelSpec, pp: int, stage: int) -> StageModule:
    """Pipeline stage ``stage`` of ``pp`` on the meta device; the other stages' modules are dropped; the
    training transforms the spec asks for applied (:mod:`hp_tool.trial.converters`: LoRA, QLoRA).
    A :class:`hp_tool.trial.causal.CausalLMStage`, or for T5/mT5 an :class:`hp_tool.trial.encdec.EncDecStage`."""
    family = torch_family(model.family)
    cut = family.cut_stage(model, build_full_model_on_meta(model), pp, stage, family.stage_hooks)
    return convert_stage(cut, model)


def build_rank_stages(model: ModelSpec, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[StageModule]:
    """The stage modules pipeline rank ``pp_rank`` runs, on meta: its one stage, or with ``virtual_stages``
    v > 1 its v chunks, virtual stages ``pp_rank + k·pp`` of ``pp·v``."""
    return [build_stage(model, pp * virtual_stages, pp_rank + k * pp) for k in range(virtual_stages)]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def make_loss_fn(tp_mesh=None, head: nn.Module | None = None, chunk_tokens: int = LOSS_CHUNK_TOKENS,
                 softcap: Optional[float] = None):
    """The loss for this layout: with tensor parallelism the head's logits arrive sharded along the
    vocabulary ([batch, seq, vocab/tp] per rank) and the cross-entropy runs on the shards (DTensor's
    ``loss_parallel``: a max, a sum of exponentials and the target's logit, each all-reduced), so no rank
    ever holds the whole logits. Forward and backward must run inside ``loss_parallel_context``. With
    ``head`` (the chunked loss, :mod:`hp_tool.trial.loss`) the stage returns hidden states and the loss
    applies the head a chunk of tokens at a time, and the stage's soft cap on the logits (``softcap``)."""
    if head is not None:
        from hp_tool.trial.loss import linear_cross_entropy

        return lambda hidden, labels: linear_cross_entropy(hidden, head.weight, labels, chunk_tokens, softcap)
    if tp_mesh is None or tp_mesh.size() == 1:
        return loss_fn

    def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        sharded = DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False)
        return loss_fn(sharded, labels).to_local()

    return vocab_parallel_loss


def stage_loss_fn(stage: nn.Module, par, tp_mesh=None):
    """The loss of ``stage`` (the rank's stage, or its last chunk under interleaving) for the spec's
    ``parallel.loss``: the chunked loss makes the last stage return hidden states (``head_in_loss``) and
    applies its head; otherwise ``make_loss_fn``'s."""
    last = stage.chunks[-1] if hasattr(stage, "chunks") else stage
    if par.loss == "chunked" and getattr(last, "lm_head", None) is not None:
        last.head_in_loss = True
        return make_loss_fn(tp_mesh, last.lm_head, par.loss_chunk_tokens, last.logit_softcap)
    return make_loss_fn(tp_mesh)


def loss_parallel_context(tp_mesh=None):
    """``loss_parallel()`` when the logits are vocabulary-sharded, else a no-op context."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return contextlib.nullcontext()
    return loss_parallel()
