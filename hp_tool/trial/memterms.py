"""The analytic memory model's per-layer terms beside the traced engine's: where the formula and the
engine disagree.

A "unit" is what a stage gains per layer of the model (``trace.extrapolate.stage_units``: one layer; on T5's single
stage an encoder and a decoder layer). For a layout, one stage is traced with one and with two units
(``trace.replay.states_and_kept_bytes``); the differences are the traced per-unit terms:

- ``state``: parameters, gradients and optimizer states (``estimate.memory.model_state_bytes``);
- ``kept``: what one micro-batch's forward keeps until its backward, the activations plus the weights'
  compute copy (``stage_activation_bytes`` + ``compute_copy_bytes``).

The analytic terms are the same differences of the analytic model at one and two units, so every rule of
``hp_tool.estimate.memory`` is exercised as the planner calls it. Used by tests/test_memory_check.py and
benchmarks/memory_terms.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hp_tool.architectures import layer_parameters
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.memory import (stage_activation_bytes, stage_compute_copy_bytes, stage_parameters,
                                     stage_state_bytes)
from hp_tool.contracts.spec import TrialSpec
from hp_tool.trial.trace.extrapolate import stage_units, with_units
from hp_tool.trial.trace.replay import states_and_kept_bytes


@dataclass(frozen=True)
class UnitTerms:
    """Per-unit bytes, traced and analytic."""

    state: float
    kept: float
    analytic_state: float
    analytic_kept: float

    @property
    def state_ratio(self) -> float:
        return self.state / self.analytic_state

    @property
    def kept_ratio(self) -> float:
        return self.kept / self.analytic_kept


def target_hardware(device_type: str) -> Hardware:
    """The analytic model's view of the trial's device (whether it is the host); sizes and speeds do not enter
    the terms."""
    return Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=1, intra_node_bandwidth_gbps=1,
                    inter_node_bandwidth_gbps=1, memory_overhead_gib=0.0, device_is_host=device_type == "cpu")


def target_layout(spec: TrialSpec, device_type: str) -> Layout:
    """The trial's layout as its device runs it: in its precision on a GPU, in fp32 on a CPU (as the engine
    computes there)."""
    layout = spec.layout()
    return layout if device_type == "cuda" else layout.replace(precision="fp32")


def analytic_terms(spec: TrialSpec, device_type: str, stage: int = 0) -> tuple[float, float]:
    """(states, kept by one micro-batch) of ``stage`` by the analytic model, bytes."""
    shape, layout, hw = spec.model.shape(), target_layout(spec, device_type), target_hardware(device_type)
    params = stage_parameters(shape, layout.tp, layout.pp)[stage]
    gathered = max(layer_parameters(shape), layer_parameters(shape, encoder=True)) / layout.tp
    copies = stage_compute_copy_bytes(shape, layout, hw, params, stage, gathered)  # counted with what the step keeps
    states = stage_state_bytes(shape, layout, hw, params, stage, gathered) - copies
    kept = stage_activation_bytes(shape, layout, hw, stage)[0] + copies
    return states, kept


def unit_terms(spec: TrialSpec, device_type: str = "cpu") -> UnitTerms:
    """Traced and analytic per-unit terms of stage 0 of ``spec`` (its layers all checkpointed or none)."""
    units, per_unit, _ = stage_units(spec)
    ckpt = 1 if spec.parallel.act_ckpt_layers else 0
    specs = [with_units(spec, n, ckpt * n * per_unit) for n in (1, 2)]
    (s1, k1), (s2, k2) = (states_and_kept_bytes(s, 0, device_type) for s in specs)
    (as1, ak1), (as2, ak2) = (analytic_terms(s, device_type) for s in specs)
    return UnitTerms(s2 - s1, k2 - k1, as2 - as1, ak2 - ak1)


def with_layout(spec: TrialSpec, **parallel) -> TrialSpec:
    """``spec`` with other parallel settings, its batch and GPU count following the data-parallel size."""
    par = dataclasses.replace(spec.parallel, **parallel)
    return dataclasses.replace(
        spec, parallel=par,
        training=dataclasses.replace(spec.training, global_batch_size=par.mbs * par.dp),
        resources=dataclasses.replace(spec.resources, gpus_per_node=par.tp * par.pp * par.cp * par.dp))
