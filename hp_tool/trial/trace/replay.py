"""The traced step: one rank of a pipeline stage built by the engine's own rank-build function under fake
tensors on a fake process group, then its optimizer steps replayed phase by phase with ``TensorPeak``.

Build (``fake_rank``): one process joins a fake process group of the layout's world size and calls
:func:`hp_tool.trial.rank.build_rank_model` with the fake materialiser (TP, checkpointing, DDP / FSDP2 as
the trial applies them; no memory allocated, so any size traces on a login node). With context parallelism
the rank holds ``seq / cp`` tokens of each sequence (the family's ``fake_batch``) and its ring attention's
sends and receives run on the fake group, which moves no data but gives each receive its fake buffer.
Replay (``_Replay``): two optimizer steps, the first with one micro-batch (it creates the gradients and the
optimizer states), the second with the step's micro-batches in the schedule's order, each followed by the
gradient clipping and the AdamW step. For a GPU target the precision's autocast and FSDP2 parameter dtype are applied as on
the GPU (a pipeline's whole step in one autocast region, whose casts of the weights live until the step
ends, as the engine runs it; without PP one region per forward), and dropout (LoRA's) keeps CUDA's bool mask
instead of the CPU's noise tensor (``dropout_as_on``). AdamW runs without foreach kernels
(under fake tensors their grouped temporaries inflate the FSDP2 step). The loss is the engine's
(``stage_loss_fn``: the chunked loss applies the head a chunk of tokens at a time, in its CPU form; on a
GPU with Liger installed the engine runs Liger's kernel, whose chunks follow its own rule), and the tensors
saved for backward are kept where the engine keeps them (``saved_tensors_offload``: with activation offload
a GPU rank's on the meta device, outside the count).

Pipeline stages are traced as their own modules (the first with the embedding, the last with the head and
the loss; a middle stage receives hidden states, its family's ``fake_batch``, and returns a gradient of its
output's size), replaying 1F1B's order: ``min(PP - stage, micro-batches)`` forwards in flight, then one
backward per forward, with what torch.distributed.pipelining holds besides: one receive buffer per
micro-batch for the whole run (activations on all stages but the first, gradients on all but the last) and
each stage output until its backward; over FSDP2 or replicate, unsharded parameters and gradients kept
until the step's last backward, where the schedule reduces and reshards.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.stage import PipelineStage

from hp_tool.contracts.spec import TrialSpec
from hp_tool.trial import optim
from hp_tool.trial.activation_offload import saved_tensors_offload
from hp_tool.trial.dist import DistEnv, build_mesh, fake_group
from hp_tool.trial.families import torch_family
from hp_tool.trial.models import loss_parallel_context, stage_loss_fn
from hp_tool.trial.rank import (FakeMaterialise, build_rank_model, build_rank_optimizer, compute_dtype, group_of,
                                tp_mesh_of)
from hp_tool.trial.trace.inflight import StageTrace, combine, in_flight, in_flight_counts, traced_spec, \
    with_interleave_buffers
from hp_tool.trial.trace.limits import require_traceable
from hp_tool.trial.trace.peak import TensorPeak


@contextlib.contextmanager
def experts_in_any_float():
    """Let transformers' experts multiply fp32 weights under fake tensors, as a real run does.

    The experts' grouped matmul (torch's ``grouped_mm``, one matrix per expert over its rows) has a fake
    kernel that accepts bf16 only (CUDA's fast kernel's rule), while the CPU kernel and CUDA's fallback
    multiply fp32 too: a trial on CPU, or a GPU stage whose weights no data-parallel wrapper casts to bf16,
    computes its experts in fp32. Here such a product runs as transformers' own fallback operator (the
    same output, the same two inputs kept for backward, a fake kernel for any dtype); bf16 weights keep
    torch's kernel. Nothing changes where transformers has no such switch."""
    from transformers.integrations import moe

    can_use = getattr(moe, "_can_use_grouped_mm", None)
    if can_use is None:
        yield
        return
    moe._can_use_grouped_mm = lambda inputs, weight, offsets: \
        weight.dtype == torch.bfloat16 and can_use(inputs, weight, offsets)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = can_use


@contextlib.contextmanager
def dropout_as_on(device_type: str):
    """Dropout (LoRA's adapters, peft's ``lora_A(dropout(x))``: the engine's only one) as torch runs it on
    ``device_type``, on the CPU's fake tensors. On a device torch's dropout takes its fused kernel,
    ``native_dropout``, which keeps a bool mask for backward (1 byte an element); on a CPU tensor it multiplies
    by a noise tensor of the input's dtype and keeps that (4 bytes in fp32). For a GPU target the trace
    runs ``native_dropout``; for a CPU target torch's own dropout."""
    if device_type != "cuda":
        yield
        return
    functional = torch.nn.functional
    cpu_dropout = functional.dropout

    def gpu_dropout(input, p=0.5, training=True, inplace=False):
        if training and not inplace and 0 < p < 1 and input.numel():
            return torch.native_dropout(input, p, True)[0]
        return cpu_dropout(input, p, training, inplace)

    functional.dropout = gpu_dropout
    try:
        yield
    finally:
        functional.dropout = cpu_dropout


@contextlib.contextmanager
def fake_rank(spec: TrialSpec, stage_index: int, device_type: str):
    """(stage, optimizer, mesh, compute dtype) of one rank of ``stage_index``, built by the engine's
    ``build_rank_model`` with fake tensors on a fake process group of the layout's world size (an
    interleaved rank's layers as one stage, ``traced_spec``); the context is fake tensor mode. A spec the
    trace cannot model raises ``Untraceable`` with the reason (:mod:`hp_tool.trial.trace.limits`)."""
    require_traceable(spec)
    par, device = spec.parallel, torch.device("cpu")
    dtype = compute_dtype(spec, torch.device(device_type))  # the target's dtype; the fake tensors stay on CPU
    per_stage = par.dp * par.cp * par.tp  # ranks of one pipeline stage (the mesh's pp dimension is outermost)
    world = par.pp * per_stage
    fake_group(world)
    try:
        mesh = build_mesh(par, DistEnv(stage_index * per_stage, world, 0), device) if world > 1 else None
        materialise = FakeMaterialise(device)
        stage = build_rank_model(traced_spec(spec), mesh, stage_index, materialise, dtype).stage
        # built outside fake mode: parameter groups read the (real) mesh; states appear at the first step
        optimizer = build_rank_optimizer(spec, stage, mesh, device)
        for group in optimizer.param_groups:  # REFERENCE §11: fake foreach kernels inflate the step
            group["foreach"] = False
        with materialise.mode, experts_in_any_float(), dropout_as_on(device_type):
            yield stage, optimizer, mesh, dtype
    finally:
        dist.destroy_process_group()


def _fake_batch(spec: TrialSpec, stage_index: int, dtype: Optional[torch.dtype]):
    """One micro-batch of this stage's inputs and labels, as the family's record describes them."""
    return torch_family(spec.model.family).fake_batch(spec, stage_index, dtype)


class _Replay:
    """Optimizer steps of one traced stage as the engine runs them, each micro-batch in 1F1B's order (``k``
    forwards in flight first, then one backward per forward; one at a time without PP) and the step's
    gradient clipping and optimizer step; with the schedule's receive buffers, one per micro-batch; the
    tensors saved for backward where the engine keeps them on ``device_type`` (``saved_tensors_offload``)."""

    def __init__(self, spec: TrialSpec, stage, optimizer, stage_index: int, mesh, dtype: Optional[torch.dtype],
                 counts: tuple[int, ...], device_type: str):
        par = spec.parallel
        self.spec, self.stage, self.optimizer, self.dtype = spec, stage, optimizer, dtype
        self.device = torch.device(device_type)
        self.tp_mesh = tp_mesh_of(mesh, par)
        self.m = spec.grad_accum_steps
        self.last = stage_index == par.pp - 1
        self.pipelined = par.pp > 1
        self.loss_fn = stage_loss_fn(stage, par, self.tp_mesh)
        self.pp_group = group_of(mesh, par, "pp")
        self.batches = [_fake_batch(spec, stage_index, dtype) for _ in range(min(self.m, max(counts) + 1))]
        self.tracker = TensorPeak()
        self.tracker.track(stage, optimizer, *[t for inputs, labels in self.batches for t in (*inputs, labels)])
        # torch.distributed.pipelining keeps one receive buffer per micro-batch for the whole run: activations
        # on every stage but the first, their gradients on every stage but the last
        self.recv_grads: list = []
        self.recv_inputs = [[torch.empty_like(t) for t in self.batches[0][0]] for _ in range(self.m - len(self.batches))] \
            if stage_index else []
        # under PP, torch.distributed.pipelining runs an FSDP2 / replicate stage's backwards without gradient
        # reduction or resharding (unsharded parameters and gradients accumulate over the step's
        # micro-batches) and reduces and reshards once after the last (PipelineStage.perform_reduce_grad)
        self.deferred_reduction = self.pipelined and isinstance(stage, FSDPModule)

    def _autocast(self):
        """The GPU's autocast, on the CPU's fake tensors."""
        return torch.autocast("cpu", dtype=self.dtype) if self.dtype is not None else contextlib.nullcontext()

    def _forward(self, inputs, labels) -> tuple:
        """(what backward starts from, what stays referenced until then): the last stage's loss right away,
        as the engine and the schedule do; the schedule also keeps each stage's output until its backward
        (the engine without PP does not). The engine runs a pipeline's whole step in one autocast region (so
        autocast casts each weight once a step and keeps the cast until the region ends), without PP one
        region per micro-batch's forward."""
        with contextlib.nullcontext() if self.pipelined else self._autocast():
            out = self.stage(*inputs)
            if not self.last:
                return (out if isinstance(out, tuple) else (out,)), None
            return (self.loss_fn(out, labels) / self.m,), out if self.pipelined else None

    def _backward(self, pending: tuple) -> None:
        """Backward of one micro-batch from its loss, or from the gradients the next stage sends."""
        if self.deferred_reduction:
            self.stage.set_is_last_backward(False)
            self.stage.set_reshard_after_backward(False)
            self.stage.set_requires_gradient_sync(False)
        outs = pending[0]
        if self.last:
            outs[0].backward()
            return
        if not self.recv_grads:
            self.recv_grads.extend([torch.empty_like(o) for o in outs] for _ in range(self.m))
        torch.autograd.backward(outs, self.recv_grads[0])

    def _micro_batches(self, batches: list, k: int) -> None:
        """Forwards and backwards of ``batches`` with ``k`` in flight, then the pipeline's reduction."""
        with loss_parallel_context(self.tp_mesh), saved_tensors_offload(self.spec.parallel, self.device, traced=True), \
                self._autocast() if self.pipelined else contextlib.nullcontext():
            live = []
            for inputs, labels in batches:
                if len(live) == k:
                    self._backward(live.pop(0))
                live.append(self._forward(inputs, labels))
            while live:
                self._backward(live.pop(0))
            if self.deferred_reduction:
                PipelineStage.perform_reduce_grad(SimpleNamespace(submod=self.stage), grad_scale_factor=1)

    def _optimizer_step(self) -> tuple[int, int]:
        """Clipping and the optimizer step: (bytes live when it starts, its peak)."""
        self.tracker.restart_peak()
        start = self.tracker.current_bytes()
        optim.clip_grad_norm(self.stage, self.spec.training.grad_clip, self.pp_group, frozenset(), torch.device("cpu"))
        optim.optimizer_step(self.optimizer)
        return start, self.tracker.peak_bytes()

    def run(self, counts: tuple[int, ...]) -> list[StageTrace]:
        """The first step, with one micro-batch, creates the gradients and the optimizer states; then one step
        per ``k`` in ``counts``, with ``k + 1`` micro-batches (the steady state's backward-then-forward
        included), gives that count's trace (the optimizer step, the same for every count, runs after the
        first of them). Bytes."""
        train_peaks, steps = [], []
        with self.tracker:
            for k in (1, *counts):
                first = not steps
                for inputs, _ in self.batches:  # the gradients a stage sends back go with the step that made them
                    for t in inputs:
                        t.grad = None
                self.tracker.restart_peak()
                self._micro_batches(self.batches[:1] if first else self.batches[:k + 1], k)
                if not first:
                    train_peaks.append(self.tracker.peak_bytes())
                if len(steps) == 2:  # a later step is the same at any count in flight: once is enough
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                steps.append(self._optimizer_step())
        self.recv_inputs = []
        (_, first_peak), (states, later_peak) = steps
        return [StageTrace(train, first_peak, states, later_peak - states) for train in train_peaks]


def _forward_kept(spec: TrialSpec, stage, stage_index: int, mesh, dtype: Optional[torch.dtype],
                  device_type: str) -> float:
    """Bytes live after one micro-batch's forward (its output kept) less those live before it."""
    tp_mesh = tp_mesh_of(mesh, spec.parallel)
    inputs, labels = _fake_batch(spec, stage_index, dtype)
    tracker = TensorPeak()
    tracker.track(stage, *inputs, labels)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    saved = saved_tensors_offload(spec.parallel, torch.device(device_type), traced=True)
    with tracker, loss_parallel_context(tp_mesh), saved:
        before = tracker.current_bytes()
        with autocast:
            out = stage(*inputs)
            if stage_index == spec.parallel.pp - 1:
                out = stage_loss_fn(stage, spec.parallel, tp_mesh)(out, labels)
        kept = tracker.current_bytes() - before
        del out
    return kept


# This process's traces by (spec fingerprint, stage, device, counts in flight): candidates that differ only
# in how many layers they checkpoint extrapolate from the same one- and two-unit builds, so a worker
# that traces them in turn (memory_check groups them) builds each once.
_TRACES: dict[tuple, list[StageTrace]] = {}


def traced_counts(spec: TrialSpec, stage_index: int, device_type: str, counts: tuple[int, ...]) -> list[StageTrace]:
    """One build of the stage, traced once per count of micro-batches in flight in ``counts``; a build this
    process traced before is not traced again."""
    key = (spec.fingerprint(), stage_index, device_type, counts)
    if key not in _TRACES:
        with fake_rank(spec, stage_index, device_type) as (stage, optimizer, mesh, dtype):
            _TRACES[key] = _Replay(spec, stage, optimizer, stage_index, mesh, dtype, counts, device_type).run(counts)
    return _TRACES[key]


def trace_stage(spec: TrialSpec, stage_index: int = 0, device_type: str = "cpu") -> StageTrace:
    """Trace one rank of pipeline stage ``stage_index`` of ``spec`` as it is (every layer of the stage, the
    schedule's micro-batches in flight), as the trial runs it on ``device_type`` ("cuda": the precision's
    autocast and FSDP2 parameter dtype)."""
    counts, weights = in_flight_counts(spec, stage_index) if spec.parallel.virtual_stages > 1 else \
        ((in_flight(spec, stage_index),), (1,))
    traced = combine(list(zip(traced_counts(traced_spec(spec), stage_index, device_type, counts), weights,
                              strict=True)))
    return with_interleave_buffers(spec, stage_index, device_type, traced)


def states_and_kept_bytes(spec: TrialSpec, stage_index: int = 0, device_type: str = "cpu") -> tuple[float, float]:
    """(the bytes of parameters, gradients and optimizer states when a later optimizer step starts, the
    bytes one micro-batch's forward leaves live until its backward) on a rank of stage ``stage_index``.
    The second is the activations autograd saved, the output (the loss on the last stage) and the weights'
    compute copies that forward made and backward reads (autocast's casts; FSDP2's and replicate's
    unsharded parameters); taken after the first optimizer step, so without gradients. The terms the
    analytic model adds up (hp_tool/trial/memterms.py compares them)."""
    with fake_rank(spec, stage_index, device_type) as (stage, optimizer, mesh, dtype):
        (trace,) = _Replay(spec, stage, optimizer, stage_index, mesh, dtype, (1,), device_type).run((1,))
        return trace.state_bytes, _forward_kept(spec, stage, stage_index, mesh, dtype, device_type)
