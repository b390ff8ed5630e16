"""Peak bytes of one rank's live tensor storages: ``TensorPeak``, the count both the real trial (its first
untimed steps, ``peak_tensor_memory_gib``) and the pre-launch trace (:mod:`hp_tool.trial.trace.replay`) make.

It counts parameters, gradients, optimizer states, activations and temporaries as
``torch.distributed._tools.MemTracker`` does, without its per-module statistics (which refuse a module
called once per micro-batch), on the rank's device only: activation offload's host copies
(:mod:`hp_tool.trial.activation_offload`; the meta device's in the trace) are not its memory. What tensors
do not show (CUDA context, communication buffers, allocator slack) is the gpu preset's
``memory_overhead_gib``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode


class TensorPeak(MemTracker):
    """Peak bytes of live tensor storages on devices of ``device_type`` inside the context (the rank's
    device: a trial's, or the CPU whose fake tensors the trace runs), counted as MemTracker counts them,
    without per-module statistics. ``track(*modules_or_optimizers)`` registers what exists before the
    context."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type

    def _pre_fw_hook(self, module, inputs) -> None:  # noqa: D401 - per-module stats are not kept
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def __enter__(self) -> "TensorPeak":
        # MemTracker.__enter__ without its ModTracker, whose multi-grad hooks the pipeline schedule's
        # autograd.grad() calls do not support
        if self._depth == 0:
            self._fake_mode_on_entry = active_fake_mode()
            if self._fake_mode_on_entry is not None:
                self._skip_dtensor_propagation()
            self._register_global_optimizer_hook()
            self._track_resize()
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        TorchDispatchMode.__enter__(self)
        self._depth += 1
        return self

    def __exit__(self, *args) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._deregister_param_and_optimizer_hooks()
            self._restore_resize()
            self._restore_dtensor_propagation()
        TorchDispatchMode.__exit__(self, *args)

    _propagating = 0
    _orig_propagate = None

    def _skip_dtensor_propagation(self) -> None:
        """Under fake tensors DTensor derives each op's output metadata by running the op on global-shape
        tensors in the active fake mode, i.e. the trace's own (uncached: fake mode counts as tracing), so
        MemTracker would count those transient whole tensors as this rank's memory (at TP's peak: the
        vocab-parallel loss backward's [tokens, vocab] input and gradient); a real run propagates in a
        private fake mode, which MemTracker skips. Mark the propagation so ``__torch_dispatch__`` lets it
        through uncounted."""
        orig = ShardingPropagator._propagate_tensor_meta_non_cached
        tracker = self

        def propagate(prop, op_schema):
            tracker._propagating += 1
            try:
                return orig(prop, op_schema)
            finally:
                tracker._propagating -= 1

        self._orig_propagate = orig
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate

    def _restore_dtensor_propagation(self) -> None:
        if self._orig_propagate is not None:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
            self._orig_propagate = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating:  # DTensor's global-shape propagation: see _skip_dtensor_propagation
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def track(self, *objects) -> None:
        """Register modules, optimizers (or ones wrapping ``.zero``) and tensors created before the context."""
        for obj in objects:
            inner = getattr(obj, "zero", obj)  # optim.ShardedAdamW wraps a ZeroRedundancyOptimizer
            if isinstance(inner, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
                self.track_external(inner)

    def _on_device(self, per_device: dict) -> int:
        """The sum of ``per_device``'s bytes over the devices of the rank's type."""
        return sum(n for device, n in per_device.items() if device.type == self.device_type)

    def current_bytes(self) -> int:
        return self._on_device({dev: snap["Total"] for dev, snap in self.get_tracker_snapshot("current").items()})

    def peak_bytes(self) -> int:
        return self._on_device(self._peak_mem)

    def restart_peak(self) -> None:
        """Start a new peak from the current bytes."""
        self._peak_mem = {dev: snap["Total"] for dev, snap in self.get_tracker_snapshot("current").items()}
