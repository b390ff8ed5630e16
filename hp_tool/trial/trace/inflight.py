"""A traced rank's record (``StageTrace``, phase by phase) and what the schedule keeps in flight: how many
micro-batches' activations (``in_flight``, the analytic model's count), which counts to trace for it, and
how an interleaved rank is traced (its layers as one stage, ``traced_spec``, plus the hidden states
interleaving holds besides, ``with_interleave_buffers``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hp_tool.contracts.spec import TrialSpec
from hp_tool.estimate.layout import GIB, interleave_held_tensors, microbatches_in_flight
from hp_tool.trial.rank import compute_dtype


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
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


def combine(terms: list[tuple[StageTrace, float]]) -> StageTrace:
    """Phase by phase, the sum of ``weight * trace``; the step's temporaries, the most of any."""
    return StageTrace(sum(w * t.train_bytes for t, w in terms), sum(w * t.first_step_bytes for t, w in terms),
                      sum(w * t.state_bytes for t, w in terms), max(t.step_transient_bytes for t, _ in terms))


def in_flight(spec: TrialSpec, stage_index: int) -> float:
    """Micro-batches whose activations the schedule keeps at once on a rank of stage ``stage_index``, in
    units of one micro-batch through all the rank's layers (``estimate.layout.microbatches_in_flight``, the
    analytic model's count): 1F1B's PP - stage, at most the step's micro-batches; one without PP; a
    fraction under interleaved 1F1B."""
    k = microbatches_in_flight(spec.layout(), stage_index)
    return int(k) if k.is_integer() else k


def in_flight_counts(spec: TrialSpec, stage_index: int, with_one: bool = False
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


def traced_spec(spec: TrialSpec) -> TrialSpec:
    """The spec whose stage the tracer builds: under interleaved 1F1B, the rank's v chunks traced as one
    stage of all its layers (same parameters, states and per-layer activations; the schedule's count in
    flight, ``in_flight``, comes from the spec itself); a compiled layout's layers eager (the trace follows
    the eager ops: a compiled layer keeps less, inductor fusing its norms and recomputing what it can, which the
    planner takes off the traced figure, ``estimate.memory.eager_trace_excess_gib``)."""
    if spec.parallel.virtual_stages == 1 and not spec.parallel.compile:
        return spec
    return dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, virtual_stages=1, compile=False))


def with_interleave_buffers(spec: TrialSpec, stage_index: int, device_type: str, trace: StageTrace) -> StageTrace:
    """``trace`` of the rank's layers as one stage (``traced_spec``) plus the hidden-state tensors
    interleaved 1F1B holds besides (``estimate.layout.interleave_held_tensors``, the analytic model's
    count): the receive buffers in every phase, the held sends at the step's peak (the in-flight
    activations the trace holds there are partly freed by the step's end, so this errs high by a few of
    them). Unchanged without interleaving."""
    recv, sends = interleave_held_tensors(spec.layout(), stage_index)
    if recv + sends == 0:
        return trace
    dtype = compute_dtype(spec, torch.device(device_type)) or torch.float32
    hidden = spec.parallel.mbs * spec.model.seq_length * spec.model.hidden_size * dtype.itemsize
    return StageTrace(trace.train_bytes + (recv + sends) * hidden, trace.first_step_bytes + recv * hidden,
                      trace.state_bytes + recv * hidden, trace.step_transient_bytes)
