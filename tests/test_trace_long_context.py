"""The pre-launch trace of the long-context savers, on a tiny Llama at 256 tokens over 2048 words
(``long_context_spec``): the chunked loss and sequence parallelism traced as the real CPU run measures them
per rank (test_memtrace's tolerance), the chunked loss's saving the logits the analytic model says the full
loss holds, and activation offload, which a CPU run cannot show (its host is its device), traced for a GPU:
the layers' saved activations leave the device, the states stay as they are."""

from __future__ import annotations

import dataclasses

import pytest

from hp_tool.estimate.layout import Hardware
from hp_tool.estimate.memory import logits_bytes
from hp_tool.memory_check import trace_key
from hp_tool.trial.trace.extrapolate import stage_units, with_units
from hp_tool.trial.trace.limits import untraceable_reason
from trace_cache import states_and_kept_bytes, trace_one, trace_stage
from test_memtrace import REL_TOL, measured_peak
from trial_helpers import long_context_spec

CHUNK = 64  # tokens per chunk of the chunked loss: an eighth of a micro-batch's 512


def _ids(v: dict) -> str:
    return "-".join(f"{k}{x}" for k, x in v.items())


def _cells(*cells: dict, matrix: tuple[int, ...] = ()) -> list:
    """``cells`` as parameters, the indices in ``matrix`` marked for the matrix tier; ids as before."""
    return [pytest.param(c, id=_ids(c) or "single", marks=pytest.mark.matrix if i in matrix else ())
            for i, c in enumerate(cells)]


@pytest.mark.e2e
@pytest.mark.parametrize("savers", _cells(
    dict(loss="chunked", loss_chunk_tokens=CHUNK),
    dict(tp=2, sequence_parallel=True),
    dict(tp=2, sequence_parallel=True, activation_offload=True),  # on CPU offload moves nothing
    # the covering set: the chunked loss, and SP with offload on (a superset of SP alone, which on a CPU rank it
    # equals: test_a_cpu_rank_keeps_its_saved_activations); SP alone is the matrix tier's
    matrix=(1,)))
def test_traced_peak_matches_the_real_runs_peak_per_rank(tmp_path_factory, savers):
    """The real run is ``trial_helpers.launched`` (one launch per spec and session, as tests/test_memtrace.py's)."""
    spec = long_context_spec(max_steps=3, warmup_steps=2, **savers)  # two untimed steps are measured
    measured = measured_peak(tmp_path_factory, spec)
    assert measured > 0
    assert trace_stage(spec).peak_gib == pytest.approx(measured, rel=REL_TOL)


@pytest.mark.e2e
def test_the_chunked_loss_saves_the_logits_the_full_loss_holds():
    """Traced on CPU (fp32), the chunked loss's peak is below the full loss's by what the analytic model
    says the full loss holds beyond the chunked one (``logits_bytes``: the logits, their log-softmax and
    their gradient, against one chunk's logits and the gradients computed in forward): 0.012% apart (the trace
    is deterministic), twice that allowed."""
    peaks, held = {}, {}
    hw = Hardware(gpus_per_node=1, gpu_memory_gib=80, peak_tflops=1, intra_node_bandwidth_gbps=1,
                  inter_node_bandwidth_gbps=1, memory_overhead_gib=0)
    for loss in ("full", "chunked"):
        spec = long_context_spec(loss=loss, loss_chunk_tokens=CHUNK)
        peaks[loss] = trace_stage(spec).peak_bytes
        held[loss] = logits_bytes(spec.model.shape(), spec.layout().replace(precision="fp32"), hw)
    assert peaks["full"] - peaks["chunked"] == pytest.approx(held["full"] - held["chunked"], rel=2.5e-4)


def _per_unit(spec, measure) -> float:
    """What one more unit of layers adds to ``measure(spec with n units)``: measured at one unit and at two."""
    one, two = (measure(with_units(spec, n, 0)) for n in (1, 2))
    return two - one


def _kept(spec) -> float:
    """The bytes one micro-batch's forward leaves on a GPU rank for its backward (``states_and_kept_bytes``)."""
    return states_and_kept_bytes(spec, 0, "cuda")[1]


@pytest.mark.e2e
@pytest.mark.parametrize("layout", _cells(
    dict(),
    dict(loss="chunked", loss_chunk_tokens=CHUNK),
    dict(tp=2, sequence_parallel=True),  # DTensors saved: offloaded by their local shards
    dict(dp=2, zero_stage=3),
    # the covering set: offload under TP with SP (DTensors saved, the path of its own; 12 s). One rank, the chunked
    # loss (offload does not touch the loss) and FSDP2 are the matrix tier's (offload over FSDP2 is traced in the
    # default run against the memory model: tests/test_long_context_memory.py's activation_offload cell)
    matrix=(0, 1, 3)))
def test_offloaded_activations_leave_the_gpu(layout):
    """Traced for a GPU (bf16), with activation offload forward leaves nothing of the layers on the device,
    so the peak grows with the layers by their states and little else (where backward peaks, one layer's
    saved activations are back at a time) and is below the peak without offload by at least all layers'
    saved activations but one's; the states and the optimizer steps are unchanged."""
    kept, offloaded = long_context_spec(**layout), long_context_spec(activation_offload=True, **layout)
    on_gpu, off_gpu = trace_stage(kept, 0, "cuda"), trace_stage(offloaded, 0, "cuda")
    layer = _per_unit(kept, _kept)  # one layer's saved activations
    assert layer > 0 and _per_unit(offloaded, _kept) == 0
    assert on_gpu.peak_bytes - off_gpu.peak_bytes >= (stage_units(kept)[0] - 1) * layer
    grows = _per_unit(offloaded, lambda s: trace_stage(s, 0, "cuda").peak_bytes) - \
        _per_unit(offloaded, lambda s: trace_stage(s, 0, "cuda").state_bytes)
    assert grows < layer / 4  # without offload a layer adds all its saved activations
    assert dataclasses.replace(off_gpu, train_bytes=0) == dataclasses.replace(on_gpu, train_bytes=0)


@pytest.mark.e2e
def test_a_cpu_rank_keeps_its_saved_activations():
    """On a CPU rank the host is the device: offload changes no traced byte (and the real CPU run's peak is
    the trace's, above)."""
    assert trace_stage(long_context_spec(activation_offload=True)) == trace_stage(long_context_spec())


@pytest.mark.e2e
@pytest.mark.parametrize("savers", _cells(
    dict(loss="chunked", loss_chunk_tokens=CHUNK),
    dict(tp=2, sequence_parallel=True),
    dict(activation_offload=True),
    dict(tp=2, dp=2, sequence_parallel=True, activation_offload=True, act_ckpt=4),
    # the covering set: each saver alone (each its own cache key); all of them together over TP x DP with
    # checkpointing is the matrix tier's
    matrix=(3,)))
def test_memory_check_traces_the_savers(savers):
    """``memory_check`` traces specs with the savers (none is refused, each has its own cache key), and an
    8-layer stage extrapolated from shallow builds is its whole trace within 1%."""
    spec = long_context_spec(**savers)
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, num_layers=8))
    plain = dataclasses.replace(spec, parallel=dataclasses.replace(
        spec.parallel, loss="full", sequence_parallel=False, activation_offload=False))
    assert untraceable_reason(spec) is None
    assert trace_key(spec, "cuda", "torch") != trace_key(plain, "cuda", "torch")
    outcome = trace_one(spec, "cuda")
    assert outcome.reason == ""
    assert outcome.tensor_gib * 2**30 == pytest.approx(trace_stage(spec, 0, "cuda").peak_bytes, rel=0.01)
