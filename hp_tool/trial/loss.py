"""The language-model loss without whole logits: the output projection and the cross-entropy computed over
chunks of tokens, so fp32 logits never exist for more than ``chunk_tokens`` tokens at a time.

At long context the logits dominate memory: one 32K-token sequence over a 128K vocabulary is 16.8 GiB of fp32
logits, and their gradient as much again (REFERENCE §15). ``chunked_linear_cross_entropy`` computes, chunk by
chunk in the forward pass, the loss and both gradients it needs (of the hidden states and of the head's
weight), as Liger's fused linear cross-entropy does on GPU; the backward pass only scales them by the
incoming gradient. What it holds is one chunk's logits, the hidden states' gradient (tokens x hidden) and
the weight's (vocab x hidden, fp32); the gradients are exact, not approximated.

Where Liger's kernel runs (a CUDA device with ``liger_kernel`` installed) ``linear_cross_entropy`` uses it;
elsewhere this chunked form.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hp_tool.recipe import LOSS_CHUNK_TOKENS

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` (soft-capped to ``softcap * tanh(logits / softcap)`` when
    ``softcap`` is given) against ``labels``, gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                softcap: Optional[float] = None):
        counted = labels != IGNORE_INDEX
        total = counted.sum().clamp(min=1)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device) if weight.requires_grad else None
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least, as the whole-logits loss
        loss = torch.zeros((), dtype=dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h, target, keep = hidden[rows], labels[rows], counted[rows]
            logits = (h @ weight.t()).to(dtype)
            if softcap is not None:
                tanh = torch.tanh(logits / softcap)
                logits = tanh * softcap
            safe = target.clamp(min=0)
            # ignored tokens masked to zero, not dropped: a boolean index has a data-dependent shape, which the
            # pre-launch trace's fake tensors cannot give
            token_loss = torch.logsumexp(logits, dim=-1) - logits.gather(1, safe[:, None])[:, 0]
            loss += torch.where(keep, token_loss, 0.0).sum()
            # d(mean loss)/d(logits) = (softmax - one-hot) / counted tokens, zero for ignored ones
            grad = torch.softmax(logits, dim=-1)
            del logits  # one chunk's fp32 logits at a time: their softmax is the gradient from here
            grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1.0
            grad *= (keep.to(grad.dtype) / total)[:, None]
            if softcap is not None:  # through the cap: d(c·tanh(z/c))/dz = 1 - tanh(z/c)²
                grad *= 1.0 - tanh * tanh
                del tanh
            if grad_hidden is not None:
                grad_hidden[rows] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h.to(dtype))  # in place: no vocabulary x hidden temporary
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight) if g is not None))
        ctx.has = (grad_hidden is not None, grad_weight is not None)
        return loss / total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        saved = list(ctx.saved_tensors)
        grad_hidden = saved.pop(0) * grad_output if ctx.has[0] else None
        grad_weight = saved.pop(0) * grad_output if ctx.has[1] else None
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_tokens: int = LOSS_CHUNK_TOKENS,
                                 softcap: Optional[float] = None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden`` ([..., h]) through the output projection ``weight``
    ([vocab, h]) against ``labels`` ([...], IGNORE_INDEX skipped), never holding more than ``chunk_tokens``
    tokens' logits; ``softcap``: the logits soft-capped first (``softcap * tanh(logits / softcap)``)."""
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                            chunk_tokens, softcap)


def full_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              softcap: Optional[float] = None) -> torch.Tensor:
    """The same loss with whole logits (the reference the chunked form equals)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def liger_available(device: torch.device) -> bool:
    """Whether Liger's fused linear cross-entropy kernel runs here (CUDA and liger_kernel installed)."""
    if device.type != "cuda":
        return False
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """The chunked loss: Liger's fused kernel where it runs (logits without a soft cap), else
    ``chunked_linear_cross_entropy``."""
    if liger_available(hidden.device) and softcap is None:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                                ignore_index=IGNORE_INDEX)
    return chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens or LOSS_CHUNK_TOKENS, softcap)
