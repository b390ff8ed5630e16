"""Memory model against published numbers (Korthikanti et al. 2022; ZeRO paper)."""

import functools

import pytest

from hp_tool.families.gpt3 import activation_bytes_per_layer, gpt3_shape
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.memory import estimate_memory
from hp_tool.estimate.memory import model_state_bytes as _model_state_bytes

GIB, MIB = 2**30, 2**20


def test_activation_per_layer_gpt3_175b_no_parallelism():
    assert activation_bytes_per_layer(2048, 1, 12288, 96) / GIB == pytest.approx(2.67, abs=0.005)


def test_activation_per_layer_tp8_sequence_parallel_selective_recompute():
    got = activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sequence_parallel=True, store_scores=False)
    assert got / MIB == pytest.approx(102, abs=0.5)


def test_tensor_parallel_without_sp_keeps_replicated_part():
    full = activation_bytes_per_layer(2048, 1, 12288, 96, tp=1, store_scores=False)
    tp8 = activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, store_scores=False)
    assert tp8 == pytest.approx(full * (10 + 24 / 8) / 34)


def test_model_states_follow_zero_table():
    """DeepSpeed's ZeRO: 16-bit weights and gradients, fp32 master and moments (2 + 2 + 12)."""
    psi = 1e9
    model_state_bytes = functools.partial(_model_state_bytes, engine="deepspeed")
    assert model_state_bytes(psi, 8, 0) == 16 * psi
    assert model_state_bytes(psi, 8, 1) == 4 * psi + 12 * psi / 8
    assert model_state_bytes(psi, 8, 2) == 2 * psi + 14 * psi / 8
    assert model_state_bytes(psi, 8, 3) == 16 * psi / 8
    assert model_state_bytes(psi, 1, 3) == 16 * psi
    # offload: the optimizer part (12) leaves the GPU; at ZeRO-2 and 3 the gradient partition with it (ZeRO-Offload
    # reduces each bucket into the host's fp32 gradient and frees it); with parameters, everything does
    assert model_state_bytes(psi, 8, 1, "optimizer") == 4 * psi
    assert model_state_bytes(psi, 8, 2, "optimizer") == 2 * psi
    assert model_state_bytes(psi, 8, 3, "optimizer") == 2 * psi / 8
    assert model_state_bytes(psi, 8, 3, "optimizer_and_params") == 0


def test_deepspeed_reduces_through_a_bucket_and_zero_offload_trains_10b_on_one_v100():
    """DeepSpeed's ZeRO-2 and 3 reduce gradients through a buffer of reduce_bucket_size elements (5e8, its default,
    which hp_tool's DeepSpeed config leaves) beside the partition; the ZeRO-Offload tutorial's 10B GPT-2 (50 layers of
    4096, 10 sequences of 1024, every layer checkpointed, fp16, ZeRO-2 with the optimizer on the CPU) trained on one
    V100 32GB: its 16-bit weights and the bucket are all the GPU holds of the model states."""
    shape = gpt3_shape(10.0, 50257, 1024)[0].__class__("gpt3", 50, 4096, 32, 32, 16384, 50257, 1024)
    v100 = Hardware(gpus_per_node=1, gpu_memory_gib=31.74, peak_tflops=125, intra_node_bandwidth_gbps=150,
                    inter_node_bandwidth_gbps=12.5, memory_overhead_gib=1.5)
    layout = Layout.of(tp=1, pp=1, dp=1, mbs=10, global_batch_size=10, act_ckpt_layers=50, engine="deepspeed",
                       zero_stage=2, offload="optimizer", precision="fp16")
    states = estimate_memory(shape, layout, v100).model_states_gib
    params = 50 * 12 * 4096 ** 2 + 50 * 13 * 4096 + (50257 + 1024) * 4096 + 2 * 4096
    assert states * 2 ** 30 == pytest.approx(2 * params + 2 * 5e8, rel=1e-3)
    assert estimate_memory(shape, layout, v100).total_gib < 31.74
    # without offload the partition is back on the GPU, and the bucket beside it
    kept = estimate_memory(shape, layout.replace(offload="none", dp=8, global_batch_size=80), v100)
    assert kept.model_states_gib * 2 ** 30 == pytest.approx(2 * params + 14 * params / 8 + 2 * 5e8, rel=1e-3)


def test_torch_engine_states_keep_fp32_weights_as_the_master():
    """The torch engine's parameters are fp32 (4), gradients fp32 (4), AdamW moments (8): ZeRO-1
    (ShardedAdamW) shards the moments only, ZeRO-2 shards everything (FSDP2 shards the parameters too)."""
    psi = 1e9
    assert _model_state_bytes(psi, 8, 0) == 16 * psi
    assert _model_state_bytes(psi, 8, 1) == 8 * psi + 8 * psi / 8
    assert _model_state_bytes(psi, 8, 2) == _model_state_bytes(psi, 8, 3) == 16 * psi / 8
    assert _model_state_bytes(psi, 8, 3, "optimizer_and_params") == 0


HW = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=200,
              inter_node_bandwidth_gbps=25, memory_overhead_gib=3.0)


def test_checkpointing_and_smaller_microbatch_lower_activations():
    shape, _ = gpt3_shape(5, 51200, 2048)
    base = estimate_memory(shape, Layout.of(tp=1, pp=1, dp=8, mbs=4, act_ckpt_layers=0, global_batch_size=256), HW)
    ckpt = estimate_memory(shape, Layout.of(tp=1, pp=1, dp=8, mbs=4, act_ckpt_layers=12, global_batch_size=256), HW)
    small = estimate_memory(shape, Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=256), HW)
    assert ckpt.activations_gib < base.activations_gib
    assert small.activations_gib == pytest.approx(base.activations_gib / 4)
    assert base.overhead_gib == 3.0


def test_pipeline_first_stage_holds_about_all_layers_in_flight():
    shape, _ = gpt3_shape(20, 51200, 2048)
    pp1 = estimate_memory(shape, Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=64), HW).activations_gib
    pp4 = estimate_memory(shape, Layout.of(tp=1, pp=4, dp=2, mbs=1, act_ckpt_layers=0, global_batch_size=64), HW).activations_gib
    assert pp4 == pytest.approx(pp1, rel=0.01)  # 4 micro-batches in flight x L/4 layers


def test_logits_term_uses_the_vocabulary():
    """The whole-logits loss at its traced 12 bytes per logit (16 per local logit under TP's vocabulary-parallel
    loss; tests/test_long_context_memory.py measures both)."""
    shape, _ = gpt3_shape(1, 51200, 2048)
    est = estimate_memory(shape, Layout.of(tp=1, pp=1, dp=8, mbs=2, act_ckpt_layers=0, global_batch_size=256), HW)
    assert est.logits_gib == pytest.approx(2 * 2048 * 51200 * 12 / 2**30)
    tp2 = estimate_memory(shape, Layout.of(tp=2, pp=1, dp=4, mbs=2, act_ckpt_layers=0, global_batch_size=256), HW)
    assert tp2.logits_gib == pytest.approx(2 * 2048 * 51200 / 2 * 16 / 2**30)


@pytest.mark.parametrize("pp, v, m", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (4, 2, 6), (4, 2, 2), (8, 4, 16), (3, 2, 1)])
def test_micro_batches_in_flight_follow_torchs_interleaved_schedule(pp, v, m):
    """The count the analytic model and the tracer use is the most chunk forwards whose backward has not
    run, in the action order ScheduleInterleaved1F1B itself computes for each rank, over v."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from hp_tool.estimate.layout import microbatches_in_flight

    rounds = max(1, m // pp)
    for rank in range(pp):
        torch_schedule = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=pp,
                                         _n_microbatches=m)
        live = most = 0
        for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(torch_schedule, rank):
            if action is None:
                continue
            live += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}.get(action.computation_type, 0)
            most = max(most, live)
        layout = Layout.of(tp=1, pp=pp, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=m, virtual_stages=v)
        assert microbatches_in_flight(layout, rank) == pytest.approx(most / v)
    if m % pp == 0 and m >= 2 * pp:  # Korthikanti et al.'s first-stage factor (full rounds, warm-up not capped)
        assert microbatches_in_flight(Layout.of(tp=1, pp=pp, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=m, virtual_stages=v), 0) == \
            pytest.approx(pp * (1 + (pp - 1) / (pp * v)))


# one value of each field besides the base layout's, to vary it by
OTHER_VALUE = {"mbs": 2, "global_batch_size": 128, "act_ckpt_layers": 4, "act_ckpt_mode": "selective",
               "sequence_parallel": False, "loss": "chunked", "loss_chunk_tokens": 512, "activation_offload": True,
               "compile": True, "zero_stage": 1, "offload": "optimizer", "optimizer": "sgd", "master_weights": "bf16"}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_state_and_activation_terms_each_read_only_their_own_fields(method):
    """The planner keeps a layout's model states across layouts that differ only in activation fields, and its
    activations across those that differ only in the savers' (memory.state_terms / activation_terms): each field
    on either list leaves the other term unchanged, computed afresh; each saver field changes the states of full
    training and the micro-batch the activations (the test can tell: a state field put on the activations' list
    fails here)."""
    from hp_tool.estimate import memory
    from hp_tool.families.llama import llama_shape
    from hp_tool.recipe import Adapters

    shape, _ = llama_shape(8, 128256, 2048)
    lora = Adapters(target_modules=("q_proj", "v_proj")) if method == "lora" else None
    base = Layout.of(tp=2, pp=2, dp=4, mbs=1, global_batch_size=64, act_ckpt_layers=0, sequence_parallel=True,
                     zero_stage=3, method=method, lora=lora)
    states, activations = memory._state_terms(shape, base, HW), memory._activation_terms(shape, base, HW)
    for name in memory.ACTIVATION_ONLY_FIELDS:
        other = base.replace(**{name: OTHER_VALUE[name]})
        assert memory._state_terms(shape, other, HW) == states, name
    for name in memory.STATE_ONLY_FIELDS:
        other = base.replace(**{name: OTHER_VALUE[name]})
        assert memory._activation_terms(shape, other, HW) == activations, name
        if method == "full":
            assert memory._state_terms(shape, other, HW) != states, name
    assert memory._activation_terms(shape, base.replace(mbs=2), HW) != activations
