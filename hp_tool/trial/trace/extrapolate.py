"""Extrapolation: a stage's traced peak from shallow builds, and the busiest rank's peak before launch.

Deep stages are extrapolated from 3 and 4 units of layers and 1 and 2 micro-batches in flight, phase by
phase (``extrapolated_stages``); the stages whose peaks differ in kind are traced (``traced_stages``: the
first, the last, and each stack's first); ``traced_peak_bytes`` is the busiest rank's peak. Interleaved
layouts are traced as the rank's layers in one stage at the schedule's fractional count in flight plus the
held hidden states (:mod:`hp_tool.trial.trace.inflight`; errs high by up to 10% on CPU).

Fidelity on CPU (tests/test_memtrace.py, benchmarks/memory_trace.py): equal to the real run's measured
peak per rank for one process, DDP and FSDP2 with and without checkpointing (the real run's foreach AdamW
peaks below its backward there), PP and TP (within 1%: DTensor's global-shape propagation, which under
fake tensors runs in the trace's own fake mode, is not counted; see ``TensorPeak``), the chunked loss and
sequence parallelism (within 0.1%, tests/test_trace_long_context.py; activation offload, which on a CPU
moves nothing, is checked against the layers' saved activations traced for a GPU); the extrapolation
within 1% of the whole stage's trace (tests/test_memory_check.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from hp_tool.contracts.spec import TrialSpec
from hp_tool.trial.families import torch_family
from hp_tool.trial.trace.inflight import StageTrace, combine, in_flight_counts, traced_spec, with_interleave_buffers
from hp_tool.trial.trace.replay import traced_counts

WHOLE_UNITS = 4  # a stage of this many units (see stage_units) or fewer is traced whole, not extrapolated


def stage_units(spec: TrialSpec) -> tuple[int, int, int]:
    """How a stage's layers grow with the model: (units per stage, layers per unit, model layers per unit).
    A unit is one layer per stack on the stage: one layer of a decoder-only model or of a T5 stage in one
    stack's half of the pipeline, an encoder and a decoder layer on T5's single stage (PP=1)."""
    shape, pp = spec.model.shape(), spec.parallel.pp
    if pp == 1:
        return shape.num_layers, torch_family(shape.family).stacks, 1
    per_stage = shape.pipeline_layers // pp
    return per_stage, 1, shape.num_layers // per_stage


def with_units(spec: TrialSpec, units: int, checkpointed_layers: int) -> TrialSpec:
    """``spec`` with ``units`` units of layers per stage (see ``stage_units``), ``checkpointed_layers`` of
    them recomputed (in the spec's mode): the shallow stages extrapolation traces."""
    _, _, model_layers = stage_units(spec)
    return dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, num_layers=units * model_layers),
        parallel=spec.parallel.checkpointing(checkpointed_layers))


def _increment_donor(spec: TrialSpec, stage_index: int) -> Optional[int]:
    """The traced stage whose layers are this stage's kind, whose per-unit increments (at one micro-batch in
    flight) this stage can use, tracing only its own fixed part (BASE_UNITS units): the first stage's for the last stage
    of a decoder-only pipeline; T5/mT5's decoder's first stage for the last. None: trace its own."""
    pp = spec.parallel.pp
    if pp < 2 or stage_index != pp - 1 or spec.parallel.virtual_stages > 1:  # interleaved: K > 1 there
        return None
    donor = max(torch_family(spec.model.family).stack_starts(pp))  # the first stage of the last stack
    return donor if donor != stage_index else None


BASE_UNITS = 3  # extrapolation starts from this many units and adds one: the increment is a middle unit's


def _unit_traces(spec: TrialSpec, stage_index: int, device_type: str, counts: tuple[int, ...],
                 mixed: bool) -> dict[str, list[StageTrace]]:
    """The traces extrapolation needs, each at every count in flight: "A" ``BASE_UNITS`` units, "B" one unit
    more (all checkpointed when the whole stage is), and when only some units are checkpointed "C", as many
    as B of which the first is."""
    units, per_unit, _ = stage_units(spec)
    ckpt = 1 if spec.parallel.act_ckpt_layers == units * per_unit else 0

    def at(n: int, checkpointed_units: int) -> list[StageTrace]:
        return traced_counts(with_units(spec, n, checkpointed_units * per_unit), stage_index, device_type, counts)

    traces = {"A": at(BASE_UNITS, BASE_UNITS * ckpt)}
    if mixed:
        traces["B"], traces["C"] = at(BASE_UNITS + 1, 0), at(BASE_UNITS + 1, 1)
    else:
        traces["B"] = at(BASE_UNITS + 1, (BASE_UNITS + 1) * ckpt)
    return traces


def extrapolated_stages(spec: TrialSpec, device_type: str = "cpu",
                        whole_units: int = WHOLE_UNITS) -> dict[int, StageTrace]:
    """Each of ``traced_stages`` traced with three and four units of layers (see ``stage_units``) and with one
    and two micro-batches in flight, and extrapolated, phase by phase, to its ``U`` units of which ``j``
    are checkpointed (act_ckpt_layers / layers per unit; the engine recomputes the first ones) and its
    ``K`` micro-batches in flight (``in_flight``).

    Layers, for each count in flight: A(3 units), B(4 units), none checkpointed: per phase A + (U - 3)(B - A).
    All checkpointed: the same with A and B checkpointed. Some: C(4 units, the first checkpointed) adds a
    checkpointed unit's increment, A + (U - 3 - j)(B - A) + j(C - A). The fixed part (embedding, head,
    logits and loss, the gathered unit FSDP2 prefetches, a checkpointed layer's recompute) is in A; each
    unit's states and the activations of every micro-batch in flight grow with the increments. Not from
    fewer units: the increments of the first units are not a middle unit's (FSDP2 prefetches a next unit only
    when there is one; the first layer's input needs no gradient): under FSDP2 in bf16, the 1-to-2 and
    2-to-3 increments are 20% and 11% above every later one, and extrapolating from 1 and 2 units was 12-28%
    high (tests/test_memory_check.py).
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
    if units <= max(BASE_UNITS + 1, whole_units):
        for stage in stages:
            counts, weights = in_flight_counts(spec, stage)
            out[stage] = combine(list(zip(traced_counts(traced, stage, device_type, counts), weights, strict=True)))
        return out
    j = spec.parallel.act_ckpt_layers / per_unit
    mixed = j not in (0, units)
    # A + (U - BASE - j)(B - A) + j(C - A), as weights of A, B and C
    unit_weights = {"A": BASE_UNITS + 1 - units, "B": units - BASE_UNITS - (j if mixed else 0), "C": j}
    lenders = {_increment_donor(spec, stage) for stage in stages}
    lent: dict[int, dict[str, StageTrace]] = {}
    for stage in stages:  # donors come first
        donor = _increment_donor(spec, stage)
        if donor is not None:
            (a,) = traced_counts(with_units(traced, BASE_UNITS, BASE_UNITS * per_unit if j == units else 0), stage,
                                 device_type, (1,))
            terms = [(a, 1.0), (lent[donor]["A"], unit_weights["A"] - 1)]
            out[stage] = combine(terms + [(t, unit_weights[key]) for key, t in lent[donor].items() if key != "A"])
            continue
        counts, weights = in_flight_counts(spec, stage, with_one=stage in lenders)
        traces = _unit_traces(traced, stage, device_type, counts, mixed)
        if stage in lenders:
            lent[stage] = {key: ts[counts.index(1)] for key, ts in traces.items()}
        out[stage] = combine([(t, unit_weights[key] * w) for key, ts in traces.items()
                              for t, w in zip(ts, weights, strict=True)])
    return out


def traced_stages(spec: TrialSpec) -> list[int]:
    """The pipeline stages whose peaks differ in kind: the first (embedding, the most micro-batches in
    flight), the last (head, logits and loss) and each stack's first (``TorchFamily.stack_starts``; T5/mT5:
    the decoder's first stage, decoder layers with cross-attention, the encoder's output passed along).
    Stages between hold less."""
    pp = spec.parallel.pp
    return sorted({*torch_family(spec.model.family).stack_starts(pp), pp - 1})


def traced_peak_bytes(spec: TrialSpec, device_type: str = "cpu") -> float:
    """Peak tensor bytes of the busiest rank of ``spec`` before launch: the most of ``traced_stages``, each
    extrapolated from shallow builds (``extrapolated_stages``)."""
    return max(trace.peak_bytes for trace in extrapolated_stages(spec, device_type).values())
