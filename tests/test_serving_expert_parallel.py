"""Expert parallelism in the serving search: a mixture of experts' routed experts whole on the TP ranks (vLLM's
--enable-expert-parallel, EP = TP) instead of a 1/TP slice of each. The serving model's terms against hand
arithmetic on Mixtral-8x7B (32 layers, 8 experts of 3 x 4096 x 14336 parameters, 2 routed per token), the grid's EP
rows beside the TP rows, the vLLM flag, and where it is invalid."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.contracts.vllm import bench_command, serve_command
from hp_tool.errors import ConfigError
from hp_tool.estimate.serving import (ServingEfficiency, ServingGpu, ServingLayout, busiest_rank_experts,
                                      decode_step_s, decode_weight_bytes, ep_expert_read_parameters,
                                      expert_excess_parameters, tp_allreduce_s, weight_bytes_per_gpu)
from hp_tool.fingerprint import fingerprint_of
from hp_tool.hf_config import load_hf_model
from hp_tool.inference.report import SUMMARY_COLUMNS, summary_frame
from hp_tool.inference.search import PLAN_COLUMNS, collect_rows, plan_csv_text, plan_inference

IS = "search_config.inference_settings"
H100 = ServingGpu(memory_gib=79.2, memory_bandwidth_gbps=3350, peak_tflops={"bf16": 989, "fp16": 989, "fp8": 1979},
                  intra_node_bandwidth_gbps=450)
EFF = ServingEfficiency()
MIXTRAL = load_hf_model("mixtral_8x7b").shape(4096)
EXPERT = 3 * 4096 * 14336  # one expert's parameters (gate, up and down projections)


def tp_and_ep(tp: int, batch: int) -> tuple[ServingLayout, ServingLayout]:
    tp_layout = ServingLayout(tp, 1, batch, 128, 128)
    return tp_layout, dataclasses.replace(tp_layout, expert_parallel=True)


def test_the_busiest_rank_reads_the_largest_of_its_ranks_expert_counts():
    """E[max] of independent binomial counts, by hand: one expert a rank is read where some token routes to it;
    one rank's is the binomial's mean; two ranks of two experts at 1/2 take 1 - 1/4^2 + 1 - 3/4^2 = 1.375."""
    assert busiest_rank_experts(1, 0.25, 8) == pytest.approx(1 - 0.75 ** 8)
    assert busiest_rank_experts(4, 0.3, 1) == pytest.approx(4 * 0.3)
    assert busiest_rank_experts(2, 0.5, 2) == pytest.approx(1.375)
    assert busiest_rank_experts(16, 1.0, 8) == pytest.approx(16)
    assert busiest_rank_experts(16, 0.0, 8) == 0.0


def test_whole_experts_hold_the_same_weights_unless_tp_leaves_a_rank_more():
    """TP 4 holds 2 of the 8 experts whole on each rank, as many bytes as a quarter of each; at TP 3 the busiest rank
    holds ceil(8/3) = 3 experts, 1/3 of an expert a layer more than 8/3 of them."""
    tp4, ep4 = tp_and_ep(4, 1)
    assert expert_excess_parameters(MIXTRAL, 4, True) == 0.0
    assert weight_bytes_per_gpu(MIXTRAL, ep4) == weight_bytes_per_gpu(MIXTRAL, tp4)
    tp3, ep3 = tp_and_ep(3, 1)
    assert expert_excess_parameters(MIXTRAL, 3, True) == pytest.approx(EXPERT / 3)
    assert expert_excess_parameters(MIXTRAL, 3, False) == 0.0
    assert weight_bytes_per_gpu(MIXTRAL, ep3) - weight_bytes_per_gpu(MIXTRAL, tp3) == \
        pytest.approx(32 * EXPERT / 3 * 2)  # 32 layers, 16-bit


def test_one_request_reads_whole_experts_on_the_busiest_rank_and_a_large_batch_the_same_bytes():
    """One token routes to 2 of 8 experts: at TP 8 each rank reads 1/8 of both (a quarter expert a layer); with EP 8
    each rank holds one expert, routed to with probability 1/4, and the busiest of 8 reads 1 - (3/4)^8 of an expert.
    256 requests touch every expert: a whole expert a rank either way."""
    tp8, ep8 = tp_and_ep(8, 1)
    assert ep_expert_read_parameters(MIXTRAL, ep8, 1) == pytest.approx(32 * (1 - 0.75 ** 8) * EXPERT)
    extra = decode_weight_bytes(MIXTRAL, ep8, 1) - decode_weight_bytes(MIXTRAL, tp8, 1)
    assert extra == pytest.approx(32 * ((1 - 0.75 ** 8) - 2 / 8) * EXPERT * 2, rel=1e-6)
    assert decode_weight_bytes(MIXTRAL, dataclasses.replace(ep8, concurrency=256), 256) == \
        pytest.approx(decode_weight_bytes(MIXTRAL, dataclasses.replace(tp8, concurrency=256), 256), rel=1e-9)


def test_ep_costs_the_decode_step_its_extra_reads_and_keeps_the_all_reduces():
    """Memory-bound at batch 1, EP's time per output token is TP's plus its extra expert bytes at the fitted
    bandwidth; the MoE layer's output is summed by the same all-reduce (vLLM at DP 1 runs no all-to-all). At 256
    requests the two are the same."""
    tp8, ep8 = tp_and_ep(8, 1)
    assert tp_allreduce_s(MIXTRAL, ep8, 1, H100, EFF) == tp_allreduce_s(MIXTRAL, tp8, 1, H100, EFF) > 0
    extra = 32 * ((1 - 0.75 ** 8) - 2 / 8) * EXPERT * 2 / (3350e9 * EFF.bandwidth)
    slower = decode_step_s(MIXTRAL, ep8, H100, EFF) - decode_step_s(MIXTRAL, tp8, H100, EFF)
    assert slower == pytest.approx(extra, rel=1e-6)
    big_tp, big_ep = (dataclasses.replace(x, concurrency=256) for x in (tp8, ep8))
    assert decode_step_s(MIXTRAL, big_ep, H100, EFF) == pytest.approx(decode_step_s(MIXTRAL, big_tp, H100, EFF),
                                                                      rel=1e-9)


def mixtral_plan(tmp_path, *extra):
    cfg, _ = compose(["search_config=finetune/mixtral_8x7b", "gpu=h100_80gb", f"{IS}.max_batch_sizes=[1,256]",
                      *extra])
    return plan_inference(to_app_config(cfg), tmp_path)


def test_a_mixture_of_experts_on_vllm_plans_ep_rows_beside_tp_rows(tmp_path):
    """Mixtral on H100s with vLLM: every TP > 1 has an ``_ep`` layout beside its TP one, as much memory, slower at one
    request (whole experts on the busiest rank) and as fast at 256; none at TP 1. Its job passes
    --enable-expert-parallel, its fingerprint differs, plan.csv names it, and the serve line carries it."""
    plan = mixtral_plan(tmp_path, f"{IS}.engine=vllm")
    by_id = {c.config_id: c for c in plan.candidates}
    assert not any(c.expert_parallel for c in plan.candidates if c.tp == 1)
    for tp in (2, 4, 8):
        one_tp, one_ep = by_id[f"mixtral_46.7b_tp{tp}_pp1_bs1"], by_id[f"mixtral_46.7b_tp{tp}_pp1_bs1_ep"]
        assert (one_ep.status, one_ep.expert_parallel, one_tp.expert_parallel) == ("valid", True, False)
        assert one_ep.memory_gib == pytest.approx(one_tp.memory_gib)
        assert one_ep.predicted.tpot_s > 1.1 * one_tp.predicted.tpot_s
        many_tp, many_ep = by_id[f"mixtral_46.7b_tp{tp}_pp1_bs256"], by_id[f"mixtral_46.7b_tp{tp}_pp1_bs256_ep"]
        assert many_ep.predicted.tpot_s == pytest.approx(many_tp.predicted.tpot_s, rel=1e-6)
    job = plan.configs["mixtral_46.7b_tp4_pp1_bs1_ep"]
    assert job.expert_parallel and job.fingerprint() != plan.configs["mixtral_46.7b_tp4_pp1_bs1"].fingerprint()
    argv = bench_command(job.model_path, job.tp, job.pp, job.batch_size, 60, 20, 1, 1, job.precision, "o.json",
                         job.weights, job.kv_cache, job.expert_parallel)
    assert "--enable-expert-parallel" in argv
    assert "--enable-expert-parallel" not in bench_command("m", 4, 1, 1, 60, 20, 1, 1, "bf16", "o.json")
    header = plan_csv_text(plan).splitlines()[0].split(",")
    assert header[:4] == ["config_id", "tp", "pp", "expert_parallel"]
    summary = summary_frame(collect_rows(plan), 1e9)  # final_output.csv: nothing ran, each row its verdict
    assert list(summary.columns[:5]) == ["config_id", "status", "tp", "pp", "expert_parallel"]
    assert summary.set_index("config_id").loc["mixtral_46.7b_tp4_pp1_bs1_ep", "expert_parallel"]
    assert plan.serve_line(pd.DataFrame([{"status": "ok", "config_id": job.config_id}])) == (
        "vllm serve mistralai/Mixtral-8x7B-v0.1 --tensor-parallel-size 4 --pipeline-parallel-size 1 "
        "--enable-expert-parallel --dtype bfloat16 --max-num-seqs 1 --max-model-len 80")
    assert serve_command("m", 4, 1, 1, "bf16", 80) == ("vllm serve m --tensor-parallel-size 4 --pipeline-parallel-size "
                                                       "1 --dtype bfloat16 --max-num-seqs 1 --max-model-len 80")


def test_a_dense_model_plans_no_ep_rows_and_keeps_its_plan(tmp_path):
    """Llama 2 7B on vLLM: no expert parallelism in its grid, plan.csv's columns as before the dimension, and its
    configs' fingerprints those of configs written without the field; asked for it alone, the key is refused."""
    cfg, _ = compose(["search_config=finetune/llama2_7b", "gpu=h100_80gb", f"{IS}.engine=vllm"])
    plan = plan_inference(to_app_config(cfg), tmp_path)
    assert not any(c.expert_parallel or "_ep" in c.config_id for c in plan.candidates)
    assert tuple(plan_csv_text(plan).splitlines()[0].split(",")) == PLAN_COLUMNS
    assert tuple(summary_frame(collect_rows(plan), 1e9).columns) == SUMMARY_COLUMNS
    for job in plan.configs.values():
        old = {k: v for k, v in job.to_dict().items() if k not in ("config_id", "output_dir", "expert_parallel")
               and not (k in ("weights", "kv_cache") and v is None)}
        assert job.fingerprint() == fingerprint_of(old)
    only, _ = compose(["search_config=finetune/llama2_7b", f"{IS}.engine=vllm", f"{IS}.expert_parallel=[true]"])
    with pytest.raises(ConfigError) as err:
        plan_inference(to_app_config(only), tmp_path)
    assert err.value.key == f"{IS}.expert_parallel" and "dense model has no experts" in str(err.value)


def test_hp_tools_own_loop_does_not_run_expert_parallelism(tmp_path):
    """hp_tool's decode loop slices every expert over TP: asked for both, its EP rows are invalid naming the engine
    that runs it, its TP rows as they were; asked for EP alone, the key is refused with the same reason."""
    plan = mixtral_plan(tmp_path, f"{IS}.expert_parallel=[false,true]")
    ep = [c for c in plan.candidates if c.expert_parallel]
    assert ep and all(c.status == "invalid" and "engine=vllm" in c.reason for c in ep)
    assert any(c.status == "valid" for c in plan.candidates if not c.expert_parallel)
    assert not any(c.expert_parallel for c in mixtral_plan(tmp_path).candidates)  # null: off where it cannot run
    with pytest.raises(ConfigError) as err:
        mixtral_plan(tmp_path, f"{IS}.expert_parallel=[true]")
    assert err.value.key == f"{IS}.expert_parallel" and "does not run expert parallelism" in str(err.value)
