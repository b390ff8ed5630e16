"""Exact causal ring attention over a context-parallel group, in plain torch (any device, any backend).

Context parallelism splits a sequence over CP ranks. For causal attention the sequence is cut into 2·CP
equal chunks and rank r holds chunks r and 2·CP-1-r (``balanced_chunks``), so every rank does the same work.
Each rank keeps its queries; the key/value blocks travel around the ring, one hop per step, and every rank
attends its queries to the block it holds (masked by the chunks' global positions), merging the partial
results by their log-sum-exp. Backward runs the ring again, carrying each block's key/value gradients with
it, and one more hop brings them home. Nothing is approximated: the output and the gradients are those of
unsharded attention.

torch's own ``torch.distributed.tensor.experimental.context_parallel`` runs SDPA's flash / efficient /
cuDNN kernels on GPU; on CPU it has no sharding rule for the CPU attention kernel (REFERENCE §15), which is
what this ring is for.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hp_tool.estimate.layout import ring_tile_rows


def balanced_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of 2·CP sequence chunks rank ``rank`` holds: ``rank`` and ``2·CP - 1 - rank``."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim``: its two balanced chunks, concatenated."""
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = balanced_chunks(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def positions(cp: int, rank: int, seq: int, device=None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens of a ``seq``-token sequence (for RoPE and the mask)."""
    return shard_sequence(torch.arange(seq, device=device), cp, rank, dim=0)


def _ring_pass(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = dist.get_global_rank(group, (me + 1) % size), dist.get_global_rank(group, (me - 1) % size)
    # contiguous buffers: a transposed block (transformers' [b, h, s, d] views) keeps its strides in empty_like
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """True where a query may attend a key: causal by global position."""
    return k_pos[None, :] <= q_pos[:, None]


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: repeat each key/value head for its query heads ([b, kv, s, d] -> [b, h, s, d])."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1) if kv.shape[1] != heads else kv


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype softmax statistics accumulate in: fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def query_tiles(q: torch.Tensor, keys: int) -> list[slice]:
    """Slices of the query rows such that one tile's fp32 scores against ``keys`` keys stay within
    ``RING_SCORE_BYTES`` (at least ``RING_MIN_ROWS`` rows a tile): the ring's transient memory is bounded at
    any sequence length, as the planner counts it (``ring_transient_bytes``)."""
    rows = ring_tile_rows(q.shape[0] * q.shape[1], keys)
    return [slice(start, start + rows) for start in range(0, q.shape[2], rows)]


def _block(q, k, v, q_pos, k_pos, scale):
    """One block's attention: (its softmax-normalised output, log-sum-exp) in the accumulation dtype; rows
    with no visible key give -inf log-sum-exp and zero output. Tile by tile of the query rows."""
    outs, lses = [], []
    for rows in query_tiles(q, k.shape[2]):
        scores = (q[:, :, rows] @ k.transpose(-1, -2)).to(_acc(q)) * scale
        scores = scores.masked_fill(~_mask(q_pos[rows], k_pos), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.unsqueeze(-1).clamp(min=-1e30)).nan_to_num(0.0)
        del scores
        outs.append(weights.to(v.dtype) @ v)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, scale, group):
        heads, cp, me = q.shape[1], dist.get_world_size(group), dist.get_rank(group)
        out = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
        block_k, block_v, block_pos = k, v, q_pos
        for step in range(cp):
            part, part_lse = _block(q, _expand(block_k, heads), _expand(block_v, heads), q_pos, block_pos, scale)
            merged = torch.logaddexp(lse, part_lse)
            keep_old = torch.exp(lse - merged).nan_to_num(0.0)
            take_new = torch.exp(part_lse - merged).nan_to_num(0.0)
            out = out * keep_old.unsqueeze(-1) + part.to(out.dtype) * take_new.unsqueeze(-1)
            lse = merged
            if step < cp - 1:
                block_k, block_v, block_pos = _ring_pass([block_k, block_v, block_pos], group)
        ctx.save_for_backward(q, k, v, q_pos, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_pos, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        heads, kv_heads, cp = q.shape[1], k.shape[1], dist.get_world_size(group)
        acc = _acc(q)
        grad_out = grad_out.to(acc)
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O)
        grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
        block_k, block_v, block_pos = k, v, q_pos
        grad_k = torch.zeros(k.shape, dtype=acc, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=acc, device=v.device)
        for step in range(cp):
            kk, vv = _expand(block_k, heads).to(acc), _expand(block_v, heads).to(acc)
            gk = torch.zeros(kk.shape, dtype=acc, device=q.device)
            gv = torch.zeros(vv.shape, dtype=acc, device=q.device)
            for rows in query_tiles(q, kk.shape[2]):
                qt, go = q[:, :, rows].to(acc), grad_out[:, :, rows]
                scores = (qt @ kk.transpose(-1, -2)) * scale
                scores = scores.masked_fill(~_mask(q_pos[rows], block_pos), float("-inf"))
                probs = torch.exp(scores - lse[:, :, rows].unsqueeze(-1)).nan_to_num(0.0)
                del scores
                grad_scores = probs * (go @ vv.transpose(-1, -2) - delta[:, :, rows].unsqueeze(-1))
                grad_q[:, :, rows] += grad_scores @ kk * scale
                gk += grad_scores.transpose(-1, -2) @ qt * scale
                gv += probs.transpose(-1, -2) @ go
                del probs, grad_scores
            if heads != kv_heads:  # fold the repeated heads back onto their key/value head
                gk = gk.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
                gv = gv.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
            grad_k, grad_v = grad_k + gk, grad_v + gv
            # the block moves on with its gradients; after the last step one more hop brings them home
            block_k, block_v, block_pos, grad_k, grad_v = _ring_pass([block_k, block_v, block_pos, grad_k, grad_v],
                                                                     group)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   group: dist.ProcessGroup, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries ([batch, heads, tokens, dim]) over the whole sequence whose
    keys and values ([batch, kv heads, tokens, dim]) the CP ranks of ``group`` hold, ``q_pos`` the global
    positions of this rank's tokens (``positions``); the output has this rank's tokens."""
    return _RingAttention.apply(q, k, v, q_pos, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), group)
