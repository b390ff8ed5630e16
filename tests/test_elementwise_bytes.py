"""An eager layer's element-wise work (hp_tool/estimate/speed.py ``elementwise_s``): the bytes per token the planner
prices are what the trial engine's own layer moves (counted on its modules in bf16, every family), and they cost
what the GPU's memory bandwidth says: a share of an eager step that grows where the GPU's FLOPs outrun its
bandwidth, that a checkpointed layer's recompute adds to, and that fused kernels (torch.compile, a stack that fuses
them) mostly remove."""

from dataclasses import replace

import pytest

from bench_helpers import benchmark
from hp_tool.estimate.layout import GB, Hardware, Layout
from hp_tool.estimate.speed import (ADAPTER_BYTES, DROPOUT_BYTES, ELEMENTWISE_BANDWIDTH, FUSED_ELEMENTWISE,
                                    elementwise_s, estimate_step_time, layer_pass_bytes)
from hp_tool.families.registry import family, family_names
from hp_tool.families.shape import Shape
from hp_tool.recipe import Adapters

COUNTER = benchmark("elementwise_bytes")  # counts the engine's element-wise bytes
L7B = Shape("llama", 32, 4096, 32, 32, 11008, 32000, 2048)
A100 = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
                inter_node_bandwidth_gbps=25, memory_overhead_gib=3, memory_bandwidth_gbps=2039, max_efficiency=0.72,
                attention_efficiency=0.7)
H100 = replace(A100, peak_tflops=989, memory_bandwidth_gbps=3350)


def lay(**kw) -> Layout:
    base = dict(tp=1, pp=1, dp=1, mbs=2, act_ckpt_layers=0, global_batch_size=2)
    return Layout.of(**{**base, **kw})


# The covering set in the default run: each family's code path once: GPT-3 (LayerNorm, GELU MLP), Llama (RMSNorm,
# SwiGLU, grouped-query attention), T5 (an encoder and a decoder layer, cross-attention) and the mixture of
# experts (router and experts). The other families' records (mT5, the Llama-like and Gemma families, the other
# mixtures) are the matrix tier's, 1-4 s each.
COVERING_FAMILIES = ("gpt3", "llama", "t5", "moe")


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in COVERING_FAMILIES else pytest.mark.matrix)
                                  for name in family_names()])
def test_each_familys_bytes_are_what_the_engines_layer_moves(name):
    # each pass's bytes per token at the tiny stage's widths, and its ffn coefficient, within BYTES_TOLERANCE
    assert COUNTER.mismatches(name, COUNTER.layer_bytes(name)) == []


def test_an_adapted_linear_adds_the_bytes_peft_moves():
    for record, counted in zip(ADAPTER_BYTES, COUNTER.adapter_bytes()):
        assert record == pytest.approx(counted, rel=COUNTER.BYTES_TOLERANCE)


def test_bytes_are_priced_at_the_memory_bandwidth_per_layer_pass_and_micro_batch():
    layout = lay(act_ckpt_layers=12, global_batch_size=6)  # 3 micro-batches, 12 of 32 layers recomputed
    forward, backward, recompute = layer_pass_bytes(L7B, layout)
    tokens = 3 * 2 * 2048
    expected = tokens * (32 * (forward + backward) + 12 * recompute) / (2039 * GB * ELEMENTWISE_BANDWIDTH)
    assert elementwise_s(L7B, layout, A100) == pytest.approx(expected)
    (fa, fb), (ba, bb), _ = family("llama").time.layer_bytes
    assert forward == fa * 4096 + fb * 11008 and backward == ba * 4096 + bb * 11008
    # TP splits each rank's share; context parallelism its tokens
    assert elementwise_s(L7B, layout.replace(tp=2, dp=1), A100) == pytest.approx(expected / 2)
    assert elementwise_s(L7B, layout.replace(cp=2), A100) == pytest.approx(expected / 2)


def test_lora_adds_bytes_per_adapted_linear_feature():
    targets = ("q_proj", "v_proj")
    lora = lay(method="lora", lora=Adapters(rank=16, alpha=32.0, dropout=0.0, target_modules=targets))
    full, adapted = layer_pass_bytes(L7B, lay()), layer_pass_bytes(L7B, lora)
    features = (4096 + 4096) * 2  # q and v: 4096 in, 4096 out (multi-head attention)
    assert [a - f for f, a in zip(full, adapted)] == pytest.approx([b * features for b in ADAPTER_BYTES])
    # a non-zero dropout: each adapter drops its own input out (q's and v's: 4096 features each), every pass
    dropped = layer_pass_bytes(L7B, lora.replace(lora=replace(lora.lora, dropout=0.05)))
    assert [d - a for a, d in zip(adapted, dropped)] == pytest.approx([b * 2 * 4096 for b in DROPOUT_BYTES])
    assert dropped[1] - full[1] > 2 * (adapted[1] - full[1])  # the masks cost more than the folded adapters


def test_the_share_grows_where_flops_outrun_bandwidth_and_fused_kernels_remove_most():
    layout = lay()
    shares = {}
    for name, hw in (("a100", A100), ("h100", H100)):
        step = estimate_step_time(L7B, layout, hw, 1)
        shares[name] = step.elementwise_s / step.total_s
    assert 0.1 < shares["a100"] < shares["h100"] < 0.5  # an H100's FLOPs grew 3.2x, its bandwidth 1.6x
    eager = estimate_step_time(L7B, layout, H100, 1)
    compiled = estimate_step_time(L7B, layout.replace(compile=True), H100, 1)
    fused = estimate_step_time(L7B, layout, replace(H100, fused_elementwise=True), 1)
    assert compiled.elementwise_s == pytest.approx(FUSED_ELEMENTWISE * eager.elementwise_s)
    assert fused.elementwise_s == compiled.elementwise_s and compiled.compute_s == eager.compute_s
    assert 1.1 < eager.total_s / compiled.total_s < 1.5  # torchtitan's compiled Llama 8B: 16% more tokens/s on H100


def test_cpu_processes_price_no_bandwidth_apart():
    assert elementwise_s(L7B, lay(), replace(A100, device_is_host=True)) == 0.0
