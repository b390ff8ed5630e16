"""The serving-time model (hp_tool/estimate/serving.py), term by term, on published shapes and an H100's numbers."""

from __future__ import annotations

import dataclasses

import pytest

from hp_tool.architectures import count_parameters
from hp_tool.estimate.serving import (GIB, ServingEfficiency, ServingGpu, ServingLayout, decode_step_s,
                                      kv_capacity_tokens, max_concurrency, prefill_s, serving_time,
                                      touched_weight_parameters, tp_allreduce_s)
from hp_tool.hf_config import load_hf_model

H100 = ServingGpu(memory_gib=79.2, memory_bandwidth_gbps=3350, peak_tflops={"bf16": 989, "fp16": 989, "fp8": 1979},
                  intra_node_bandwidth_gbps=450)
EFF = ServingEfficiency()
LLAMA7B = load_hf_model("llama2_7b").shape(4096)
MIXTRAL = load_hf_model("mixtral_8x7b").shape(4096)


def test_a_batch_of_one_decodes_at_the_memory_bandwidth():
    """Llama-2-7B in bf16 on one H100, one request: each step reads the 13.5 GB of weights (and a little KV
    cache) at the fitted fraction of 3.35 TB/s, about 5.3 ms, and fp8 weights read half of them."""
    layout = ServingLayout(1, 1, 1, 128, 128)
    weights_s = count_parameters(LLAMA7B) * 2 / (3350e9 * EFF.bandwidth)
    step = decode_step_s(LLAMA7B, layout, H100, EFF)
    assert weights_s < step - EFF.step_s < 1.05 * weights_s
    fp8 = decode_step_s(LLAMA7B, dataclasses.replace(layout, weights="fp8"), H100, EFF)
    assert 0.45 < (fp8 - EFF.step_s) / (step - EFF.step_s) < 0.55


def test_larger_batches_share_the_weights_until_compute_binds():
    """Time per output token grows slowly with the batch (the KV cache's reads), so throughput grows with it, less
    the batch's prefill (64 prompts of 512 tokens: a third of the batch's latency); per request it only falls."""
    times = {b: serving_time(LLAMA7B, ServingLayout(1, 1, b, 512, 128), H100) for b in (1, 8, 64, 512)}
    assert times[8].tpot_s < 1.5 * times[1].tpot_s
    assert times[64].tokens_per_s > 15 * times[1].tokens_per_s
    assert 0.25 < times[64].ttft_s / times[64].latency_s < 0.4
    per_request = [times[b].tokens_per_s / b for b in (1, 8, 64, 512)]
    assert per_request == sorted(per_request, reverse=True)
    assert times[512].ttft_s > 100 * times[1].ttft_s / 2  # the prefill of 512 prompts is compute-bound


def test_tp_splits_the_reads_and_adds_two_all_reduces_a_layer():
    """At batch 1 a TP 2 step reads half the weights per GPU and adds 64 all-reduces (two per layer): with
    all-reduces free it takes about half as long, with the fitted latency it pays them."""
    one = ServingLayout(1, 1, 1, 128, 128)
    two = dataclasses.replace(one, tp=2)
    assert tp_allreduce_s(LLAMA7B, one, 1, H100, EFF) == 0.0
    assert tp_allreduce_s(LLAMA7B, two, 1, H100, EFF) == pytest.approx(2 * 32 * EFF.allreduce_s, rel=0.01)
    free = dataclasses.replace(EFF, allreduce_s=0.0, step_s=0.0)
    t1, t2 = serving_time(LLAMA7B, one, H100, free), serving_time(LLAMA7B, two, H100, free)
    assert 0.5 * t1.tpot_s < t2.tpot_s < 0.52 * t1.tpot_s  # half the reads (and a 16-bit all-reduce's bytes)
    paid = serving_time(LLAMA7B, two, H100, EFF).tpot_s - serving_time(LLAMA7B, two, H100, free).tpot_s
    assert paid == pytest.approx(64 * EFF.allreduce_s + EFF.step_s, rel=0.01)
    assert serving_time(LLAMA7B, two, H100).tokens_per_s_per_gpu < serving_time(LLAMA7B, one, H100).tokens_per_s_per_gpu


def test_pp_adds_memory_room_not_speed():
    one = ServingLayout(1, 1, 8, 128, 128)
    two = dataclasses.replace(one, pp=2)
    t1, t2 = serving_time(LLAMA7B, one, H100), serving_time(LLAMA7B, two, H100)
    assert t2.tpot_s >= t1.tpot_s and t2.weights_gib == pytest.approx(t1.weights_gib / 2)
    assert t2.max_concurrency > 2 * t1.max_concurrency


def test_the_kv_cache_holds_what_the_weights_leave_and_fp8_doubles_it():
    layout = ServingLayout(1, 1, 1, 1024, 1024)
    free = 79.2 * 0.9 * GIB - count_parameters(LLAMA7B) * 2 - 3 * GIB
    per_token = 2 * 32 * 32 * 128 * 2  # keys and values, 32 layers, 32 kv heads of 128, bf16
    assert kv_capacity_tokens(LLAMA7B, layout, H100, EFF) == pytest.approx(free / per_token)
    assert max_concurrency(LLAMA7B, layout, H100, EFF) == int(free / per_token // 2048)
    fp8 = dataclasses.replace(layout, kv_cache="fp8")
    assert kv_capacity_tokens(LLAMA7B, fp8, H100, EFF) == pytest.approx(2 * free / per_token)


def test_a_mixture_of_experts_reads_the_experts_its_batch_routes_to():
    """Mixtral routes each token to 2 of 8 experts: one token reads 2 experts a layer, a large batch all 8."""
    dense = count_parameters(MIXTRAL) - 32 * 8 * (3 * 4096 * 14336)
    one = touched_weight_parameters(MIXTRAL, 1)
    assert one == pytest.approx(dense + 32 * 2 * 3 * 4096 * 14336, rel=1e-6)
    assert touched_weight_parameters(MIXTRAL, 256) == pytest.approx(count_parameters(MIXTRAL), rel=1e-6)
    assert touched_weight_parameters(MIXTRAL, 1) < touched_weight_parameters(MIXTRAL, 4) < count_parameters(MIXTRAL)


def test_the_prefill_grows_faster_than_the_prompt():
    short = prefill_s(LLAMA7B, ServingLayout(1, 1, 16, 1024, 1), H100, EFF)
    long = prefill_s(LLAMA7B, ServingLayout(1, 1, 16, 4096, 1), H100, EFF)
    assert long > 4 * short  # the attention is quadratic in the prompt


def test_a_continuous_batching_server_prefills_a_request_as_it_joins():
    """Continuous batching: a request's first token waits for its own prompt's prefill (not the batch's), handed
    through each of the PP - 1 stage boundaries once, and every step also prefills the prompts that join it
    (concurrency / output_len of them), so its time per output token is the static batch's plus their FLOPs."""
    from hp_tool.estimate.serving import joining_prefill_s, pp_handoff_s, prefill_pass_s

    static = ServingLayout(1, 4, 64, 1024, 256)
    served = dataclasses.replace(static, batching="continuous")
    assert prefill_s(LLAMA7B, served, H100, EFF) == pytest.approx(
        prefill_pass_s(LLAMA7B, served, H100, EFF, 1) + pp_handoff_s(LLAMA7B, served, 1024, H100, EFF) + EFF.step_s)
    assert prefill_s(LLAMA7B, served, H100, EFF) < prefill_s(LLAMA7B, static, H100, EFF) / 10
    joining = joining_prefill_s(LLAMA7B, served, H100, EFF)
    assert joining > 0 and decode_step_s(LLAMA7B, served, H100, EFF) == pytest.approx(
        decode_step_s(LLAMA7B, static, H100, EFF) + joining)
    t = serving_time(LLAMA7B, served, H100)
    assert t.tokens_per_s == pytest.approx(64 / t.tpot_s)


def test_a_pipeline_runs_micro_batches_through_its_stages_at_once():
    """A large compute-bound batch (Llama 3.1 8B: 8 kv heads, a short context, so the batch's FLOPs outlast its KV
    cache's reads) through 4 stages: in micro-batches the stages work at once, so the step takes about
    (m + 3) / (4 m) of the whole batch's pass, not all of it; one request cannot be split."""
    from hp_tool.estimate.serving import microbatches

    llama31 = load_hf_model("llama3_1_8b").shape(4096)
    big = ServingLayout(1, 4, 1024, 128, 16)
    assert microbatches(big) == [1, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert microbatches(dataclasses.replace(big, concurrency=1)) == [1]
    one_stage = decode_step_s(llama31, dataclasses.replace(big, pp=1), H100, EFF) - EFF.step_s
    assert decode_step_s(llama31, big, H100, EFF) - EFF.step_s < 0.5 * one_stage
