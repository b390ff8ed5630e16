"""Training transforms of a model (torchtitan's model converters), applied at one point of the build.

A converter says whether a model spec asks for it (``applies``), converts the stage on the meta device right
after it is cut, before any parallel wrapper (``convert``), and may finish its work once the weights are
filled (``materialised``, timed as its own build ``phase``). ``CONVERTERS`` lists them in the order they
apply; ``convert_stage`` (called by ``models.build_stage``) applies those a spec asks for, and the
weights' materialiser (``rank.Initialise``) runs their ``materialised`` steps in the same order. A new
transform is one more converter in the list.

    FourBitBase   QLoRA: the adapted linears become bitsandbytes' NF4 ``Linear4bit``, quantised once filled
    LoraAdapters  LoRA and QLoRA: peft's adapters on the target modules, every other parameter frozen
    Float8Linears fp8: the layers' linears become torchao's ``Float8Linear`` (full training, bf16 elsewhere)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hp_tool.contracts.spec import ModelSpec
from hp_tool.trial.methods import four_bit_linears, inject_adapters, quantise_base


class Converter:
    """One training transform of a stage."""

    phase: Optional[str] = None
    """The build phase its ``materialised`` step is timed as (``hp_tool.contracts.phases``); None: no step."""

    def applies(self, model: ModelSpec) -> bool:
        """Whether ``model`` asks for this transform."""
        raise NotImplementedError

    def convert(self, stage: nn.Module, model: ModelSpec) -> None:
        """Transform ``stage`` in place, on the meta device, before parallelisation."""
        raise NotImplementedError

    def materialised(self, stage: nn.Module, device: torch.device, compute_dtype: Optional[torch.dtype]) -> None:
        """Finish the transform once ``stage``'s weights are filled on ``device`` (nothing by default)."""


class FourBitBase(Converter):
    """QLoRA's base: the target linears in bitsandbytes' NF4 with double quantisation, quantised from their
    filled weights, their matmuls in the trial's compute dtype."""

    phase = "quantise"

    def applies(self, model: ModelSpec) -> bool:
        return model.method == "qlora"

    def convert(self, stage: nn.Module, model: ModelSpec) -> None:
        four_bit_linears(stage, set(model.lora.target_modules))

    def materialised(self, stage: nn.Module, device: torch.device, compute_dtype: Optional[torch.dtype]) -> None:
        quantise_base(stage, device, compute_dtype)


class LoraAdapters(Converter):
    """LoRA's adapters on the target modules (over QLoRA's 4-bit base too), the rest frozen."""

    def applies(self, model: ModelSpec) -> bool:
        return model.method in ("lora", "qlora")

    def convert(self, stage: nn.Module, model: ModelSpec) -> None:
        inject_adapters(stage, model.lora)


class Float8Linears(Converter):
    """The layers' linears as torchao's ``Float8Linear`` (dynamic tensorwise scaling: each matmul's input,
    weight and output gradient cast to fp8 with a scale from its amax), their weights and everything else in the
    compute precision; the embedding and the head stay as they are (torchtitan leaves its output projection out
    too), and so does a linear whose dimensions are not multiples of 16 (fp8 GEMMs need them). The planner runs it
    on GPUs with fp8 tensor cores only (hp_tool/sharding.py ``fp8_problem``); on CPU processes torch emulates the
    scaled matmuls, so a CPU trial checks the conversion, not its speed."""

    def applies(self, model: ModelSpec) -> bool:
        return model.fp8

    def convert(self, stage: nn.Module, model: ModelSpec) -> None:
        from torchao.float8 import convert_to_float8_training  # optional: hp_tool's fp8 extra

        convert_to_float8_training(stage.layers, module_filter_fn=lambda module, fqn: isinstance(module, nn.Linear)
                                   and module.in_features % 16 == 0 and module.out_features % 16 == 0)


CONVERTERS: tuple[Converter, ...] = (FourBitBase(), LoraAdapters(), Float8Linears())
"""Every converter, in the order they apply (the 4-bit base before the adapters that wrap its linears)."""


def converters_for(model: ModelSpec) -> tuple[Converter, ...]:
    """The converters ``model`` asks for, in order."""
    return tuple(converter for converter in CONVERTERS if converter.applies(model))


def convert_stage(stage: nn.Module, model: ModelSpec) -> nn.Module:
    """``stage`` (on meta) with the converters ``model`` asks for applied in order, in place."""
    for converter in converters_for(model):
        converter.convert(stage, model)
    return stage
