"""Peak tensor memory of one rank: measured in a real trial, or traced before launch under fake tensors.

Both count the same thing, the bytes of live tensor storages (parameters, gradients, optimizer states,
activations, temporaries) with ``TensorPeak``, a ``torch.distributed._tools.MemTracker`` without its
per-module statistics (which refuse a module called once per micro-batch). What tensors do not show
(CUDA context, communication buffers, allocator slack) is the gpu preset's ``memory_overhead_gb``.

Tracing (REFERENCE §11): one process joins a fake process group of the layout's world size, builds the
trial's stage exactly as the engine does (``build_stage`` and ``parallelize_stage``: TP, checkpointing,
DDP / FSDP2), then inside ``FakeTensorMode`` materialises it and runs two optimizer steps: the first with
one micro-batch (it creates the gradients and the optimizer states), the second with the step's
micro-batches in the schedule's order, each followed by the gradient clipping and the AdamW step. For a
GPU target the precision's autocast and FSDP2 parameter dtype are applied as on the GPU (a pipeline's
whole step in one autocast region, whose casts of the weights live until the step ends, as the engine
runs it; without PP one region per forward). No real memory
is allocated, so any size traces on a login node. AdamW runs without foreach kernels (under fake tensors
their grouped temporaries inflate the FSDP2 step). Deep stages are extrapolated from 1 and 2 layers,
phase by phase (``extrapolated_stages``); ``traced_peak_bytes`` is the busiest rank's peak.

Pipeline stages are traced as their own modules (the first with the embedding, the last with the head and
the loss; a middle stage receives hidden states and returns a gradient of its output's size), replaying
1F1B's order: ``min(PP - stage, micro-batches)`` forwards in flight, then one backward per forward, with
what torch.distributed.pipelining holds besides: one receive buffer per micro-batch for the whole run
(activations on all stages but the first, gradients on all but the last) and each stage output until its
backward; over FSDP2 or replicate, unsharded parameters and gradients kept until the step's last backward,
where the schedule reduces and reshards.

Fidelity on CPU (tests/test_memtrace.py, benchmarks/memory_trace.py): equal to the real run's measured
peak per rank for one process, DDP and FSDP2 with and without checkpointing (the real run's foreach AdamW
peaks below its backward there), PP and TP (within 1%: DTensor's global-shape propagation, which under
fake tensors runs in the trace's own fake mode, is not counted; see ``TensorPeak``); the extrapolation
within 1% of the whole stage's trace (tests/test_memory_check.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from hp_tool.estimate.layout import interleave_held_tensors, microbatches_in_flight
from hp_tool.contracts.spec import TrialSpec

GB = 1e9
WHOLE_UNITS = 4  # a stage of this many units (see stage_units) or fewer is traced whole, not extrapolated


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
        from torch.utils._python_dispatch import TorchDispatchMode

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
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

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
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

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

    def current_bytes(self) -> int:
        return sum(snap["Total"] for snap in self.get_tracker_snapshot("current").values())

    def peak_bytes(self) -> int:
        return sum(self._peak_mem.values())

    def restart_peak(self) -> None:
        """Start a new peak from the current bytes."""
        self._peak_mem = {dev: snap["Total"] for dev, snap in self.get_tracker_snapshot("current").items()}


@dataclass(frozen=True)
class StageTrace:
    """One traced rank of a stage, phase by phase: the peak of the micro-batches' forwards and backwards
    (``train_bytes``), the peak of the first optimizer step (which creates the optimizer states), and of a
    later step: the bytes live when it starts (parameters, gradients, optimizer states) and the peak
    above them (the largest parameter's temporaries, the same for any depth)."""

    train_bytes: float
    first_step_bytes: float
    state_bytes: float
    step_transient_bytes: float

    @property
    def peak_bytes(self) -> float:
        return max(self.train_bytes, self.first_step_bytes, self.state_bytes + self.step_transient_bytes)

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB


def combine(terms: list[tuple[StageTrace, float]]) -> StageTrace:
    """Phase by phase, the sum of ``weight * trace``; the step's temporaries, the most of any."""
    return StageTrace(sum(w * t.train_bytes for t, w in terms), sum(w * t.first_step_bytes for t, w in terms),
                      sum(w * t.state_bytes for t, w in terms), max(t.step_transient_bytes for t, _ in terms))


def _fake_group(world: int):
    """A fresh fake process group of ``world`` ranks (this process is rank 0), after forgetting what DTensor
    cached under the last one: its sharding propagation remembers output specs by mesh shape, and a
    remembered mesh names groups that died with the last layout's process group. So one process can trace
    any number of layouts in turn (memory_check's workers do)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's copy
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


def in_flight(spec: TrialSpec, stage_index: int) -> float:
    """Micro-batches whose activations the schedule keeps at once on a rank of stage ``stage_index``, in
    units of one micro-batch through all the rank's layers (``estimate.layout.microbatches_in_flight``, the
    analytic model's count): 1F1B's PP - stage, at most the step's micro-batches; one without PP; a
    fraction under interleaved 1F1B."""
    k = microbatches_in_flight(spec.layout(), stage_index)
    return int(k) if k.is_integer() else k


def with_interleave_buffers(spec: TrialSpec, stage_index: int, device_type: str, trace: StageTrace) -> StageTrace:
    """``trace`` of the rank's layers as one stage (``traced_spec``) plus the hidden-state tensors
    interleaved 1F1B holds besides (``estimate.layout.interleave_held_tensors``, the analytic model's
    count): the receive buffers in every phase, the held sends at the step's peak (the in-flight
    activations the trace holds there are partly freed by the step's end, so this errs high by a few of
    them). Unchanged without interleaving."""
    recv, sends = interleave_held_tensors(spec.layout(), stage_index)
    if recv + sends == 0:
        return trace
    from hp_tool.trial.engine import compute_dtype

    dtype = compute_dtype(spec, torch.device(device_type)) or torch.float32
    hidden = spec.parallel.mbs * spec.model.seq_length * spec.model.hidden_size * dtype.itemsize
    return StageTrace(trace.train_bytes + (recv + sends) * hidden, trace.first_step_bytes + recv * hidden,
                      trace.state_bytes + recv * hidden, trace.step_transient_bytes)


def traced_spec(spec: TrialSpec) -> TrialSpec:
    """The spec whose stage the tracer builds: under interleaved 1F1B, the rank's v chunks traced as one
    stage of all its layers (same parameters, states and per-layer activations; the schedule's count in
    flight, ``in_flight``, comes from the spec itself)."""
    if spec.parallel.virtual_stages == 1:
        return spec
    return dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, virtual_stages=1))


def trace_stage(spec: TrialSpec, stage_index: int = 0, device_type: str = "cpu") -> StageTrace:
    """Trace one rank of pipeline stage ``stage_index`` of ``spec`` as it is (every layer of the stage, the
    schedule's micro-batches in flight), as the trial runs it on ``device_type`` ("cuda": the precision's
    autocast and FSDP2 parameter dtype)."""
    counts, weights = _in_flight_counts(spec, stage_index) if spec.parallel.virtual_stages > 1 else \
        ((in_flight(spec, stage_index),), (1,))
    traced = combine(list(zip(_trace_stage(traced_spec(spec), stage_index, device_type, counts), weights, strict=True)))
    return with_interleave_buffers(spec, stage_index, device_type, traced)


# This process's traces by (spec fingerprint, stage, device, counts in flight): candidates that differ only
# in how many layers they checkpoint extrapolate from the same one- and two-unit builds, so a worker
# that traces them in turn (memory_check groups them) builds each once.
_TRACES: dict[tuple, list[StageTrace]] = {}


def _trace_stage(spec: TrialSpec, stage_index: int, device_type: str, counts: tuple[int, ...]) -> list[StageTrace]:
    """One build of the stage, traced once per count of micro-batches in flight (``_run_traced``); a build
    this process traced before is not traced again."""
    key = (spec.fingerprint(), stage_index, device_type, counts)
    if key not in _TRACES:
        with _built(spec, stage_index, device_type) as (stage, optimizer, mesh, dtype):
            _TRACES[key] = _run_traced(spec, stage, optimizer, stage_index, mesh, dtype, counts)
    return _TRACES[key]


def states_and_kept_bytes(spec: TrialSpec, stage_index: int = 0, device_type: str = "cpu") -> tuple[float, float]:
    """(the bytes of parameters, gradients and optimizer states when a later optimizer step starts, the
    bytes one micro-batch's forward leaves live until its backward) on a rank of stage ``stage_index``.
    The second is the activations autograd saved, the output (the loss on the last stage) and the weights'
    compute copies that forward made and backward reads (autocast's casts; FSDP2's and replicate's
    unsharded parameters); taken after the first optimizer step, so without gradients. The terms the
    analytic model adds up (hp_tool/trial/memterms.py compares them)."""
    with _built(spec, stage_index, device_type) as (stage, optimizer, mesh, dtype):
        (trace,) = _run_traced(spec, stage, optimizer, stage_index, mesh, dtype, (1,))
        return trace.state_bytes, _forward_kept(spec, stage, stage_index, mesh, dtype)


@contextlib.contextmanager
def _built(spec: TrialSpec, stage_index: int, device_type: str):
    """(stage, optimizer, mesh, compute dtype) of one rank of ``stage_index``, built as the engine builds
    them on a fake process group of the layout's world size; the context is fake tensor mode."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hp_tool.trial import optim
    from hp_tool.trial.dist import DistEnv, build_mesh
    from hp_tool.trial.engine import compute_dtype, group_of
    from hp_tool.trial.models import build_stage
    from hp_tool.trial.parallel import parallelize_stage

    par, device = spec.parallel, torch.device("cpu")
    dtype = compute_dtype(spec, torch.device(device_type))  # the target's dtype; the fake tensors stay on CPU
    world = par.tp * par.pp * par.dp
    _fake_group(world)
    try:
        mesh = build_mesh(par, DistEnv(stage_index * par.dp * par.tp, world, 0), device) if world > 1 else None
        stage = build_stage(spec.model, par.pp, stage_index)
        parallelize_stage(stage, par, mesh, dtype, device)
        dp_group = group_of(mesh, par, "dp")
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
            yield stage, optimizer, mesh, dtype
    finally:
        dist.destroy_process_group()


def _fake_batch(spec: TrialSpec, stage_index: int, dtype: Optional[torch.dtype]):
    """One micro-batch of this stage's inputs: token ids on the first stage, else what the previous stage
    sends (hidden states; for T5/mT5 the encoder's and the decoder's, and the stack's position table
    unless the previous stage ended the encoder, see encdec.EncDecStage.forward)."""
    m, par = spec.model, spec.parallel
    mbs = par.mbs
    target = m.decoder_seq_length or m.seq_length
    labels = torch.randint(0, m.vocab_size, (mbs, target))
    if stage_index == 0:
        enc = torch.randint(0, m.vocab_size, (mbs, m.seq_length))
        return ((enc, labels) if m.decoder_seq_length else (enc,)), labels

    def hidden(length: int) -> torch.Tensor:
        return torch.empty(mbs, length, m.hidden_size, dtype=dtype or torch.float32, requires_grad=True)

    if not m.decoder_seq_length:
        return (hidden(m.seq_length),), labels
    inputs = (hidden(m.seq_length), hidden(target))
    if stage_index != par.pp // 2:  # the stage before ended the encoder: no table follows
        from hp_tool.families.t5 import RELATIVE_ATTENTION_BUCKETS

        table = torch.empty(RELATIVE_ATTENTION_BUCKETS, m.num_attention_heads // par.tp,
                            dtype=dtype or torch.float32, requires_grad=True)
        inputs += (table,)
    return inputs, labels


def _run_traced(spec: TrialSpec, stage, optimizer, stage_index: int, mesh, dtype: Optional[torch.dtype],
                counts: tuple[int, ...]) -> list[StageTrace]:
    """Optimizer steps of this stage as the engine runs them, each micro-batch in 1F1B's order (``k``
    forwards in flight first, then one backward per forward; one at a time without PP) and the step's
    gradient clipping and optimizer step; with the schedule's receive buffers, one per micro-batch. The first
    step, with one micro-batch, creates the gradients and the optimizer states; then one step per ``k`` in
    ``counts``, with ``k + 1`` micro-batches (the steady state's backward-then-forward included), gives
    that count's trace (the optimizer step, the same for every count, runs after the first of them)."""
    from hp_tool.trial import optim
    from hp_tool.trial.engine import group_of, tp_mesh_of
    from hp_tool.trial.models import loss_parallel_context, make_loss_fn

    par = spec.parallel
    tp_mesh = tp_mesh_of(mesh, par)
    m = spec.grad_accum_steps
    last = stage_index == par.pp - 1
    loss_fn = make_loss_fn(tp_mesh)
    pp_group = group_of(mesh, par, "pp")
    batches = [_fake_batch(spec, stage_index, dtype) for _ in range(min(m, max(counts) + 1))]
    tracker = TensorPeak()
    tracker.track(stage, optimizer, *[t for inputs, labels in batches for t in (*inputs, labels)])

    def autocast():  # the GPU's autocast, on the CPU's fake tensors
        return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()

    # the engine runs a pipeline's whole step in one autocast region (so autocast casts each weight once a
    # step and keeps the cast until the region ends), without PP one region per micro-batch's forward
    step_autocast = autocast if par.pp > 1 else contextlib.nullcontext
    forward_autocast = contextlib.nullcontext if par.pp > 1 else autocast

    def forward(inputs, labels) -> tuple:
        """(what backward starts from, what stays referenced until then): the last stage's loss right away,
        as the engine and the schedule do; the schedule also keeps each stage's output until its backward
        (the engine without PP does not)."""
        with forward_autocast():
            out = stage(*inputs)
            if not last:
                return (out if isinstance(out, tuple) else (out,)), None
            return (loss_fn(out, labels) / m,), out if par.pp > 1 else None

    # torch.distributed.pipelining keeps one receive buffer per micro-batch for the whole run: activations
    # on every stage but the first, their gradients on every stage but the last
    recv_grads: list = []
    recv_inputs = [[torch.empty_like(t) for t in batches[0][0]] for _ in range(m - len(batches))] \
        if stage_index else []

    # under PP, torch.distributed.pipelining runs an FSDP2 / replicate stage's backwards without gradient
    # reduction or resharding (unsharded parameters and gradients accumulate over the step's micro-batches)
    # and reduces and reshards once after the last (PipelineStage.perform_reduce_grad, called here as is)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.stage import PipelineStage

    deferred_reduction = par.pp > 1 and isinstance(stage, FSDPModule)

    def backward(pending: tuple) -> None:
        if deferred_reduction:
            stage.set_is_last_backward(False)
            stage.set_reshard_after_backward(False)
            stage.set_requires_gradient_sync(False)
        outs = pending[0]
        if last:
            outs[0].backward()
            return
        if not recv_grads:
            recv_grads.extend([torch.empty_like(o) for o in outs] for _ in range(m))
        torch.autograd.backward(outs, recv_grads[0])  # the gradients the next stage sends

    train_peaks, steps = [], []
    with tracker:
        for k in (1, *counts):
            first = not steps
            for inputs, _ in batches:  # the gradients a stage sends back go with the step that made them
                for t in inputs:
                    t.grad = None
            tracker.restart_peak()
            with loss_parallel_context(tp_mesh), step_autocast():
                live = []
                for inputs, labels in batches[:1] if first else batches[:k + 1]:
                    if len(live) == k:
                        backward(live.pop(0))
                    live.append(forward(inputs, labels))
                while live:
                    backward(live.pop(0))
                if deferred_reduction:
                    PipelineStage.perform_reduce_grad(SimpleNamespace(submod=stage), grad_scale_factor=1)
            if not first:
                train_peaks.append(tracker.peak_bytes())
            if len(steps) == 2:  # a later step is the same at any count in flight: once is enough
                optimizer.zero_grad(set_to_none=True)
                continue
            tracker.restart_peak()
            start = tracker.current_bytes()
            optim.clip_grad_norm(stage, spec.training.grad_clip, pp_group, frozenset(), torch.device("cpu"))
            optim.optimizer_step(optimizer)
            steps.append((start, tracker.peak_bytes()))
    del recv_inputs
    (_, first_peak), (states, later_peak) = steps
    return [StageTrace(train, first_peak, states, later_peak - states) for train in train_peaks]


def _forward_kept(spec: TrialSpec, stage, stage_index: int, mesh, dtype: Optional[torch.dtype]) -> float:
    """Bytes live after one micro-batch's forward (its output kept) less those live before it."""
    from hp_tool.trial.engine import tp_mesh_of
    from hp_tool.trial.models import loss_parallel_context, make_loss_fn

    tp_mesh = tp_mesh_of(mesh, spec.parallel)
    inputs, labels = _fake_batch(spec, stage_index, dtype)
    tracker = TensorPeak()
    tracker.track(stage, *inputs, labels)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with tracker, loss_parallel_context(tp_mesh):
        before = tracker.current_bytes()
        with autocast:
            out = stage(*inputs)
            if stage_index == spec.parallel.pp - 1:
                out = make_loss_fn(tp_mesh)(out, labels)
        kept = tracker.current_bytes() - before
        del out
    return kept


def stage_units(spec: TrialSpec) -> tuple[int, int, int]:
    """How a stage's layers grow with the model: (units per stage, layers per unit, model layers per unit).
    A unit is one layer per stack on the stage: one layer of a decoder-only model or of a T5 stage in one
    stack's half of the pipeline, an encoder and a decoder layer on T5's single stage (PP=1)."""
    shape, pp = spec.model.shape(), spec.parallel.pp
    if shape.encoder_decoder and pp == 1:
        return shape.num_layers, 2, 1
    per_stage = shape.pipeline_layers // pp
    return per_stage, 1, shape.num_layers // per_stage


def _with_units(spec: TrialSpec, units: int, checkpointed_layers: int) -> TrialSpec:
    _, _, model_layers = stage_units(spec)
    return dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, num_layers=units * model_layers),
        parallel=dataclasses.replace(spec.parallel, act_ckpt_layers=checkpointed_layers))


def _increment_donor(spec: TrialSpec, stage_index: int) -> Optional[int]:
    """The traced stage whose layers are this stage's kind, whose per-unit increments (at one micro-batch in
    flight) this stage can use, tracing only its one-unit fixed part: the first stage's for the last stage
    of a decoder-only pipeline; T5/mT5's decoder's first stage for the last. None: trace its own."""
    pp = spec.parallel.pp
    if pp < 2 or stage_index != pp - 1 or spec.parallel.virtual_stages > 1:  # interleaved: K > 1 there
        return None
    donor = pp // 2 if spec.model.decoder_seq_length else 0
    return donor if donor != stage_index else None


def _in_flight_counts(spec: TrialSpec, stage_index: int, with_one: bool = False
                      ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(the counts in flight to trace, their weights) for the stage's ``K`` in flight: 1 and 2, extrapolated,
    when K > 2 and the step has more micro-batches than K (1F1B's steady state, a backward then a forward,
    is in every count's trace; without it, as when all the step's micro-batches are in flight at once, the
    peak is not linear in K: K is traced as it is); ``with_one``: 1 traced as well (a stage lending its
    increments at one in flight)."""
    k = in_flight(spec, stage_index)
    steady = spec.grad_accum_steps > k
    if isinstance(k, float):  # interleaved: a fraction of the rank's layers, between traced counts
        return (1, 2), (2 - k, k - 1)
    if steady and (k > 2 or (with_one and k == 2)):
        return (1, 2), (2 - k, k - 1)
    if with_one and k > 1:
        return (1, k), (0, 1)
    return (k,), (1,)


def _unit_traces(spec: TrialSpec, stage_index: int, device_type: str, counts: tuple[int, ...],
                 mixed: bool) -> dict[str, list[StageTrace]]:
    """The traces extrapolation needs, each at every count in flight: "A" one unit, "B" two units (both
    checkpointed when the whole stage is), and when only some units are checkpointed "C", two units of
    which the first is."""
    units, per_unit, _ = stage_units(spec)
    ckpt = 1 if spec.parallel.act_ckpt_layers == units * per_unit else 0

    def at(n: int, checkpointed_units: int) -> list[StageTrace]:
        return _trace_stage(_with_units(spec, n, checkpointed_units * per_unit), stage_index, device_type, counts)

    traces = {"A": at(1, ckpt)}
    if mixed:
        traces["B"], traces["C"] = at(2, 0), at(2, 1)
    else:
        traces["B"] = at(2, 2 * ckpt)
    return traces


def extrapolated_stages(spec: TrialSpec, device_type: str = "cpu",
                        whole_units: int = WHOLE_UNITS) -> dict[int, StageTrace]:
    """Each of ``traced_stages`` traced with one and two units of layers (see ``stage_units``) and with one
    and two micro-batches in flight, and extrapolated, phase by phase, to its ``U`` units of which ``j``
    are checkpointed (act_ckpt_layers / layers per unit; the engine recomputes the first ones) and its
    ``K`` micro-batches in flight (``in_flight``).

    Layers, for each count in flight: A(1 unit), B(2 units), none checkpointed: per phase A + (U - 1)(B - A).
    All checkpointed: the same with A and B checkpointed. Some: C(2 units, the first checkpointed) adds a
    checkpointed unit's increment, A + (U - 1 - j)(B - A) + j(C - A). The fixed part (embedding, head,
    logits and loss, the gathered unit FSDP2 prefetches, a checkpointed layer's recompute) is in A; each
    unit's states and the activations of every micro-batch in flight grow with the increments.
    In flight, when K > 2: T(1) + (K - 1)(T(2) - T(1)); each micro-batch in flight adds its activations
    (the receive buffers, one per micro-batch of the step, are there at any count). One build traces both
    counts. The last stage (K = 1) traces only its own A and takes the increments at one in flight from
    the stage with its kind of layers (``_increment_donor``). Stages of up to ``whole_units`` units are
    traced with their own layers, as fast as extrapolating them. Interleaved layouts: the rank's layers built
    as one stage (``traced_spec``) at the schedule's count in flight, plus what interleaving holds besides
    (``with_interleave_buffers``)."""
    traced = _extrapolated_layers(spec, traced_spec(spec), device_type, whole_units)
    return {stage: with_interleave_buffers(spec, stage, device_type, t) for stage, t in traced.items()}


def _extrapolated_layers(spec: TrialSpec, traced: TrialSpec, device_type: str,
                         whole_units: int) -> dict[int, StageTrace]:
    """``extrapolated_stages`` of the stage ``traced`` builds, at ``spec``'s counts in flight."""
    units, per_unit, _ = stage_units(spec)
    stages = traced_stages(spec)
    out: dict[int, StageTrace] = {}
    if units <= max(2, whole_units):
        for stage in stages:
            counts, weights = _in_flight_counts(spec, stage)
            out[stage] = combine(list(zip(_trace_stage(traced, stage, device_type, counts), weights, strict=True)))
        return out
    j = spec.parallel.act_ckpt_layers / per_unit
    mixed = j not in (0, units)
    unit_weights = {"A": 2 - units, "B": units - 1 - (j if mixed else 0), "C": j}
    lenders = {_increment_donor(spec, stage) for stage in stages}
    lent: dict[int, dict[str, StageTrace]] = {}
    for stage in stages:  # donors come first
        donor = _increment_donor(spec, stage)
        if donor is not None:
            (a,) = _trace_stage(_with_units(traced, 1, per_unit if j == units else 0), stage, device_type, (1,))
            terms = [(a, 1.0), (lent[donor]["A"], unit_weights["A"] - 1)]
            out[stage] = combine(terms + [(t, unit_weights[key]) for key, t in lent[donor].items() if key != "A"])
            continue
        counts, weights = _in_flight_counts(spec, stage, with_one=stage in lenders)
        traces = _unit_traces(traced, stage, device_type, counts, mixed)
        if stage in lenders:
            lent[stage] = {key: ts[counts.index(1)] for key, ts in traces.items()}
        out[stage] = combine([(t, unit_weights[key] * w) for key, ts in traces.items()
                              for t, w in zip(ts, weights, strict=True)])
    return out


def traced_stages(spec: TrialSpec) -> list[int]:
    """The pipeline stages whose peaks differ in kind: the first (embedding, the most micro-batches in
    flight) and the last (head, logits and loss); for T5/mT5 also the decoder's first stage (decoder
    layers with cross-attention, the encoder's output passed along). Stages between hold less."""
    pp = spec.parallel.pp
    stages = {0, pp - 1}
    if spec.model.decoder_seq_length and pp > 1:
        stages.add(pp // 2)
    return sorted(stages)


def traced_peak_bytes(spec: TrialSpec, device_type: str = "cpu") -> float:
    """Peak tensor bytes of the busiest rank of ``spec`` before launch: the most of ``traced_stages``, each
    extrapolated from 1-2 layers (``extrapolated_stages``)."""
    return max(trace.peak_bytes for trace in extrapolated_stages(spec, device_type).values())
