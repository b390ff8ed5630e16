"""Offload as the engines run it and as the planner prices it. The torch engine offloads the optimizer alone
(optim.HostOffloadedOptimizer: 16-bit weights and gradients sharded on the GPU, the fp32 master and the
optimizer's states on the host, one copy of the gradients down and of the weights up per step) or the parameters
too (FSDP2's CPUOffloadPolicy: each micro-batch's fp32 gradients down, the fp32 shard up for each gather);
DeepSpeed's ZeRO-Offload moves each micro-batch's 16-bit gradients. An offloaded GPU rank steps on its share of
the host's threads. The trials run on CPU ranks (gloo, fp32): what a GPU adds (pinned copies, bf16) is not
exercised here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hp_tool.estimate.layout import Layout
from hp_tool.estimate.memory import model_state_bytes
from hp_tool.estimate.speed import offload_pcie_bytes
from hp_tool.families.shape import Shape
from trial_helpers import read_result, tiny_spec, write_spec


L7B = Shape("llama", 32, 4096, 32, 32, 11008, 32000, 2048)


def test_pcie_bytes_are_what_each_engine_moves_per_step():
    torch3 = Layout.of(tp=1, pp=1, dp=1, mbs=1, act_ckpt_layers=32, global_batch_size=4, zero_stage=3,
                       offload="optimizer_and_params")
    shard = offload_pcie_bytes(L7B, torch3.replace(global_batch_size=1)) / (4 + 2 * 4)  # one micro-batch
    assert shard == pytest.approx(6.74e9, rel=0.01)  # Llama-2 7B's parameters
    # FSDP2: each of 4 micro-batches' fp32 gradients down, the fp32 shard up for each of 4 forwards and 4 backwards
    assert offload_pcie_bytes(L7B, torch3) == pytest.approx((4 * 4 + 8 * 4) * shard)
    # the torch engine's optimizer offload: 16-bit gradients down and 16-bit weights up, once per step
    assert offload_pcie_bytes(L7B, torch3.replace(offload="optimizer")) == pytest.approx((2 + 2) * shard)
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


def _losses(tmp_path, name: str, nproc: int, **layout) -> list[float]:
    from trial_helpers import read_metrics, torchrun

    spec = tiny_spec("llama", dp=nproc, mbs=1, gbs=2 * nproc, max_steps=3, warmup_steps=0, **layout)
    spec = replace(spec, trial_id=f"{spec.trial_id}_{name}")
    folder = tmp_path / name
    folder.mkdir()
    proc = torchrun(write_spec(spec, folder), folder / "out", nproc=nproc, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert read_result(folder / "out")["status"] == "ok"
    return [m["loss"] for m in read_metrics(folder / "out")]


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_torch_engines_optimizer_offload_trains_as_its_gpu_optimizer_does(tmp_path, nproc):
    """The host holds the fp32 masters and the optimizer's states (optim.HostOffloadedOptimizer), the GPU (here
    the CPU ranks, in fp32) the weights; the losses are those of the same layout stepping on the device, and the
    weights learn (the loss falls)."""
    device = _losses(tmp_path, "device", nproc, zero_stage=3)
    host = _losses(tmp_path, "host", nproc, zero_stage=3, offload="optimizer")
    assert host == pytest.approx(device, rel=1e-5) and host[-1] < host[0]



def test_the_torch_engines_optimizer_offload_keeps_16_bit_weights_and_gradients_on_the_gpu():
    # per parameter on the GPU over 4 ZeRO-3 ranks: the weight and gradient in the training precision, no states;
    # the fp32 parameter offload keeps nothing there, and no offload 16 bytes (fp32 master, gradient, m, v)
    assert model_state_bytes(1.0, 4, 3, "optimizer", "torch", bytes_per_value=2) == pytest.approx((2 + 2) / 4)
    assert model_state_bytes(1.0, 4, 3, "optimizer", "torch", bytes_per_value=4) == pytest.approx((4 + 4) / 4)
    assert model_state_bytes(1.0, 4, 3, "optimizer_and_params", "torch") == 0
    assert model_state_bytes(1.0, 4, 3, "none", "torch") == pytest.approx(16 / 4)


def test_the_host_keeps_fp32_masters_of_16_bit_weights_and_uploads_them_rounded():
    """Steps far below bf16's resolution at 1.0 (2**-7): a bf16 optimizer would never move the weights; the
    host's fp32 masters accumulate the steps, and the weights are the masters rounded, step by step."""
    import torch
    from torch import nn

    from hp_tool.contracts.spec import TrainingSpec
    from hp_tool.trial.optim import HostOffloadedOptimizer

    layer = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    spec = TrainingSpec(lr=1e-4, min_lr=1e-4, weight_decay=0.0, max_steps=1000)
    opt = HostOffloadedOptimizer(layer, spec, torch.device("cpu"))
    (_, master, _, _), = opt._copies
    for _ in range(200):
        layer.weight.grad = torch.ones_like(layer.weight)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.equal(layer.weight, master.to(torch.bfloat16))
    assert master.dtype == torch.float32 and master.mean().item() == pytest.approx(1 - 200 * 1e-4, rel=1e-3)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.float().mean().item() < 1.0  # moved, by rounding
