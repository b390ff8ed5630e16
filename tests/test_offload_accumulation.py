"""Offloaded gradients accumulate on the GPU (hp_tool/sharding.py ``reduces_once_per_step``): under the torch
engine's FSDP2 CPU offload at ZeRO-2/3 the gradient sync is off until a step's last micro-batch, so each step
reduce-scatters once per FSDP2 unit and moves the gradients to the host once, not once per micro-batch (each of
which crosses PCIe and is added on the host). The memory model keeps those unsharded fp32 gradients on the GPU
and the step-time model moves them once. The trials run on 2 CPU ranks (gloo); only the collective count is
checked here, which is what a GPU run would do the same way."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hp_tool.estimate.layout import Layout
from hp_tool.estimate.memory import accumulated_grad_bytes
from hp_tool.estimate.speed import offload_pcie_bytes
from hp_tool.families.shape import Shape
from hp_tool.sharding import reduces_once_per_step
from trial_helpers import read_result, tiny_spec, torchrun_module, write_spec


def _reduce_scatters(tmp_path, micro_batches: int, offload: str) -> int:
    spec = tiny_spec("llama", dp=2, mbs=1, gbs=2 * micro_batches, max_steps=2, zero_stage=3, offload=offload)
    spec = replace(spec, trial_id=f"{spec.trial_id}_m{micro_batches}_{offload}")
    folder = tmp_path / spec.trial_id
    folder.mkdir()
    out = folder / "out"
    counts = folder / "reduce_scatters"
    proc = torchrun_module("collective_count", [counts, write_spec(spec, folder), "--output-dir", out],
                           folder / "logs", nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert read_result(out)["status"] == "ok"
    per_rank = {int((folder / f"reduce_scatters.{rank}").read_text()) for rank in (0, 1)}
    assert len(per_rank) == 1  # both ranks join every collective
    return per_rank.pop()


@pytest.mark.e2e
def test_an_offloaded_zero3_step_reduce_scatters_once_whatever_its_micro_batches(tmp_path):
    once = _reduce_scatters(tmp_path, 1, "optimizer_and_params")
    four = _reduce_scatters(tmp_path, 4, "optimizer_and_params")
    assert once > 0 and four == once  # one reduce-scatter per unit per step, 4 micro-batches or 1
    # without offload ZeRO-3 keeps its gradients sharded: one reduce-scatter per micro-batch, as DeepSpeed's
    assert _reduce_scatters(tmp_path, 4, "none") == 4 * once


def test_the_rule_the_engine_and_the_models_share():
    assert reduces_once_per_step("torch", 3, "optimizer_and_params", dp=2, pp=1)
    assert reduces_once_per_step("torch", 2, "optimizer_and_params", dp=1, pp=1)  # one rank: one copy to the host
    assert not reduces_once_per_step("torch", 3, "none", dp=2, pp=1)  # ZeRO-3 keeps gradients sharded
    assert not reduces_once_per_step("torch", 3, "optimizer_and_params", dp=2, pp=2)  # the schedule's own
    assert not reduces_once_per_step("deepspeed", 3, "optimizer_and_params", dp=2, pp=1)  # ZeRO-Offload's host adds
    assert reduces_once_per_step("torch", 0, "none", dp=2, pp=1) and not reduces_once_per_step("torch", 0, "none", 1, 1)


def test_the_gpu_keeps_the_accumulated_fp32_gradients_of_an_offloaded_step_with_several_micro_batches():
    one = Layout.of(tp=1, pp=1, dp=2, mbs=2, act_ckpt_layers=0, global_batch_size=4, zero_stage=3,
                    offload="optimizer_and_params")
    four = one.replace(global_batch_size=16)
    assert accumulated_grad_bytes(1e9, one) == 0  # one micro-batch: reduced as it is made
    assert accumulated_grad_bytes(1e9, four) == 4e9  # the reduce dtype's fp32, unsharded
    assert accumulated_grad_bytes(1e9, four.replace(offload="none")) == 0
    assert accumulated_grad_bytes(1e9, four.replace(engine="deepspeed")) == 0


L7B = Shape("llama", 32, 4096, 32, 32, 11008, 32000, 2048)


def test_pcie_bytes_are_what_each_engine_moves_per_step():
    torch3 = Layout.of(tp=1, pp=1, dp=1, mbs=1, act_ckpt_layers=32, global_batch_size=4, zero_stage=3,
                       offload="optimizer_and_params")
    shard = offload_pcie_bytes(L7B, torch3.replace(global_batch_size=1)) / (4 + 2 * 4)  # one micro-batch
    assert shard == pytest.approx(6.74e9, rel=0.01)  # Llama-2 7B's parameters
    # FSDP2: the fp32 gradients down once, the fp32 shard up for each of 4 forwards and 4 backwards
    assert offload_pcie_bytes(L7B, torch3) == pytest.approx((4 + 8 * 4) * shard)
    # ZeRO-2 keeps a layer gathered from its forward to its backward: one upload per micro-batch
    assert offload_pcie_bytes(L7B, torch3.replace(zero_stage=2)) == pytest.approx((4 + 4 * 4) * shard)
    # DeepSpeed: each micro-batch's 16-bit gradients down, its 16-bit parameters up per gather; optimizer-only
    # offload uploads the updated 16-bit weights once
    ds = torch3.replace(engine="deepspeed")
    assert offload_pcie_bytes(L7B, ds) == pytest.approx((4 * 2 + 8 * 2) * shard)
    assert offload_pcie_bytes(L7B, ds.replace(offload="optimizer")) == pytest.approx((4 * 2 + 2) * shard)


def test_an_offloaded_gpu_rank_steps_on_its_share_of_the_hosts_threads():
    from hp_tool.trial.optim import host_step_threads

    assert host_step_threads(96, 8, visible=96) == 12  # the preset's node: 96 threads over 8 GPUs
    assert host_step_threads(96, 8, visible=4) == 4  # a job bound to 4 cores runs 4 threads
    assert host_step_threads(16, 1, visible=16) == 16  # one GPU: the whole host
    assert host_step_threads(None, 8, visible=192) == 24  # unknown host: the cores this process sees
    assert host_step_threads(4, 8, visible=64) == 1  # never below one
