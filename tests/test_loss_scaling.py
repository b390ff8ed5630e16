"""fp16 trains with dynamic loss scaling: the torch engine scales the loss, unscales the gradients before
clipping, skips a step whose gradients overflowed on any rank and halves the scale; DeepSpeed's config asks
for its dynamic loss scale.

No GPU is here, so these tests run the loss-scaling path on CPU in fp32: the torch engine is given the
scaler ``optim.loss_scaler`` builds for fp16 (torch's GradScaler, or its ShardedGradScaler in a process
group, on the CPU; the pipeline test forces it on by patching ``optim.loss_scaler`` in the trial
processes). What a GPU adds is left out: the fp16 autocast of the forward, and gradients that overflow by
themselves; the overflow is a gradient hook or a gradient set to inf.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hp_tool.contracts.ds_config import ds_config
from hp_tool.trial import optim
from hp_tool.trial.dist import DistEnv
from hp_tool.trial.engines.torch_engine import TorchEngine

from trial_helpers import free_port, read_metrics, read_result, tiny_spec, torchrun, write_spec

REPO = Path(__file__).resolve().parent.parent


def test_deepspeed_config_scales_fp16_losses_dynamically():
    fp16 = tiny_spec(engine="deepspeed")
    fp16.training.precision = "fp16"
    config = ds_config(fp16)
    assert config["fp16"] == {"enabled": True, "loss_scale": 0}  # 0: DeepSpeed's dynamic loss scale
    assert config["bf16"] == {"enabled": False}
    assert ds_config(tiny_spec(engine="deepspeed"))["fp16"] == {"enabled": False}  # bf16: no scaling


def _engine(scaled: bool) -> TorchEngine:
    cpu = torch.device("cpu")
    engine = TorchEngine.build(tiny_spec(dp=1, zero_stage=0), DistEnv(), cpu)
    if scaled:
        engine.scaler = optim.loss_scaler(cpu, torch.float16)  # what an fp16 trial on a GPU gets
        assert isinstance(engine.scaler, torch.amp.GradScaler)
    return engine


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of the module's (local) parameter values."""
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in module.parameters()]


def test_fp16_step_whose_gradients_overflow_is_skipped_and_the_scale_halves():
    engine = _engine(scaled=True)
    scale = engine.scaler.get_scale()
    first = next(engine.stage.parameters())
    hook = first.register_hook(lambda grad: torch.full_like(grad, math.inf))  # an overflowed fp16 gradient
    before = _weights(engine.stage)
    loss = engine.step(0)
    hook.remove()
    assert math.isfinite(float(loss))  # the loss reported is the unscaled one
    assert not math.isfinite(engine.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine.stage)))  # no weight moved
    assert engine.scaler.get_scale() == scale / 2
    engine.step(1)
    assert math.isfinite(engine.grad_norm) and engine.scaler.get_scale() == scale / 2
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(engine.stage)))


def test_fp16_loss_scaling_changes_nothing_when_nothing_overflows():
    plain, scaled = _engine(scaled=False), _engine(scaled=True)
    for step in range(2):
        assert float(scaled.step(step)) == pytest.approx(float(plain.step(step)), rel=1e-6)
        assert scaled.grad_norm == pytest.approx(plain.grad_norm, rel=1e-4)  # clipped after unscaling
    for a, b in zip(_weights(plain.stage), _weights(scaled.stage)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_fp16_in_a_process_group_skips_on_every_rank_with_sharded_gradients(one_process_group):
    """The scaler of a multi-process trial (torch's ShardedGradScaler, overflow all-reduced over the world)
    over a tensor-parallel weight (a DTensor) and a plain bias under ZeRO-1's ShardedAdamW, whose local
    tensors receive their gradients only when it steps."""
    cpu = torch.device("cpu")
    layer = torch.nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (1,))
    layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    optimizer = optim.ShardedAdamW(layer, tiny_spec().training, cpu, one_process_group)
    scaler = optim.loss_scaler(cpu, torch.float16)
    assert isinstance(scaler, ShardedGradScaler)
    scale, before = scaler.get_scale(), _weights(layer)
    for overflow in (True, False):
        scaled = scaler.scale(torch.ones(()))  # a loss of 1 as a backward would have scaled it
        layer.weight.grad = distribute_tensor(torch.full((4, 4), math.inf if overflow else float(scaled)),
                                              layer.weight.device_mesh, [Shard(0)])
        layer.bias.grad = torch.full((4,), float(scaled))
        optim.unscale_grads(optimizer, scaler)
        if not overflow:  # both kinds of gradient unscaled, the DTensor's through ShardedAdamW's local tensor
            assert torch.equal(layer.bias.grad, torch.ones(4))
            assert torch.equal(layer.weight.grad.to_local(), torch.ones(4, 4))
        optim.optimizer_step(optimizer, scaler)
        moved = [not torch.equal(a, b) for a, b in zip(before, _weights(layer))]
        assert moved == [not overflow] * 2
        assert scaler.get_scale() == scale / 2


SCALED_TRIAL = """
import sys, torch
from hp_tool.trial import optim
from hp_tool.trial.train import exit_now, run_trial
build = optim.loss_scaler
optim.loss_scaler = lambda device, dtype: build(device, torch.float16)  # the scaler of fp16 on a GPU
run_trial(sys.argv[1], sys.argv[2])
exit_now(0)
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_fp16_loss_scaling_over_a_pipeline_keeps_losses_and_gradient_norms(tmp_path):
    """Two pipeline stages under torchrun (gloo), with and without the fp16 loss scaler forced on: the first
    stage never sees the loss yet unscales and joins the overflow all-reduce; the last reports the unscaled
    loss."""
    spec = write_spec(tiny_spec("gpt3", pp=2), tmp_path)
    plain = torchrun(spec, tmp_path / "plain", 2)
    assert plain.returncode == 0, plain.stderr[-3000:]
    script = tmp_path / "scaled_trial.py"
    script.write_text(SCALED_TRIAL)
    scaled = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             f"--master-port={free_port()}", str(script), str(spec), str(tmp_path / "scaled")],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert scaled.returncode == 0, scaled.stderr[-3000:]
    assert read_result(tmp_path / "scaled")["status"] == "ok", read_result(tmp_path / "scaled")["reason"]
    steps = [read_metrics(tmp_path / run) for run in ("plain", "scaled")]
    for a, b in zip(*steps):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
