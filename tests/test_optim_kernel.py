"""Which AdamW implementation a trial steps with: an offloaded trial's optimizer runs on the host, where
torch's fused kernel is one pass per tensor; foreach AdamW there makes a parameter-sized temporary and, on an
H100 node, did not finish a 7B model's first step in 110 s (docs/validation/README.md)."""

import torch
from torch import nn

from hp_tool.contracts.spec import TrainingSpec
from hp_tool.trial import optim


def test_an_offloaded_optimizer_steps_with_the_fused_host_kernel_and_the_same_numbers():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    twin = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    twin.load_state_dict(module.state_dict())
    t = TrainingSpec(lr=1e-2)
    # a GPU trial whose parameters FSDP2 offloads: its optimizer is built for the host
    opt = optim.build_optimizer(module, t, torch.device("cuda"), zero_stage=3, offload=True)
    assert all(g["fused"] for g in opt.param_groups) and not any(g["foreach"] for g in opt.param_groups)
    reference = torch.optim.AdamW(optim.param_groups(twin, t.weight_decay), lr=1e-2, betas=tuple(t.betas),
                                  weight_decay=t.weight_decay, foreach=False)
    x = torch.randn(8, 16)
    for _ in range(3):
        for m, o in ((module, opt), (twin, reference)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(module.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_cpu_trials_own_optimizer_keeps_foreach():
    """CPU processes (no GPU, offloaded or not) step foreach AdamW, as before: under the CPU tensor tracker the fused
    kernel with an fp16 loss scale fails (tests/test_loss_scaling.py)."""
    for offload in (False, True):
        opt = optim.build_optimizer(nn.Linear(4, 4), TrainingSpec(), torch.device("cpu"), zero_stage=3, offload=offload)
        assert all(g["foreach"] and not g["fused"] for g in opt.param_groups)


def test_sgd_has_no_fused_kernel_and_keeps_foreach():
    module = nn.Linear(4, 4)
    opt = optim.build_optimizer(module, TrainingSpec(optimizer="sgd_momentum"), torch.device("cpu"))
    assert all(g["foreach"] and not g.get("fused") for g in opt.param_groups)
