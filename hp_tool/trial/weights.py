"""Deterministic, layout-independent weight initialisation.

Every parameter's full logical tensor is drawn from its own generator, seeded from the run's seed and
the parameter's canonical name; each rank then keeps only its own shard (``distribute_tensor`` with
``src_data_rank=None`` slices locally, no communication). So a TP=2 x PP=2 x DP=2 run starts from exactly
the weights of the single-process run. Only one full parameter exists at a time, on this rank's device.

Values follow the GPT/Llama convention: matrices and embeddings ~ N(0, init_method_std), biases 0,
norm weights 1.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hp_tool.trial.methods import four_bit_weights, is_adapter
from hp_tool.trial.stage import canonical_name


def _param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter, stable across processes and Python versions."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & ((1 << 63) - 1)


def _full_value(name: str, shape: torch.Size, std: float, seed: int,
                device: torch.device) -> torch.Tensor:
    """The full (unsharded) fp32 initial value of parameter ``name``."""
    if name.endswith(".bias") or ".lora_B." in name:  # LoRA's B starts at zero: the base model's output
        return torch.zeros(shape, device=device)
    if len(shape) == 1:  # LayerNorm / RMSNorm weight
        return torch.ones(shape, device=device)
    generator = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


Source = Callable[[str, torch.Size], torch.Tensor]  # (canonical name, shape) -> the full tensor


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, std: float, tied: bool, source: Optional[Source] = None,
                 draw_device: Optional[torch.device] = None) -> int:
    """Fill every (materialised) parameter of ``module`` in place, from ``source`` (a checkpoint,
    :mod:`hp_tool.trial.checkpoint`) or the seeded initial values drawn on ``draw_device`` (default: where
    each parameter lives; the compute device for parameters held on the host, so an offloaded run starts from
    the weights of one that is not); returns the local element count."""
    local_numel = 0
    for raw_name, param in module.named_parameters():
        name = canonical_name(raw_name, tied)
        where = draw_device or param.device
        if source is not None and not is_adapter(name):  # adapters are not in the base checkpoint
            full = source(name, param.shape).to(where)
        else:
            full = _full_value(name, param.shape, std, seed, where)
        if isinstance(param, DTensor):
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            local = param.to_local()
            local.copy_(shard.to_local().to(local.dtype))
        else:
            local = param
            local.copy_(full.to(param.dtype))
        local_numel += local.numel()
    return local_numel


def hold_in(stage: nn.Module, dtype: torch.dtype, trained: bool) -> None:
    """Hold ``stage``'s parameters (on meta, before any storage exists) in ``dtype``, the trial's 16-bit compute
    dtype: the frozen ones, as peft users load an adapter method's base (``torch_dtype=torch.bfloat16``: half the
    bytes of fp32, and autocast computes on the weights as they are instead of keeping a 16-bit copy of each for
    backward), and with ``trained`` the trained ones too (master_weights bf16: no fp32 master, the optimizer's
    moments made in their dtype). Adapters otherwise stay fp32 (peft's default); QLoRA's 4-bit linears quantise
    their own filled weights."""
    four_bit, held = four_bit_weights(stage), {}  # held: a tied weight stays one parameter
    for module in stage.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if (trained or not param.requires_grad) and param.is_floating_point() and param not in four_bit:
                if id(param) not in held:
                    held[id(param)] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
                setattr(module, name, held[id(param)])


def materialize(stage, device: torch.device, seed: int, std: float, source: Optional[Source] = None,
                params_device: Optional[torch.device] = None) -> int:
    """Allocate a meta-device stage's (local shards of) parameters on ``params_device`` (default ``device``;
    the host where FSDP2 offloads them, which requires every parameter there, the root's too), re-tie its
    head, rebuild its buffers on ``device`` and fill the weights with ``init_weights`` (from ``source`` when
    given, drawn on ``device``); returns the local element count."""
    stage.to_empty(device=params_device or device)
    stage.retie()
    stage.reset_buffers(device)
    return init_weights(stage, seed, std, stage.tied, source, draw_device=device)
