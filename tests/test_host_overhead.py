"""An eager step's host dispatch (hp_tool/estimate/host.py): the operator counts the planner prices are the trial
engine's own (counted on its modules, every family), and where the kernels are small the host, not the GPU,
sets the step time, so a larger micro-batch of short sequences is nearly free; long sequences do not feel it."""

import pytest

from bench_helpers import benchmark
from hp_tool.estimate.host import ADAPTER_OPS, HOST_SECONDS_PER_OP, host_s, layer_pass_ops
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.speed import compute_s, estimate_step_time
from hp_tool.families.registry import family, family_names
from hp_tool.families.shape import Shape
from hp_tool.recipe import Adapters

L7B = Shape("llama", 32, 4096, 32, 32, 11008, 32000, 256)
A100 = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
                inter_node_bandwidth_gbps=25, memory_overhead_gib=3, max_efficiency=0.71, tokens_half=128,
                attention_efficiency=0.3)
COUNTER = benchmark("host_overhead")  # counts the engine's operators
OPS_TOLERANCE = COUNTER.OPS_TOLERANCE
LORA = Adapters(rank=16, alpha=32.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


def lay(**kw) -> Layout:
    base = dict(tp=1, pp=1, dp=1, mbs=1, act_ckpt_layers=32, global_batch_size=8, method="lora", lora=LORA)
    return Layout.of(**{**base, **kw})


@pytest.mark.parametrize("name", family_names())
def test_each_familys_operator_count_is_what_the_engines_layer_dispatches(name):
    counted = COUNTER.layer_ops(name)
    record = family(name).layer_ops
    for what, c, r in zip(("forward", "backward", "recompute"), counted, record):
        assert abs(r - c) <= OPS_TOLERANCE * c, f"{name} {what}: the record says {r}, the engine's layer runs {c:.0f}"


def test_an_adapted_linear_adds_the_operators_peft_runs():
    for record, counted in zip(ADAPTER_OPS, COUNTER.adapter_ops()):
        assert record == pytest.approx(counted, rel=OPS_TOLERANCE)


def test_the_host_dispatches_every_layer_pass_of_every_micro_batch():
    shape = L7B
    forward, backward, recompute = layer_pass_ops(shape, lay())
    assert (forward, backward, recompute) == (73 + 4 * 10, 138 + 4 * 14, 130 + 4 * 13)
    # 8 micro-batches, 32 layers, each forward + backward and, checkpointed, its recompute
    assert host_s(shape, lay(), A100) == pytest.approx(8 * 32 * (forward + backward + recompute) *
                                                       HOST_SECONDS_PER_OP)
    # half the layers checkpointed: half the recomputes; full training: no adapters' operators
    half = lay(act_ckpt_layers=16, method="full", lora=None)
    assert host_s(shape, half, A100) == pytest.approx(8 * (32 * (73 + 138) + 16 * 130) * HOST_SECONDS_PER_OP)
    # two pipeline stages: each GPU launches its 16 layers
    assert host_s(shape, lay(pp=2, act_ckpt_layers=16), A100) == pytest.approx(host_s(shape, lay(), A100) / 2)


def test_short_sequences_are_host_bound_and_a_larger_micro_batch_is_nearly_free():
    """7B LoRA at 256 tokens a micro-batch on one A100: the GPU's work is a fraction of the dispatch, so the step
    is the host's, and the same 8 sequences in one micro-batch instead of 8 take under half the time (without
    the floor, 72% of it: only the GEMMs' efficiency would differ). At 4096 tokens the GPU's work outlasts the
    dispatch and the host adds nothing."""
    short = estimate_step_time(L7B, lay(), A100, 1)
    assert compute_s(L7B, lay(), A100) < 0.7 * host_s(L7B, lay(), A100)
    assert short.host_s > 0
    assert short.compute_s + short.host_s == pytest.approx(host_s(L7B, lay(), A100))
    wide = estimate_step_time(L7B, lay(mbs=8), A100, 1)  # the same 8 sequences in one micro-batch
    assert wide.host_s == 0.0
    assert wide.total_s < short.total_s / 2
    long = Shape("llama", 32, 4096, 32, 32, 11008, 32000, 4096)
    assert estimate_step_time(long, lay(), A100, 1).host_s == 0.0


def test_compiled_layers_and_cpu_processes_have_no_floor():
    assert host_s(L7B, lay(compile=True), A100) == 0.0
    cpu = Hardware(gpus_per_node=2, gpu_memory_gib=8, peak_tflops=0.1, intra_node_bandwidth_gbps=5,
                   inter_node_bandwidth_gbps=1, memory_overhead_gib=0.5, device_is_host=True)
    assert host_s(L7B, lay(), cpu) == 0.0
