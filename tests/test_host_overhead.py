"""An eager step's host dispatch (hp_tool/estimate/host.py): the operator counts the planner prices are the trial
engine's own (counted on its modules, every family), and where the kernels are small the host, not the GPU,
sets the step time, so a larger micro-batch of short sequences is nearly free; long sequences do not feel it."""

import pytest

from bench_helpers import benchmark
from hp_tool.engine_facts import engine_facts
from hp_tool.estimate.host import ADAPTER_OPS, HOST_SECONDS_PER_OP, hook_s, host_s, layer_hooked, layer_pass_ops
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


@pytest.mark.e2e
@pytest.mark.parametrize("name", family_names())
def test_each_familys_operator_count_is_what_the_engines_layer_dispatches(name):
    counted = COUNTER.layer_ops(name)
    record = family(name).time.layer_ops
    for what, c, r in zip(("forward", "backward", "recompute"), counted, record):
        assert abs(r - c) <= OPS_TOLERANCE * c, f"{name} {what}: the record says {r}, the engine's layer runs {c:.0f}"


@pytest.mark.e2e
def test_an_adapted_linear_adds_the_operators_peft_runs():
    for record, counted in zip(ADAPTER_OPS, COUNTER.adapter_ops()):
        assert record == pytest.approx(counted, rel=OPS_TOLERANCE)


def test_the_host_dispatches_every_layer_pass_of_every_micro_batch():
    shape = L7B
    forward, backward, recompute = layer_pass_ops(shape, lay())
    assert (forward, backward, recompute) == (73 + 4 * 9, 138 + 4 * 16, 130 + 4 * 12)
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
    assert short.compute_s + short.elementwise_s + short.host_s == pytest.approx(host_s(L7B, lay(), A100))
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


@pytest.mark.e2e
@pytest.mark.parametrize("name", family_names())
def test_each_familys_modules_and_tensors_are_the_engines_layers(name):
    """The modules and tensors DeepSpeed's hooks run over: the family's record against the engine's stage (q, k, v
    biases counted where the model has them: Qwen2's 12 tensors in 9 modules; LoRA's two per adapted linear)."""
    model = COUNTER.tiny_model(name, 2)
    recorded = layer_hooked(model.shape(), COUNTER._hook_layout(model, 2, False))
    for what, c, r in zip(("modules", "tensors"), COUNTER.layer_tensors(name), recorded):
        assert abs(c - r) <= COUNTER.TENSORS_TOLERANCE, f"{name} {what}: the record says {r}, the engine's layer has {c}"


@pytest.mark.e2e
def test_adapters_add_two_hooked_modules_and_are_all_that_is_trained():
    lora = COUNTER.tiny_model("qwen2", 2, "lora")  # every linear adapted; the frozen base's biases not trained
    modules, trained = layer_hooked(lora.shape(), COUNTER._hook_layout(lora, 2, False))
    assert (modules, trained) == COUNTER.layer_tensors("qwen2", "lora") == (9 + 2 * 7, 2 * 7)


def ds(**kw) -> Layout:
    return lay(engine="deepspeed", dp=4, global_batch_size=32, **kw)


@pytest.mark.e2e
def test_deepspeed_hooks_every_trained_tensor_at_zero_2_and_every_module_pass_at_zero_3():
    """7B LoRA on q, k, v and o (per layer 9 + 8 modules, 8 trained tensors), 32 layers, 8 micro-batches."""
    per_tensor, per_module = engine_facts("deepspeed").hook_seconds(3)
    assert per_tensor > 0 and per_module > 0
    assert engine_facts("deepspeed").hook_seconds(2) == (per_tensor, 0.0)
    assert layer_hooked(L7B, ds(zero_stage=3)) == (17, 8)
    # forward and backward of every layer, the recompute of the 16 checkpointed ones
    assert hook_s(L7B, ds(zero_stage=3, act_ckpt_layers=16)) == pytest.approx(
        8 * (32 * 8 * per_tensor + (2 * 32 + 16) * 17 * per_module))
    assert hook_s(L7B, ds(zero_stage=2)) == pytest.approx(8 * 32 * 8 * per_tensor)
    # full training: Llama's 9 tensors a layer, all trained
    assert hook_s(L7B, ds(zero_stage=2, method="full", lora=None)) == pytest.approx(8 * 32 * 9 * per_tensor)
    # ZeRO-0 and 1 reduce at the boundary; the torch engine's hooks run per bucket and per layer
    assert hook_s(L7B, ds(zero_stage=1)) == 0.0
    assert hook_s(L7B, lay(dp=4, global_batch_size=32, zero_stage=3)) == 0.0
    assert host_s(L7B, ds(zero_stage=3), A100) == pytest.approx(host_s(L7B, lay(dp=4, global_batch_size=32,
                                                                                 zero_stage=3), A100)
                                                                + hook_s(L7B, ds(zero_stage=3)))


def test_deepspeed_zero_3_is_slower_than_fsdp2_at_short_sequences_only():
    """The same 7B LoRA ZeRO-3 layout on the two engines: at 256 tokens a micro-batch DeepSpeed's module hooks
    make the host's work the step, well beyond FSDP2's; at 8192 tokens the GPU's work hides them."""
    def step(engine: str, seq: int) -> float:
        shape = Shape("llama", 32, 4096, 32, 32, 11008, 32000, seq)
        return estimate_step_time(shape, lay(engine=engine, dp=4, global_batch_size=32, zero_stage=3), A100,
                                  1).total_s

    assert step("deepspeed", 256) > 1.3 * step("torch", 256)
    assert step("deepspeed", 8192) == pytest.approx(step("torch", 8192), rel=0.02)
