"""Selective (per-op) activation checkpointing: torchtitan's op-level policy for a checkpointed layer.

A checkpointed layer normally keeps only its input and runs its whole forward again in backward
(``act_ckpt_mode: full``). Under ``selective`` it runs inside torch's non-reentrant checkpoint with a
``context_fn`` from ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the forward keeps the
outputs of the ops this policy marks ``MUST_SAVE``, and the recompute in backward takes those from the cache
instead of running them again (``PREFER_RECOMPUTE``: everything else runs again). Kept, as torchtitan keeps
them: the outputs of the layer's matmuls but every second one (the 1st, 3rd, ... of the forward:
``architectures.selective_keeps_matmul``, the rule the memory and FLOP estimates use), of the attention
kernels (SDPA's flash, efficient and cuDNN kernels on GPU, the flash kernel on CPU), of TP's reduce-scatters
(sequence parallelism) and of ``aten.max``.

torchtitan counts ``aten.mm`` only, because its layers have no biases. GPT-3's layers (transformers' OPT) and
Qwen2's q, k and v projections have biases and run as ``aten.addmm``: both count as matmuls here, so a layer's
k and o are recomputed whether or not its projections carry biases.

The policy sees the ops as they are dispatched, below FSDP2's and DDP's hooks and through DTensor (TP), on
any device; the memory tracer runs the same wrapper under fake tensors (hp_tool/trial/trace/replay.py).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hp_tool.architectures import selective_keeps_matmul

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default})  # addmm: a Linear with a bias (see above)
KEPT_OPS = frozenset({
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    aten.max.default,
})


def selective_policy():
    """A fresh policy for one run of a layer's forward and its recompute: keep ``KEPT_OPS``' outputs and the
    odd-numbered matmuls', counting the forward's matmuls and the recompute's apart, so that both number a
    matmul the same and the recompute finds in the cache what the forward kept."""
    counts: Counter = Counter()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            counts[ctx.is_recompute] += 1
            keep = selective_keeps_matmul(counts[ctx.is_recompute])
        else:
            keep = func in KEPT_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context():
    """The checkpoint's ``context_fn``: called once per checkpointed forward, so each gets its own counts."""
    return create_selective_checkpoint_contexts(selective_policy())


def checkpointed(layer: nn.Module, mode: str) -> nn.Module:
    """``layer`` wrapped to be recomputed in backward (torch's non-reentrant checkpoint): whole in mode
    ``full``, under the per-op policy in mode ``selective``."""
    extra = {"context_fn": selective_context} if mode == "selective" else {}
    return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
