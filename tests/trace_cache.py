"""One trace cache for the trace tests: each fake-tensor trace of a spec (``hp_tool.trial.trace``) is computed
once per test session and shared by every test and file that asks for it. No tests here.

The functions are the product's, under the same names and arguments (import them from here instead of
``hp_tool.trial.trace.*``, ``hp_tool.trial.memterms`` or ``hp_tool.memory_check``), memoised in this process by
``spec.fingerprint()`` plus the call's other arguments (stage index, device, ``whole_units``), defaults filled in,
so ``trace_stage(spec)`` and ``trace_stage(spec, 0, "cpu")`` are one entry.

Why the fingerprint is a sound key: it hashes the model, parallel and training sections, the run section (not its
output folder) and the process count (``TrialSpec.fingerprint``). The trace reads nothing else: not the trial id,
the full run, the planner's estimates or the resources' speeds and prices (the device it models is the
``device_type`` argument, not ``resources.gpu``). The stage index and device are not in the fingerprint, so they
are in the key. It hashes more than the trace reads (the run section: steps, stop rule), which only costs a
shared entry, never a wrong one. Within a session torch, transformers and hp_tool do not change.

Only pure, frozen results are cached: ``StageTrace``, ``UnitTerms`` and ``TraceOutcome`` are frozen
dataclasses, numbers and tuples are immutable, and ``extrapolated_stages`` comes back as a read-only mapping
(``types.MappingProxyType``) of frozen traces, so no test can change what another reads.

The product keeps a cache of its own below this one (``hp_tool.trial.trace.replay._TRACES``: one build per
spec, stage, device and counts in flight, which the extrapolation's shallow builds share); this one adds what the
product recomputes on every call: the whole stage's trace as combined, the extrapolations, the memory check's
outcome, and ``states_and_kept_bytes`` (a fresh build each time) with the per-unit terms built on it.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping

from hp_tool.contracts.spec import TrialSpec

_CACHE: dict[tuple, Any] = {}


def _once(what: str, compute: Callable[[], Any], spec: TrialSpec, *args) -> Any:
    key = (what, spec.fingerprint(), *args)
    if key not in _CACHE:
        _CACHE[key] = compute()
    return _CACHE[key]


def trace_stage(spec: TrialSpec, stage_index: int = 0, device_type: str = "cpu"):
    """``hp_tool.trial.trace.replay.trace_stage``: one rank of stage ``stage_index`` traced whole (frozen)."""
    from hp_tool.trial.trace import replay

    return _once("trace_stage", lambda: replay.trace_stage(spec, stage_index, device_type),
                 spec, stage_index, device_type)


def extrapolated_stages(spec: TrialSpec, device_type: str = "cpu", whole_units: int | None = None
                        ) -> Mapping[int, Any]:
    """``hp_tool.trial.trace.extrapolate.extrapolated_stages``, as a read-only mapping of frozen traces."""
    from hp_tool.trial.trace import extrapolate

    units = extrapolate.WHOLE_UNITS if whole_units is None else whole_units
    return _once("extrapolated_stages", lambda: types.MappingProxyType(
        dict(extrapolate.extrapolated_stages(spec, device_type, units))), spec, device_type, units)


def traced_peak_bytes(spec: TrialSpec, device_type: str = "cpu") -> float:
    """``hp_tool.trial.trace.extrapolate.traced_peak_bytes``: the busiest rank's extrapolated peak, bytes."""
    from hp_tool.trial.trace import extrapolate

    return _once("traced_peak_bytes", lambda: extrapolate.traced_peak_bytes(spec, device_type), spec, device_type)


def traced_and_predicted(spec: TrialSpec, device_type: str = "cpu") -> tuple[float, float]:
    """(traced peak, the memory model's peak) of ``spec``'s first stage on ``device_type``, in bytes."""
    from hp_tool.estimate.memory import estimate_memory
    from hp_tool.trial.memterms import target_hardware, target_layout

    predicted = estimate_memory(spec.model.shape(), target_layout(spec, device_type),
                                target_hardware(device_type)).total_gib
    return trace_stage(spec, 0, device_type).peak_bytes, predicted * 2**30


def states_and_kept_bytes(spec: TrialSpec, stage_index: int = 0, device_type: str = "cpu") -> tuple[float, float]:
    """``hp_tool.trial.trace.replay.states_and_kept_bytes``: (states, kept by one micro-batch's forward), bytes."""
    from hp_tool.trial.trace import replay

    return _once("states_and_kept_bytes", lambda: tuple(replay.states_and_kept_bytes(spec, stage_index, device_type)),
                 spec, stage_index, device_type)


def unit_terms(spec: TrialSpec, device_type: str = "cpu"):
    """``hp_tool.trial.memterms.unit_terms`` (frozen ``UnitTerms``), its two builds from this cache."""
    from hp_tool.trial import memterms

    def compute():  # the product's own function, its builds (one and two units) through this cache
        real = memterms.states_and_kept_bytes
        memterms.states_and_kept_bytes = states_and_kept_bytes
        try:
            return memterms.unit_terms(spec, device_type)
        finally:
            memterms.states_and_kept_bytes = real

    return _once("unit_terms", compute, spec, device_type)


def trace_one(spec: TrialSpec, device_type: str):
    """``hp_tool.memory_check.trace_one``, run in this process (frozen ``TraceOutcome``)."""
    from hp_tool import memory_check

    return _once("trace_one", lambda: memory_check.trace_one(spec, device_type), spec, device_type)

