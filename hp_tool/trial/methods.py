"""The fine-tuning methods' transforms of a stage, which :mod:`hp_tool.trial.converters` applies: LoRA adapters
by peft (``inject_adapters``: ``inject_adapter_in_model`` on the stage's layers, the base frozen), and QLoRA's
4-bit base (``four_bit_linears`` on the meta stage before the adapters go on, ``quantise_base`` once
materialised). The adapters' A matrices get the layout-independent seeded initialisation, their B matrices
zeros, so a trial starts from the base model's loss whatever the layout (hp_tool/trial/weights.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_tool.contracts.spec import LoraSpec

ADAPTER_MARK = ".lora_"  # in the name of every adapter parameter (lora_A, lora_B)


def is_adapter(name: str) -> bool:
    """Whether a parameter is one of the method's adapters (trainable, not in a base checkpoint)."""
    return ADAPTER_MARK in name


class AccumulatingLinear(nn.Linear):
    """LoRA's B matrix: with ``into``, its output times ``scale`` is added into ``into`` by the matmul itself
    (``addmm``'s alpha and accumulate), so an adapter costs no output-sized scaling or sum, forward or backward;
    the scale's gradient work is rank-sized. Without ``into``, a plain linear."""

    def forward(self, h: torch.Tensor, into: Optional[torch.Tensor] = None, scale: float = 1.0) -> torch.Tensor:
        if into is None or self.bias is not None:
            out = super().forward(h) * scale
            return out if into is None else into + out
        flat = torch.addmm(into.reshape(-1, into.shape[-1]), h.reshape(-1, h.shape[-1]), self.weight.t(), alpha=scale)
        return flat.view(into.shape)


class _FusedAdapterForward:
    """A peft LoRA layer's forward with its one active adapter fused: base output, then A on the (dropped-out)
    input, then B's matmul scaling and adding into the base output (``AccumulatingLinear``); peft's own forward
    for everything else (merged or disabled adapters, several active, variants such as DoRA, extra arguments).
    peft's 4-bit layer also clones the base output first, a defensive copy that addmm (not in place) needs not."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = self.active_adapters
        name = active[0] if len(active) == 1 else None
        if (args or kwargs or self.disable_adapters or self.merged or name not in self.lora_A
                or name in self.lora_variant or not isinstance(self.lora_B[name], AccumulatingLinear)):
            return super().forward(x, *args, **kwargs)
        h = self.lora_A[name](self.lora_dropout[name](x))
        return self.lora_B[name](h, into=self.base_layer(x), scale=self.scaling[name])


_FUSED: dict[type, type] = {}


def _fused(cls: type) -> type:
    """``cls`` (a peft LoRA layer class) with ``_FusedAdapterForward``'s forward, one class per peft class."""
    if cls not in _FUSED:
        _FUSED[cls] = type(cls.__name__, (_FusedAdapterForward, cls), {"__module__": cls.__module__})
    return _FUSED[cls]


def inject_adapters(stage: nn.Module, lora: LoraSpec) -> None:
    """LoRA's adapters (peft) on ``lora``'s target modules of every layer of ``stage`` (on meta), every other
    parameter frozen, run as tuned stacks run them:

    - an adapter reads its linear's input as it comes, in the compute dtype: peft's cast of the input to the
      adapter's dtype is off (``cast_input_dtype_enabled``), so fp32 adapters under 16-bit autocast cost a cast
      of A and B (rank x width each) per forward, not an fp32 copy of each input and its cast back;
    - the scaling and the sum are folded into B's matmul (``AccumulatingLinear``, ``_FusedAdapterForward``):
      no output-sized kernel beyond the matmuls, forward or backward."""
    from peft import LoraConfig, inject_adapter_in_model  # optional: only adapter methods import peft
    from peft.tuners.lora import LoraLayer

    inject_adapter_in_model(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                       target_modules=list(lora.target_modules), bias="none"), stage)
    for module in stage.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False
            for name, b in list(module.lora_B.items()):
                fused = AccumulatingLinear(b.in_features, b.out_features, bias=b.bias is not None,
                                           device=b.weight.device, dtype=b.weight.dtype)
                fused.weight = b.weight
                module.lora_B[name] = fused
            module.__class__ = _fused(type(module))
    for name, param in stage.named_parameters():
        param.requires_grad_(is_adapter(name))


def four_bit_linears(stage: nn.Module, targets: set[str]) -> None:
    """Replace every target ``nn.Linear`` of ``stage`` (on meta) by bitsandbytes' NF4 ``Linear4bit`` with
    double quantisation, computing in the dtype of its input."""
    import bitsandbytes as bnb  # optional: QLoRA only

    for name, module in list(stage.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and type(child) is nn.Linear:
                four = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                         quant_type="nf4", compress_statistics=True, device="meta")
                setattr(module, child_name, four)


def quantise_base(stage: nn.Module, device, compute_dtype: Optional[torch.dtype] = None) -> None:
    """Quantise the materialised weights of every ``Linear4bit`` of ``stage`` to NF4 on ``device``; their
    matmuls run in ``compute_dtype`` (the trial's autocast dtype, QLoRA's ``bnb_4bit_compute_dtype``; None:
    the input's, fp32 on CPU), not in the fp32 of a norm's output under autocast. Each weight is quantised from
    ``compute_dtype`` (else its own dtype), the dtype its dequantisation then returns: no cast of the
    dequantised weight to the compute dtype, forward or backward."""
    import bitsandbytes as bnb

    for module in stage.modules():
        if isinstance(module, bnb.nn.Linear4bit) and compute_dtype is not None:
            module.compute_dtype, module.compute_type_is_set = compute_dtype, True
        if isinstance(module, bnb.nn.Linear4bit) and not getattr(module.weight, "bnb_quantized", False):
            weight = module.weight  # a replicated DTensor under data parallelism: its local tensor is whole
            data = weight.to_local() if isinstance(weight, DTensor) else weight.data
            source = data.detach().to(compute_dtype or data.dtype).clone()  # dequantised to it, no cast after
            module.weight = bnb.nn.Params4bit(source, requires_grad=False,
                                              quant_type="nf4", compress_statistics=True).to(device)


def four_bit_weights(stage: nn.Module) -> set[nn.Parameter]:
    """The weights of ``stage``'s 4-bit linears (QLoRA), which data parallelism leaves alone."""
    return {m.weight for m in stage.modules() if type(m).__name__ == "Linear4bit"}
