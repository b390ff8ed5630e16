"""Activation offload (``parallel.activation_offload``): where autograd keeps the tensors a forward saves
for backward. The one rule both the torch engine and the pre-launch trace apply, so the traced peak is the
engine's.

Each saved tensor is copied to the host when forward saves it and copied back, as a fresh tensor on its
device, when backward needs it (torch's ``save_on_cpu``: pinned host memory and asynchronous copies from a
GPU). The device then holds a saved tensor only while backward uses it, and the weights a layer saves are
brought back as a copy too, as ``save_on_cpu`` does. A DTensor (tensor parallelism, sequence parallelism)
moves as its local shard and comes back as the same DTensor: ``save_on_cpu``'s pinned copy of its global
shape would mix it with a plain tensor, which DTensor refuses.

On a CPU rank the host is the device: nothing moves and the rank's memory is the same. In the trace, whose
fake CPU tensors stand for a GPU's, the host copies go to the meta device, outside ``TensorPeak``'s count of
the rank's device (:mod:`hp_tool.trial.trace.peak`). The pinned path runs only on a GPU; the CPU tests run
the hooks (DTensors included) with nothing to move.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import NamedTuple, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from hp_tool.contracts.spec import ParallelSpec

HOST = torch.device("cpu")
TRACE_HOST = torch.device("meta")  # where the trace keeps a GPU rank's offloaded tensors: no memory, not counted


class _Offloaded(NamedTuple):
    """A saved tensor as offload keeps it: its host copy, the device it came from, and a DTensor's spec."""

    copy: torch.Tensor
    device: torch.device
    spec: Optional[DTensorSpec]


def host_of(device: torch.device, traced: bool) -> torch.device:
    """Where a rank computing on ``device`` keeps offloaded tensors: host RAM; in the trace of a GPU rank the
    meta device. A CPU rank's host is its own memory, traced or not."""
    return TRACE_HOST if traced and device.type != "cpu" else HOST


def saved_tensors_offload(par: ParallelSpec, device: torch.device, traced: bool = False):
    """The context under which a rank of ``par`` computing on ``device`` runs its forwards and backwards:
    with ``activation_offload``, saved tensors kept on ``host_of(device, traced)`` (pinned host memory from
    a GPU); without it, a no-op. ``traced``: the pre-launch trace's fake tensors stand for ``device``'s."""
    if not par.activation_offload:
        return contextlib.nullcontext()
    host = host_of(device, traced)
    pin = device.type == "cuda" and host.type == "cpu"
    return torch.autograd.graph.saved_tensors_hooks(partial(_pack, host, pin), partial(_unpack, pin))


def _pack(host: torch.device, pin: bool, tensor: torch.Tensor) -> _Offloaded:
    """``tensor`` moved to ``host`` (itself when it is there already), a DTensor by its local shard."""
    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        return _Offloaded(_moved(local.detach(), host, pin), local.device, tensor._spec)
    return _Offloaded(_moved(tensor.detach(), host, pin), tensor.device, None)


def _moved(tensor: torch.Tensor, host: torch.device, pin: bool) -> torch.Tensor:
    """A copy of ``tensor`` on ``host``, in pinned memory with ``pin`` (an asynchronous copy from the GPU)."""
    if tensor.device == host:
        return tensor
    if not pin:
        return tensor.to(host)
    return torch.empty_like(tensor, device=host, pin_memory=True).copy_(tensor, non_blocking=True)


def _unpack(pin: bool, packed: _Offloaded) -> torch.Tensor:
    """The saved tensor back on its device for backward: a fresh copy (a DTensor with its spec again)."""
    local = packed.copy.to(packed.device, non_blocking=pin)
    if packed.spec is None:
        return local
    return DTensor(local, packed.spec, requires_grad=False)
