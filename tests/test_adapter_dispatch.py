"""What one LoRA-adapted linear runs in a 16-bit step, counted op by op (a TorchDispatchMode) on CPU under bf16
autocast, as a trial runs it on a GPU: the frozen base held in bf16, the adapters fp32 (hp_tool/trial/weights.py
hold_in), the adapters injected by the engine (hp_tool/trial/methods.py inject_adapters).

Tuned stacks (torchtune, Unsloth) never copy an adapted linear's input: only the adapters' own weights (rank x
width) are cast. peft's default casts each input to the adapter's fp32 and autocast casts it back for A, an
input-sized copy each way and one more in backward, which the engine turns off. peft then scales B's output and
adds it to the base's, two output-sized kernels forward and one backward, which the engine folds into B's matmul
(addmm's alpha and accumulate)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hp_tool.contracts.spec import LoraSpec
from hp_tool.trial.methods import four_bit_linears, inject_adapters, quantise_base

TOKENS, WIDTH, RANK = 64, 96, 4
CASTS = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.copy_.default,
         torch.ops.aten.clone.default}
DROPOUTS = {torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.default}
ELEMENTWISE = {torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}


class Attention(nn.Module):
    """Two adapted linears reading one input, as q and v do."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v_proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.q_proj(x) + self.v_proj(x)


class Count(TorchDispatchMode):
    """Input-sized copies (a cast or copy whose output has at least TOKENS x WIDTH elements), dropouts, and
    input-sized element-wise multiplies and adds by pass (``phase``: forward, then backward)."""

    def __init__(self):
        super().__init__()
        self.copies, self.dropouts, self.phase = [], [], "forward"
        self.elementwise = {"forward": [], "backward": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        large = isinstance(out, torch.Tensor) and out.numel() >= TOKENS * WIDTH
        if func in CASTS and large:
            self.copies.append(f"{func}: {args[0].dtype} -> {out.dtype}")
        if func in ELEMENTWISE and large:
            self.elementwise[self.phase].append(str(func).split(".")[1])
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
        out = layer(x)
        count.phase = "backward"
        out.sum().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)
    return count


def test_an_adapted_linear_copies_no_input_in_a_bf16_step():
    count = bf16_step(dropout=0.0)
    assert count.copies == [] and count.dropouts == []


def test_an_adapters_scaling_and_sum_are_folded_into_its_matmul():
    count = bf16_step(dropout=0.0)
    # forward: the test layer's own q + v only; peft's would add 2 x (scale B's output, add it to the base's)
    assert count.elementwise["forward"] == ["add"]
    # backward: the input's gradient summed over its 4 readers (q's and v's base and A); no scaling of B's
    # output gradient
    assert count.elementwise["backward"] == ["add"] * 3


@pytest.mark.parametrize("dropout", [0.05])
def test_a_nonzero_dropout_drops_out_each_adapters_input_once_and_casts_none(dropout):
    count = bf16_step(dropout)
    assert len(count.dropouts) == 2  # q's and v's own masks
    assert count.copies == []


def test_a_qlora_base_is_quantised_from_the_compute_dtype_and_dequantised_without_a_cast():
    # QLoRA as a trial builds it: 4-bit linears on meta, the adapters over them, filled, then quantised for bf16
    with torch.device("meta"):
        layer = Attention()
    four_bit_linears(layer, {"q_proj", "v_proj"})
    inject_adapters(layer, LoraSpec(rank=RANK, alpha=2 * RANK, dropout=0.0, target_modules=["q_proj", "v_proj"]))
    layer.to_empty(device="cpu")
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.02)
    quantise_base(layer, torch.device("cpu"), torch.bfloat16)
    assert layer.q_proj.base_layer.weight.quant_state.dtype == torch.bfloat16
    weight_sized = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in CASTS and out.numel() >= WIDTH * WIDTH:  # a dequantised weight cast (fp16 -> bf16)
                weight_sized.append(f"{func}: {args[0].dtype} -> {out.dtype}")
            return out

    x = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    with Casts(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).sum().backward()
    assert weight_sized == []
    assert layer.q_proj.lora_A["default"].weight.grad is not None
