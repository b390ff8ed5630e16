"""Peak tensor memory of one rank: measured in a real trial, or traced before launch under fake tensors.

Both count the same thing, the bytes of live tensor storages (parameters, gradients, optimizer states,
activations, temporaries) with ``TensorPeak``, a ``torch.distributed._tools.MemTracker`` without its
per-module statistics (which refuse a module called once per micro-batch). What tensors do not show
(CUDA context, communication buffers, allocator slack) is the gpu preset's ``memory_overhead_gb``.

Tracing (REFERENCE §11): one process joins a fake process group of the layout's world size, builds the
trial's stage exactly as the engine does (``build_stage`` and ``parallelize_stage``: TP, checkpointing,
DDP / FSDP2), then inside ``FakeTensorMode`` materialises it, and runs one micro-batch's forward and
backward and the optimizer step twice (the second step has the optimizer states). No real memory is
allocated, so any size traces on a login node. AdamW runs without foreach kernels (under fake tensors
their grouped temporaries inflate the FSDP2 step).

Pipeline stages are traced as their own modules (the first with the embedding, the last with the head and
the loss; a middle stage receives hidden states and returns a gradient of its output's size), replaying
1F1B's order: ``min(PP - stage, micro-batches)`` forwards in flight, then one backward per forward, with
what torch.distributed.pipelining holds besides: one receive buffer per micro-batch for the whole run
(activations on all stages but the first, gradients on all but the last) and each stage output until its
backward.

Fidelity on CPU (tests/test_memtrace.py, benchmarks/memory_trace.py): equal to the real run's measured
peak per rank for one process, DDP and FSDP2 with and without checkpointing (the real run's foreach AdamW
peaks below its backward there) and PP (within 1%); TP reads 3-7% high (backward temporaries of the fake
DTensor path) — not yet used for pruning. Stages are
traced whole; extrapolating deep stages from 1-2 layers is still to come.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from hp_tool.trial.spec import TrialSpec

GB = 1e9


class TensorPeak(MemTracker):
    """Peak bytes of live tensor storages inside the context, counted as MemTracker counts them, without
    per-module statistics. ``track(*modules_or_optimizers)`` registers what exists before the context."""

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
        from torch._guards import active_fake_mode
        from torch.utils._python_dispatch import TorchDispatchMode

        if self._depth == 0:
            self._fake_mode_on_entry = active_fake_mode()
            self._register_global_optimizer_hook()
            self._track_resize()
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        TorchDispatchMode.__enter__(self)
        self._depth += 1
        return self

    def __exit__(self, *args) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self._depth -= 1
        if self._depth == 0:
            self._deregister_param_and_optimizer_hooks()
            self._restore_resize()
        TorchDispatchMode.__exit__(self, *args)

    def track(self, *objects) -> None:
        """Register modules, optimizers (or ones wrapping ``.zero``) and tensors created before the context."""
        for obj in objects:
            inner = getattr(obj, "zero", obj)  # optim.ShardedAdamW wraps a ZeroRedundancyOptimizer
            if isinstance(inner, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
                self.track_external(inner)

    def current_bytes(self) -> int:
        return sum(snap["Total"] for snap in self.get_tracker_snapshot("current").values())

    def peak_bytes(self) -> int:
        return sum(self._peak_mem.values())

    def restart_peak(self) -> None:
        """Start a new peak from the current bytes."""
        self._peak_mem = {dev: snap["Total"] for dev, snap in self.get_tracker_snapshot("current").items()}


@dataclass(frozen=True)
class StageTrace:
    """One traced rank of a stage: its peak tensor bytes."""

    peak_bytes: int

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB


def _fake_group(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


def trace_stage(spec: TrialSpec, stage_index: int = 0) -> StageTrace:
    """Trace one rank of pipeline stage ``stage_index`` of ``spec`` as it is (every layer of the stage)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hp_tool.trial import optim
    from hp_tool.trial.dist import DistEnv, build_mesh
    from hp_tool.trial.engine import compute_dtype
    from hp_tool.trial.models import build_stage
    from hp_tool.trial.parallel import parallelize_stage

    par, device = spec.parallel, torch.device("cpu")
    world = par.tp * par.pp * par.dp
    _fake_group(world)
    try:
        mesh = build_mesh(par, DistEnv(stage_index * par.dp * par.tp, world, 0), device) if world > 1 else None
        stage = build_stage(spec.model, par.pp, stage_index)
        parallelize_stage(stage, par, mesh, compute_dtype(spec, device), device)
        tp_mesh = mesh["tp"] if mesh is not None and par.tp > 1 else None
        dp_group = mesh["dp"].get_group() if mesh is not None and par.dp > 1 else None
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            stage.to_empty(device=device)
            stage.retie()
            stage.reset_buffers(device)
        # built outside fake mode: parameter groups read the (real) mesh; states appear at the first step
        optimizer = optim.build_optimizer(stage, spec.training, device, par.zero_stage, dp_group,
                                          offload=par.offload != "none")
        for group in optimizer.param_groups:  # REFERENCE §11: fake foreach kernels inflate the step
            group["foreach"] = False
        with fake:
            return _run_traced(spec, stage, optimizer, stage_index, mesh, tp_mesh)
    finally:
        dist.destroy_process_group()


def _fake_batch(spec: TrialSpec, stage_index: int):
    """One micro-batch of this stage's inputs: token ids on the first stage, else what it receives."""
    m, mbs = spec.model, spec.parallel.mbs
    target = m.decoder_seq_length or m.seq_length
    labels = torch.randint(0, m.vocab_size, (mbs, target))
    if stage_index == 0:
        enc = torch.randint(0, m.vocab_size, (mbs, m.seq_length))
        return ((enc, labels) if m.decoder_seq_length else (enc,)), labels
    hidden = torch.empty(mbs, m.seq_length, m.hidden_size, requires_grad=True)
    if not m.decoder_seq_length:
        return (hidden,), labels
    raise NotImplementedError("tracing a later pipeline stage of an encoder-decoder")


def _run_traced(spec: TrialSpec, stage, optimizer, stage_index: int, mesh, tp_mesh) -> StageTrace:
    """Two optimizer steps of this stage as the engine runs them: the 1F1B order of micro-batches (all
    forwards in flight first, then one backward per forward; one at a time without PP), enough of them to
    accumulate gradients once, then the gradient clipping and the optimizer step; with the schedule's
    receive buffers, one per micro-batch."""
    from hp_tool.trial import optim
    from hp_tool.trial.models import loss_parallel_context, make_loss_fn

    par = spec.parallel
    m = spec.grad_accum_steps
    in_flight = min(par.pp - stage_index, m) if par.pp > 1 else 1
    last = stage_index == par.pp - 1
    loss_fn = make_loss_fn(tp_mesh)
    pp_group = mesh["pp"].get_group() if mesh is not None and par.pp > 1 else None
    batches = [_fake_batch(spec, stage_index) for _ in range(min(m, in_flight + 1))]
    tracker = TensorPeak()
    tracker.track(stage, optimizer, *[t for inputs, labels in batches for t in (*inputs, labels)])

    def forward(inputs, labels) -> tuple:
        """(what backward starts from, what stays referenced until then): the last stage's loss right away,
        as the engine and the schedule do; the schedule also keeps each stage's output until its backward
        (the engine without PP does not)."""
        out = stage(*inputs)
        if not last:
            return out, None
        return loss_fn(out, labels) / m, out if par.pp > 1 else None

    # torch.distributed.pipelining keeps one receive buffer per micro-batch for the whole run: activations
    # on every stage but the first, their gradients on every stage but the last
    recv_grads: list = []
    recv_inputs = [torch.empty_like(batches[0][0][0]) for _ in range(m - len(batches))] if stage_index else []

    def backward(pending: tuple) -> None:
        out = pending[0]
        if last:
            out.backward()
            return
        if not recv_grads:
            recv_grads.extend(torch.empty_like(out) for _ in range(m))
        out.backward(recv_grads[0])  # the gradient the next stage sends

    train_peak = step_peak = 0
    with tracker:
        for _ in range(2):
            tracker.restart_peak()
            with loss_parallel_context(tp_mesh):
                live = []
                for inputs, labels in batches:
                    if len(live) == in_flight:
                        backward(live.pop(0))
                    live.append(forward(inputs, labels))
                while live:
                    backward(live.pop(0))
            train_peak = max(train_peak, tracker.peak_bytes())
            tracker.restart_peak()
            optim.clip_grad_norm(stage, spec.training.grad_clip, pp_group, frozenset(), torch.device("cpu"))
            optim.optimizer_step(optimizer)
            step_peak = max(step_peak, tracker.peak_bytes())
    del recv_inputs
    return StageTrace(max(train_peak, step_peak))
