"""The CPU ring attention for context parallelism is exact: on 2 and 3 CPU processes (gloo), each rank's output
and its query, key and value gradients equal its share of unsharded causal attention's (float64, rel 1e-9),
with grouped-query heads. GPUs are not here; torch's own context_parallel is the GPU path."""

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from trial_helpers import free_port


def reference(q, k, v, grad):
    """Unsharded causal attention (keys/values repeated over their query heads) and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    heads = q.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // k.shape[1], 1),
                                         v.repeat_interleave(heads // v.shape[1], 1), is_causal=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def worker(rank, world, port, folder, tile_rows=None):
    import torch.distributed as dist

    from hp_tool.trial import ring_attention as ring
    from hp_tool.trial.ring_attention import positions, ring_attention, shard_sequence

    if tile_rows is not None:  # tiles of a few query rows: the tiled path, not one tile per block
        ring.ring_tile_rows = lambda batch_heads, keys: tile_rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        generator = torch.Generator().manual_seed(11)
        seq = 12 * world
        q = torch.randn(2, 4, seq, 8, generator=generator, dtype=torch.float64)
        k = torch.randn(2, 2, seq, 8, generator=generator, dtype=torch.float64)
        v = torch.randn(2, 2, seq, 8, generator=generator, dtype=torch.float64)
        grad = torch.randn(2, 4, seq, 8, generator=generator, dtype=torch.float64)
        expected = reference(q, k, v, grad)
        mine = [shard_sequence(t, world, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, positions(world, rank, seq), dist.group.WORLD)
        out.backward(shard_sequence(grad, world, rank, dim=2))
        got = [out.detach()] + [t.grad for t in mine]
        want = [shard_sequence(t, world, rank, dim=2) for t in expected]
        torch.save({"got": got, "want": want}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.parametrize("cp, tile_rows", [(2, None), (3, None), (2, 5)], ids=["cp2", "cp3", "cp2-tiles-of-5-rows"])
def test_ring_attention_equals_unsharded_causal_attention(tmp_path, cp, tile_rows):
    if tile_rows is not None:  # 5 query rows a tile against a 12-token block: tiles of 5, 5 and 2 rows
        from hp_tool.trial.ring_attention import query_tiles

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("hp_tool.trial.ring_attention.ring_tile_rows", lambda batch_heads, keys: tile_rows)
            q = torch.zeros(2, 4, 12, 8)
            assert [q[:, :, rows].shape[2] for rows in query_tiles(q, 12)] == [5, 5, 2]
    mp.spawn(worker, args=(cp, free_port(), str(tmp_path), tile_rows), nprocs=cp, join=True)
    for rank in range(cp):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        for name, got, want in zip(("out", "dq", "dk", "dv"), saved["got"], saved["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")


def test_each_rank_holds_two_balanced_chunks():
    from hp_tool.trial.ring_attention import positions

    assert positions(2, 0, 8).tolist() == [0, 1, 6, 7] and positions(2, 1, 8).tolist() == [2, 3, 4, 5]
    # every rank's queries see the same number of causal (query, key) pairs: balanced work
    pairs = [int(sum(p + 1 for p in positions(4, r, 64).tolist())) for r in range(4)]
    assert len(set(pairs)) == 1
