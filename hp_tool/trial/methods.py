"""A fine-tuning method applied to a stage on the meta device, before parallelisation: LoRA adapters by peft
(``inject_adapter_in_model`` on the stage's layers; the base frozen). The adapters' A matrices get the
layout-independent seeded initialisation, their B matrices zeros, so a trial starts from the base model's
loss whatever the layout (hp_tool/trial/weights.py).
"""

from __future__ import annotations

from torch import nn

from hp_tool.contracts.spec import ModelSpec
from hp_tool.errors import require

ADAPTER_MARK = ".lora_"  # in the name of every adapter parameter (lora_A, lora_B)


def is_adapter(name: str) -> bool:
    """Whether a parameter is one of the method's adapters (trainable, not in a base checkpoint)."""
    return ADAPTER_MARK in name


def apply_method(stage: nn.Module, model: ModelSpec) -> nn.Module:
    """``stage`` with the spec's method applied in place: nothing for full training; LoRA's adapters on the
    target modules of every layer, every other parameter frozen."""
    if model.method == "full":
        return stage
    require(model.method == "lora", "model.method", model.method,
            "the trial engine trains full and lora (qlora's 4-bit base is planned, not yet run)",
            "search methods [full, lora]")
    from peft import LoraConfig, inject_adapter_in_model  # optional: only adapter methods import peft

    lora = model.lora
    inject_adapter_in_model(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                       target_modules=list(lora.target_modules), bias="none"), stage)
    for name, param in stage.named_parameters():
        param.requires_grad_(is_adapter(name))
    return stage
