"""Context parallelism (CP) on the torch engine: each sequence split over the ``cp`` ranks of a replica, the
layers' attention run as exact causal ring attention over them (:mod:`hp_tool.trial.ring_attention`).

A CP rank is a data-parallel rank for everything but attention: the same weights, its own tokens. What CP
changes, each in one place:

- the mesh is (pp, dp, cp, tp) and the data-parallel wrappers shard and reduce over dp x cp
  (:func:`hp_tool.trial.dist.weight_dp_dim`), so the averaged gradient is the whole batch's;
- the data: every CP rank of a replica reads the replica's sequences and keeps its two balanced chunks of
  each, labels shifted on the whole sequence first (:class:`hp_tool.trial.data.TokenBatches`);
- the stage's position ids are the global positions of the rank's tokens (``token_positions``), which RoPE
  and the ring's causal mask both read;
- attention: ``apply_context_parallel`` switches the attention module of each layer (the family's
  ``TorchFamily.attention``) to ``RING_ATTENTION``, a function registered in transformers' attention
  interface, so nothing changes for a stage without CP;
- the loss: each rank's mean over its tokens (equal counts, so the mean of the CP ranks' means is the
  sequence's); the reported loss is that mean over the CP group (``whole_sequence_mean``), the gradients are
  left to the data-parallel reduction.

On GPU, torch's ``torch.distributed.tensor.experimental.context_parallel`` would run SDPA's flash / efficient
kernels on the shards; it is not wired, because it could not be checked against unsharded attention here (no
GPU). The ring runs on every device: exact, in plain torch ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface

from hp_tool.trial.ring_attention import positions, ring_attention

RING_ATTENTION = "hp_tool_ring"
"""The name the ring is registered under in transformers' attention interface (``config._attn_implementation``)."""


def ring_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, position_ids: Optional[torch.Tensor] = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the ring: ``query`` ([batch, heads, tokens, dim]; with
    TP this rank's heads), ``key`` and ``value`` (its kv heads) of this rank's tokens, whose global positions
    ``position_ids`` the decoder layer passes on (the stage's ``token_positions``); the ring runs over the
    module's ``cp_group``. Returns ([batch, tokens, heads, dim], None) as SDPA's function does. The causal
    mask comes from the positions: the stage passes no mask, and no dropout runs in a trial."""
    if attention_mask is not None or dropout or position_ids is None:
        raise RuntimeError("ring attention takes the causal mask from the global position ids, without dropout: "
                           f"got a mask: {attention_mask is not None}, dropout {dropout}, position ids: "
                           f"{position_ids is not None}")
    out = ring_attention(query, key, value, position_ids[0], module.cp_group, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(RING_ATTENTION, ring_attention_forward)


def token_positions(group: Optional[dist.ProcessGroup], tokens: int, device: torch.device) -> torch.Tensor:
    """The global positions of this rank's ``tokens`` tokens: 0 .. tokens-1 without CP (``group`` None), else
    those of the rank's two balanced chunks of the whole ``tokens x CP``-token sequence."""
    if group is None:
        return torch.arange(tokens, device=device)
    cp = dist.get_world_size(group)
    return positions(cp, dist.get_rank(group), tokens * cp, device)


def apply_context_parallel(stage: nn.Module, cp_mesh: DeviceMesh, attention: str) -> None:
    """Split ``stage``'s sequences over ``cp_mesh`` (with TP, the CP ranks at this rank's TP coordinate, which
    hold the same heads): the stage computes its tokens' global positions and every layer's attention module
    (``attention``, its name in the layer: the family's ``TorchFamily.attention``) runs the ring over the
    group. Only this stage's config changes (each build has its own)."""
    group = cp_mesh.get_group()
    stage.cp_group = group
    for layer in stage.layers.values():
        module = layer.get_submodule(attention)
        module.cp_group = group
        module.config._attn_implementation = RING_ATTENTION


def whole_sequence_mean(loss: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The mean loss over the whole sequences from each CP rank's mean over its tokens (all ranks hold as many):
    the mean over the group, for reporting only (detached; the gradients are the data-parallel reduction's)."""
    if group is None:
        return loss
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)
