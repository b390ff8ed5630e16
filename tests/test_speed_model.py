"""The step-time model: matmul efficiency from the GEMM shapes, collectives, interleaved pipelining, sharded
data parallelism. Its accuracy on published runs is benchmarks/published_runs.py's to gate (it exits 1 below
its targets); tests/test_accuracy_claims.py checks that the README quotes what it prints."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import pytest

from hp_tool.architectures import Shape
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.memory import estimate_memory
from hp_tool.estimate.speed import collective_s, dp_collectives, estimate_step_time, matmul_efficiency

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "published_runs.py"
GPT_20B = Shape("gpt3", 44, 6144, 48, 48, 4 * 6144, 51200, 2048)


@functools.lru_cache(maxsize=1)
def published():
    spec = importlib.util.spec_from_file_location("published_runs", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["published_runs"] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_efficiency_rises_with_width_per_tp_rank_and_tokens_and_saturates_at_the_gpus_own_curve():
    base = Layout.of(tp=8, pp=1, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=8)
    a100 = published().hardware("a100_80gb")
    h100 = published().hardware("h100_96gb_hbm2e")
    by_tp = [matmul_efficiency(GPT_20B, base.replace(tp=tp), a100) for tp in (8, 4, 2, 1)]
    by_mbs = [matmul_efficiency(GPT_20B, base.replace(mbs=mbs), a100) for mbs in (1, 2, 4, 8)]
    assert by_tp == sorted(by_tp) and by_mbs == sorted(by_mbs)
    assert by_tp[0] < by_tp[-1] < a100.max_efficiency
    # each preset carries its generation's curve, fitted on its own runs: the 500 W H100's matmuls reach more TFLOPS
    # than an A100's, below its own curve's saturation
    assert a100.peak_tflops * matmul_efficiency(GPT_20B, base, a100) < \
        h100.peak_tflops * matmul_efficiency(GPT_20B, base, h100) < h100.peak_tflops * h100.max_efficiency


def test_a_stacks_hopper_attention_and_hidden_tp_collectives_cut_only_their_own_parts():
    """NeMo's Transformer Engine runs attention in Hopper's own kernels and overlaps TP's collectives with the GEMMs
    (benchmarks/published_runs.py sets both for its runs): a long-sequence Llama layout's attention runs at the
    rate FlashAttention-3's paper measures for cuDNN's kernels at 8K tokens (529 TFLOPS forward, 518 backward),
    whatever the preset's fitted FlashAttention-2 saturation, its TP collectives take the unhidden share, the rest
    of the step is as it was; an encoder-decoder's attention (priced with its linears) and hp_tool's own engines
    (neither set) are unchanged."""
    from hp_tool.estimate.speed import attention_efficiency, attention_flops_per_step
    llama = Shape("llama", 32, 4096, 32, 8, 14336, 128256, 8192)
    layout = Layout.of(tp=4, pp=1, dp=2, mbs=1, act_ckpt_layers=0, global_batch_size=16)
    h100 = published().hardware("h100_80gb")
    base = estimate_step_time(llama, layout, h100, 1)
    fast = estimate_step_time(llama, layout, dataclasses.replace(h100, hopper_attention=True), 1)
    _, kernels = attention_flops_per_step(llama, layout)
    per_gpu = kernels / layout.gpus
    attention = per_gpu / (h100.peak_tflops * 1e12 * attention_efficiency(llama, layout, h100))
    assert attention > 0.1 * base.compute_s  # 8K tokens: attention is a part worth pricing
    forward, backward = 529e12, 518e12  # cuDNN on H100 SXM at 8K tokens, head dim 128
    cudnn = per_gpu / 3.5 / forward + per_gpu * 2.5 / 3.5 / backward
    assert base.compute_s - fast.compute_s == pytest.approx(attention - cudnn, rel=1e-9)
    for fitted in (0.1, 0.3):  # the preset's FlashAttention-2 fit does not move Hopper's own kernels
        other = dataclasses.replace(h100, hopper_attention=True, attention_efficiency=fitted)
        assert estimate_step_time(llama, layout, other, 1).compute_s == pytest.approx(fast.compute_s, rel=1e-12)
    assert (fast.tp_comm_s, fast.elementwise_s, fast.dp_comm_s) == (base.tp_comm_s, base.elementwise_s, base.dp_comm_s)
    hidden = estimate_step_time(llama, layout, dataclasses.replace(h100, tp_comm_hidden=0.4), 1)
    assert base.tp_comm_s > 0 and hidden.tp_comm_s == pytest.approx(0.6 * base.tp_comm_s)
    assert hidden.total_s - base.total_s == pytest.approx(hidden.tp_comm_s - base.tp_comm_s)
    t5 = Shape("t5", 24, 1024, 16, 16, 2816, 32128, 512, decoder_seq_length=128)
    t5_layout = Layout.of(tp=1, pp=1, dp=8, mbs=4, act_ckpt_layers=0, global_batch_size=32)
    assert estimate_step_time(t5, t5_layout, dataclasses.replace(h100, hopper_attention=True), 1) == \
        estimate_step_time(t5, t5_layout, h100, 1)


def test_collectives_cost_nvlink_within_a_node_and_the_nodes_aggregate_network_between_nodes():
    """One all-gather of 8 GiB: 8 GPUs in one node move 7/8 of it over NVLink; 8 nodes of 1 GPU move 7/8 over
    each GPU's NIC; 64 GPUs in 8 nodes move 7/8 over NVLink and 7/8 of it over the node's 8 NICs at once."""
    hw = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
                  inter_node_bandwidth_gbps=25, memory_overhead_gib=3)
    size = 8e9
    one_node = collective_s(size, 8, 8, hw)
    eight_single = collective_s(size, 8, 1, hw)
    eight_nodes = collective_s(size, 64, 8, hw)
    assert one_node == pytest.approx(7 / 8 * 8 / 300)
    assert eight_single == pytest.approx(7 / 8 * 8 / 25)
    assert eight_nodes == pytest.approx(7 / 8 * 8 / 300 + 7 / 8 * 8 / (8 * 25))
    assert collective_s(size, 1, 8, hw) == 0.0
    # a TP-8 layout leaves one of each TP rank's data-parallel peers per node: its own NIC, not the node's eight
    from hp_tool.estimate.speed import zero_ranks_per_node
    assert zero_ranks_per_node(Layout.of(tp=8, pp=1, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=8), hw, num_nodes=8) == 1
    assert zero_ranks_per_node(Layout.of(tp=1, pp=1, dp=64, mbs=1, act_ckpt_layers=0, global_batch_size=64), hw, num_nodes=8) == 8
    assert zero_ranks_per_node(Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=8), hw, num_nodes=1) == 8


def test_fsdp_gathers_hide_behind_the_compute_they_overlap_and_show_when_they_outrun_it():
    """ZeRO-3 over 64 A100s in 8 nodes: with a long micro-batch the layer-by-layer gathers and reduce-scatters
    hide behind the compute (only one layer's share shows); at one short sequence per GPU they outrun it."""
    from hp_tool.estimate.speed import dp_comm_s
    hw = published().hardware("a100_80gb")
    llama = Shape("llama", 32, 4096, 32, 8, 14336, 128256, 8192)
    long_mb = Layout.of(tp=1, pp=1, dp=64, mbs=2, act_ckpt_layers=0, global_batch_size=128, zero_stage=3)
    short = dataclasses.replace(llama, seq_length=256)
    hidden, exposed = dp_comm_s(llama, long_mb, hw, 8), dp_comm_s(short, Layout.of(tp=1, pp=1, dp=64, mbs=1, act_ckpt_layers=0, global_batch_size=64, zero_stage=3), hw, 8)
    step = estimate_step_time(llama, long_mb, hw, 8)
    assert 0 < hidden < 0.05 * step.compute_s
    assert exposed > estimate_step_time(short, Layout.of(tp=1, pp=1, dp=64, mbs=1, act_ckpt_layers=0, global_batch_size=64, zero_stage=3), hw, 8).compute_s


def test_virtual_stages_divide_the_bubble_multiply_the_p2p_and_raise_activation_memory():
    hw = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
                  inter_node_bandwidth_gbps=25, memory_overhead_gib=3)
    plain = Layout.of(tp=8, pp=4, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=16)
    inter = plain.replace(virtual_stages=2)
    a, b = (estimate_step_time(GPT_20B, x, hw, num_nodes=4) for x in (plain, inter))
    assert b.compute_s == a.compute_s
    assert b.bubble_s == pytest.approx(a.bubble_s / 2)
    assert b.pp_comm_s == pytest.approx(a.pp_comm_s * 2)
    ma, mb = (estimate_memory(GPT_20B, x, hw) for x in (plain, inter))
    # 1 + (p-1)/(p·v) in flight, plus the hidden states the interleaved runtime holds (receive buffers of the
    # other chunk, sends kept to the step's end): 2·(v-1)·m + (2·v·m - m) on the first stage
    from hp_tool.estimate.layout import interleave_held_tensors

    held = sum(interleave_held_tensors(inter, 0))
    assert held == 2 * 16 + (2 * 2 * 16 - 16)
    hidden_gib = GPT_20B.seq_length * GPT_20B.hidden_size * 2 / 1e9
    assert mb.activations_gib == pytest.approx(ma.activations_gib * (1 + 3 / 8) + held * hidden_gib, rel=0.02)


def test_sharded_data_parallel_collectives_follow_each_engine_per_micro_batch():
    m = 6  # micro-batches per replica
    lay = lambda z, engine, ckpt=0, pp=1: Layout.of(tp=1, pp=pp, dp=4, mbs=2, act_ckpt_layers=ckpt, global_batch_size=2 * 4 * m, zero_stage=z, offload="none", engine=engine)  # noqa: E731
    every = GPT_20B.pipeline_layers
    assert dp_collectives(GPT_20B, lay(0, "torch")) == dp_collectives(GPT_20B, lay(1, "deepspeed")) == 2
    assert dp_collectives(GPT_20B, lay(2, "torch")) == 2 * m  # FSDP2: a gather and a reduce-scatter each
    assert dp_collectives(GPT_20B, lay(2, "deepspeed")) == m + 1  # a reduce-scatter each, one gather
    assert dp_collectives(GPT_20B, lay(3, "torch")) == dp_collectives(GPT_20B, lay(3, "torch", every)) == 3 * m
    # DeepSpeed gathers a checkpointed layer again for its recompute forward
    assert dp_collectives(GPT_20B, lay(3, "deepspeed", every // 2)) == pytest.approx(3.5 * m)
    assert dp_collectives(GPT_20B, lay(3, "deepspeed", every)) == 4 * m
    # under PP the torch schedule keeps the stage gathered through the step: one gather, one reduction
    assert dp_collectives(GPT_20B, lay(3, "torch", pp=4)) == 2
    hw = Hardware(8, 80, 312, 300, 25, 0.0)
    exposed = [estimate_step_time(GPT_20B, lay(3, "deepspeed", k), hw, 4).dp_comm_s for k in (0, every)]
    assert exposed[1] > exposed[0]


@pytest.mark.parametrize("pp, zero, engine", [(2, 3, "torch"), (1, 2, "torch"), (1, 3, "torch"), (1, 2, "deepspeed"),
                                              (1, 3, "deepspeed"), (1, 0, "torch")])
def test_lora_data_parallel_traffic_gathers_the_frozen_base_and_reduces_only_the_adapters(pp, zero, engine):
    """LoRA at ZeRO-2/3 still gathers the sharded frozen weights as full training does (FSDP2 per forward,
    and once per step under PP; DeepSpeed's ZeRO-2 never shards them) and reduces only the adapters'
    gradients: never less traffic than the adapters' all-reduce, never negative (a 64-micro-batch step under
    PP over FSDP2 once came out at minus 1.7 s)."""
    from hp_tool.estimate.speed import dp_comm_s
    from hp_tool.families.shape import Shape
    from hp_tool.recipe import Adapters
    llama = Shape("llama", 32, 4096, 32, 8, 14336, 32000, 512, pretrained=True)
    # a 1 GB/s network, so that the traffic outruns the compute it overlaps and shows whole
    hw = Hardware(8, 80, 312, 300, 1, 3)
    layout = Layout.of(tp=1, pp=pp, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=512, zero_stage=zero,
                       offload="none", engine=engine)  # 64 micro-batches per replica
    lora = layout.replace(method="lora", lora=Adapters(16, target_modules=("q_proj", "v_proj")))
    full, adapters = dp_comm_s(llama, layout, hw, 2), dp_comm_s(llama, lora, hw, 2)
    step = estimate_step_time(llama, lora, hw, 2)
    assert step.dp_comm_s >= 0 and step.total_s > step.compute_s > 0
    assert 0 < adapters < full
    if zero >= 3 or (zero == 2 and engine == "torch" and pp == 1):  # the frozen base is gathered as in full training
        assert adapters > 0.3 * full
