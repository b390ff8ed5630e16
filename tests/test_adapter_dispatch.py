"""What one LoRA-adapted linear runs in a 16-bit step, counted op by op (a TorchDispatchMode) on CPU under bf16
autocast, as a trial runs it on a GPU: the frozen base held in bf16, the adapters fp32 (hp_tool/trial/weights.py
hold_in), the adapters injected by the engine (hp_tool/trial/methods.py inject_adapters).

Tuned stacks (torchtune, Unsloth) never copy an adapted linear's input: only the adapters' own weights (rank x
width) are cast. peft's default casts each input to the adapter's fp32 and autocast casts it back for A, an
input-sized copy each way and one more in backward, which the engine turns off."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hp_tool.contracts.spec import LoraSpec
from hp_tool.trial.methods import inject_adapters

TOKENS, WIDTH, RANK = 64, 96, 4
CASTS = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.copy_.default,
         torch.ops.aten.clone.default}
DROPOUTS = {torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.default}


class Attention(nn.Module):
    """Two adapted linears reading one input, as q and v do."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v_proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.q_proj(x) + self.v_proj(x)


class Count(TorchDispatchMode):
    """Input-sized copies (a cast or copy whose output has at least TOKENS x WIDTH elements) and dropouts."""

    def __init__(self):
        super().__init__()
        self.copies, self.dropouts = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in CASTS and isinstance(out, torch.Tensor) and out.numel() >= TOKENS * WIDTH:
            self.copies.append(f"{func}: {args[0].dtype} -> {out.dtype}")
        if func in DROPOUTS:
            self.dropouts.append(str(func))
        return out


def bf16_step(dropout: float) -> Count:
    torch.manual_seed(0)
    layer = Attention()
    inject_adapters(layer, LoraSpec(rank=RANK, alpha=2 * RANK, dropout=dropout, target_modules=["q_proj", "v_proj"]))
    for module in (layer.q_proj.base_layer, layer.v_proj.base_layer):  # the frozen base in the compute dtype
        module.weight.data = module.weight.data.to(torch.bfloat16)
    assert {p.dtype for p in layer.parameters() if p.requires_grad} == {torch.float32}  # fp32 adapters
    x = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)  # the norm's bf16 output
    count = Count()
    with count, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).sum().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)
    return count


def test_an_adapted_linear_copies_no_input_in_a_bf16_step():
    count = bf16_step(dropout=0.0)
    assert count.copies == [] and count.dropouts == []


@pytest.mark.parametrize("dropout", [0.05])
def test_a_nonzero_dropout_drops_out_each_adapters_input_once_and_casts_none(dropout):
    count = bf16_step(dropout)
    assert len(count.dropouts) == 2  # q's and v's own masks
    assert count.copies == []
