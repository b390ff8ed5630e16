"""Mixture-of-experts planning: parameter and FLOP counts against the published cards, transformers' own models
and a hand count; memory and step time with experts split over expert-parallel ranks; the grid's EP dimension
and the bad inputs a user can give. Pure planning: no process is started (the trials are tests/test_moe_trials.py)."""

import csv
import dataclasses

import pytest
import torch

from hp_tool.architectures import active_parameters, count_parameters, model_flops_per_step
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.contracts.spec import ModelSpec, ParallelSpec, TrialSpec, ResourcesSpec, TrainingSpec
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.memory import estimate_memory, stage_parameters
from hp_tool.estimate.speed import ep_comm_s, estimate_step_time
from hp_tool.families.shape import Shape
from hp_tool.hf_config import load_hf_model
from hp_tool.planner import make_plan
from hp_tool.plan_output import write_plan

MIXTRAL = Shape("mixtral", 32, 4096, 32, 8, 14336, 32000, 4096, num_experts=8, top_k=2, expert_imbalance=1.25)
HW = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
              inter_node_bandwidth_gbps=25, memory_overhead_gib=3)


@pytest.mark.parametrize("name, total_b, active_b", [("mixtral_8x7b", 46.7, 12.9), ("mixtral_8x22b", 141, 39),
                                                     ("qwen1_5_moe_a2_7b", 14.3, 2.7)])
def test_parameter_counts_match_the_published_cards(name, total_b, active_b):
    shape = load_hf_model(name).shape(512)
    assert count_parameters(shape) / 1e9 == pytest.approx(total_b, rel=0.005)
    assert active_parameters(shape) / 1e9 == pytest.approx(active_b, rel=0.01)


@pytest.mark.parametrize("name", ["tiny_moe", "mixtral_8x7b", "qwen1_5_moe_a2_7b"])
def test_parameter_counts_equal_transformers_models(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = load_hf_model(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf.config))
    assert count_parameters(hf.shape(128)) == sum(p.numel() for p in model.parameters())


def test_tiny_moe_by_hand():
    """tiny_moe: 4 layers, h 64, 4 heads of 16 and 2 kv heads, 4 experts of 96, top-2, vocabulary 512."""
    shape = load_hf_model("tiny_moe").shape(32)
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64  # q, k, v, o, two norms
    expert = 3 * 64 * 96
    layer, active = attention + 4 * 64 + 4 * expert, attention + 4 * 64 + 2 * expert
    ends = 2 * 512 * 64 + 64  # embedding, head, final norm
    assert count_parameters(shape) == 4 * layer + ends == 411_200
    assert active_parameters(shape) == 4 * active + ends == 263_744
    # forward FLOPs per sequence of 32 tokens: 2 per weight a token runs through, the attention core, the router
    s = 32
    per_token = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64) + 2 * 2 * s * 64 + 2 * 64 * 4 + 2 * 3 * 2 * 64 * 96
    logits = 2 * s * 64 * 512
    assert model_flops_per_step(shape, 1) == 3 * (4 * s * per_token + logits)


def test_one_expert_of_one_is_the_dense_model_plus_its_router():
    """A mixture of one expert routed to always is Llama's layer with a hidden x 1 router: one rule for both."""
    llama = Shape("llama", 4, 256, 8, 4, 688, 1000, 128)
    moe = dataclasses.replace(llama, family="mixtral", num_experts=1, top_k=1)
    assert count_parameters(moe) - count_parameters(llama) == 4 * 256
    assert active_parameters(moe) == count_parameters(moe)
    assert model_flops_per_step(moe, 2) - model_flops_per_step(llama, 2) == 2 * 3 * 4 * 128 * 2 * 256


def test_mfu_counts_active_flops_only():
    """Mixtral-8x7B: the FLOPs of a step are 6 x active parameters x tokens (plus attention), not total."""
    tokens = 512
    flops = model_flops_per_step(dataclasses.replace(MIXTRAL, seq_length=tokens), 1)
    assert flops == pytest.approx(6 * active_parameters(MIXTRAL) * tokens, rel=0.03)
    assert flops < 0.35 * 6 * count_parameters(MIXTRAL) * tokens


def test_experts_split_over_ep_and_dense_parts_over_tp():
    """Per GPU: the dense parameters divided by TP, the experts by EP and never by TP (the engine runs whole
    experts on every TP rank; Megatron's estimator got EP x ETP != TP wrong, Megatron-LM issue 4050)."""
    dense = count_parameters(MIXTRAL) - 32 * 8 * 3 * 4096 * 14336
    experts = 32 * 8 * 3 * 4096 * 14336
    vocab = 2 * 32000 * 4096
    assert stage_parameters(MIXTRAL, 1, 1, 1)[0] == pytest.approx(dense + experts)
    assert stage_parameters(MIXTRAL, 1, 1, 4)[0] == pytest.approx(dense + experts / 4)
    # TP 2 splits the attention and the vocabulary matrices, not the experts
    assert stage_parameters(MIXTRAL, 2, 1, 1)[0] == pytest.approx((dense - vocab) / 2 + vocab / 2 + experts, rel=1e-6)


def test_zero_shards_experts_over_the_ranks_holding_them():
    """ZeRO-3 over 8 data-parallel ranks with EP 4: dense states over 8, each expert's states over the 2 ranks
    holding it, the same bytes as EP 1 (everything over 8); only the layer ZeRO-3 gathers (and prefetches) in
    16 bits holds a quarter of the experts. ZeRO-0 keeps the experts' states whole per EP rank, a quarter of
    EP 1's."""
    z3 = [estimate_memory(MIXTRAL, Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=32, global_batch_size=64, zero_stage=3, ep=ep), HW).model_states_gib for ep in (1, 4)]
    layer_experts = 8 * 3 * 4096 * 14336
    assert z3[0] - z3[1] == pytest.approx(2 * 2 * layer_experts * 3 / 4 / 2**30, rel=1e-6)
    z0 = [estimate_memory(MIXTRAL, Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=32, global_batch_size=64, zero_stage=0, ep=ep), HW).model_states_gib for ep in (1, 4)]
    # fp32 weights, gradients and Adam moments (16 bytes) and the 16-bit compute copy data parallelism keeps (2)
    experts_gib = 32 * layer_experts * (16 + 2) / 2**30
    assert z0[0] - z0[1] == pytest.approx(experts_gib * 3 / 4, rel=0.01)


def test_expert_parallel_costs_the_all_to_all_and_the_imbalance():
    one = estimate_step_time(MIXTRAL, Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=64, zero_stage=3, ep=1), HW, 1)
    eight = estimate_step_time(MIXTRAL, Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=64, zero_stage=3, ep=8), HW, 1)
    assert one.ep_comm_s == 0 and eight.ep_comm_s > 0
    assert eight.dp_comm_s < one.dp_comm_s  # experts no longer gathered and reduced over all 8 ranks
    balanced = estimate_step_time(dataclasses.replace(MIXTRAL, expert_imbalance=1.0),
                                  Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=0, global_batch_size=64, zero_stage=3, ep=8), HW, 1)
    assert eight.compute_s > balanced.compute_s == pytest.approx(one.compute_s)
    # the group within a node talks over NVLink; 8 EP ranks on 4 GPUs per node cross the network
    four_per_node = dataclasses.replace(HW, gpus_per_node=4)
    layout = Layout.of(tp=1, pp=1, dp=16, mbs=1, act_ckpt_layers=0, global_batch_size=64, zero_stage=3, ep=8)
    assert ep_comm_s(MIXTRAL, layout, four_per_node) == pytest.approx(
        ep_comm_s(MIXTRAL, layout, HW) * HW.intra_node_bandwidth_gbps / HW.inter_node_bandwidth_gbps)


def plan(tmp_path, *overrides):
    cfg, name = compose(list(overrides))
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def rows(p):
    write_plan(p)
    with open(p.results_dir / "candidate_configs" / "plan.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_tiny_moe_plan_searches_ep_and_names_it(tmp_path):
    p = plan(tmp_path, "search_config=finetune/tiny_moe", "dry_run=true")
    table = rows(p)
    assert {r["ep"] for r in table} == {"1", "2"}
    assert {(r["experts"], r["top_k"], r["active_parameters"]) for r in table} == {("4", "2", "263744")}
    assert all(r["model_size_b"] == "0.000411" for r in table)
    ep2 = [s for s in p.specs if s.parallel.ep == 2]
    assert ep2 and all("_ep2_" in s.trial_id and s.model.num_experts == 4 and s.model.top_k == 2 for s in ep2)
    # ZeRO 0 and 3 are searched; the trial spec keeps the layout's EP
    assert {s.parallel.zero_stage for s in ep2} == {0, 3}


def test_mixtral_on_8_a100_fits_lora_not_full_without_offload(tmp_path):
    p = plan(tmp_path, "search_config=finetune/mixtral_8x7b", "dry_run=true",
             "search_config.train_settings.seq_lengths=[2048]", "search_config.train_settings.engines=[torch]",
             "search_config.train_settings.offload=[none]", "search_config.train_settings.zero_stages=[0,3]")
    fits = {c.full.method for c in p.candidates if c.status in ("selected", "over_limit")}
    assert fits == {"lora"}
    full = [c for c in p.candidates if c.full.method == "full" and c.memory_gib is not None]
    # full fine-tuning needs 16 bytes per parameter: 46.7B over 8 GPUs is 93 GiB before activations
    assert min(c.memory_gib for c in full) > 93


@pytest.mark.parametrize("overrides, key, words", [
    (["search_config.train_settings.expert_parallel_sizes=[3]"], "expert_parallel_sizes",
     "EP=3 does not divide the 4 experts"),
    (["search_config.train_settings.expert_parallel_sizes=[4]"], "expert_parallel_sizes",
     "EP=4 does not divide the DP=2 ranks"),
    (["search_config.train_settings.expert_parallel_sizes=[2]", "search_config.train_settings.engines=[deepspeed]"],
     "expert_parallel_sizes", "only the torch engine splits experts"),
    (["search_config.train_settings.expert_parallel_sizes=[2]", "search_config.train_settings.tensor_parallel_sizes=[2]"],
     "expert_parallel_sizes", "EP=2 does not divide the DP=1"),
    (["search_config.train_settings.engines=[deepspeed]", "search_config.train_settings.tensor_parallel_sizes=[2]",
      "search_config.train_settings.expert_parallel_sizes=[1]"], "expert_parallel_sizes",
     "AutoTP cannot split transformers' expert tensors"),
])
def test_bad_expert_parallel_sizes_are_refused_with_the_reason(tmp_path, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        plan(tmp_path, "search_config=finetune/tiny_moe", "dry_run=true", *overrides)
    assert key in err.value.key and words in str(err.value)


def test_ep_with_zero1_is_invalid_per_saver(tmp_path):
    p = plan(tmp_path, "search_config=finetune/tiny_moe", "dry_run=true", "search_config.train_settings.zero_stages=[1]")
    ep2 = [c for c in p.candidates if c.ep == 2]
    assert ep2 and all(c.status == "invalid" and "use ZeRO 0, 2 or 3" in c.reason for c in ep2)
    assert any(c.status == "selected" for c in p.candidates if c.ep == 1)


def test_qlora_on_experts_is_invalid_with_the_reason(tmp_path):
    p = plan(tmp_path, "search_config=finetune/tiny_moe", "dry_run=true", "search_config.train_settings.methods=[full,qlora]",
             "gpu=a10g_g5_4xlarge", "search_config.train_settings.precision=bf16")
    qlora = [c for c in p.candidates if c.full.method == "qlora"]
    assert qlora and all(c.status == "invalid" and "3-D parameters" in c.reason for c in qlora)


def test_ep_on_a_dense_model_is_invalid(tmp_path):
    with pytest.raises(ConfigError, match="no experts to split"):
        plan(tmp_path, "search_config=finetune/tiny", "dry_run=true", "search_config.train_settings.expert_parallel_sizes=[2]")


def test_top_k_above_the_experts_is_refused_before_planning(tmp_path):
    with pytest.raises(ConfigError) as err:
        plan(tmp_path, "search_config=moe/tiny", "search_config.model.top_k=5")
    assert err.value.key == "search_config.model.top_k"
    config = dict(load_hf_model("tiny_moe").config, num_experts_per_tok=5)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_hf_model(str(tmp_path / "bad"))


def test_experts_on_a_dense_family_are_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        plan(tmp_path, "search_config=llama/tiny", "search_config.model.num_experts=4")
    assert err.value.key == "search_config.model.num_experts"


def test_trial_spec_refuses_an_ep_the_model_cannot_split():
    model = ModelSpec("mixtral", 2, 64, 4, 2, 96, 256, 32, num_experts=4, top_k=2)
    with pytest.raises(ConfigError) as err:
        TrialSpec(model=model, parallel=ParallelSpec(dp=2, ep=2, zero_stage=1),
                  resources=ResourcesSpec(gpus_per_node=2), training=TrainingSpec(global_batch_size=4))
    assert err.value.key == "parallel.zero_stage" and "use ZeRO 0, 2 or 3" in str(err.value)
    with pytest.raises(ConfigError) as err:
        TrialSpec(model=dataclasses.replace(model, num_experts=6), parallel=ParallelSpec(dp=2, ep=4),
                  resources=ResourcesSpec(gpus_per_node=2), training=TrainingSpec(global_batch_size=4))
    assert err.value.key == "parallel.ep"


def test_offloaded_expert_shards_are_split_over_the_ranks_holding_them():
    """With EP 8 over 8 data-parallel ranks each expert lives on one rank: its offloaded states are whole there
    (host RAM and PCIe traffic of the experts / 8, not / 64), the dense ones split over all 8."""
    from hp_tool.estimate.memory import host_phases_gib
    from hp_tool.estimate.speed import offload_s

    one, eight = (Layout.of(tp=1, pp=1, dp=8, mbs=1, act_ckpt_layers=32, global_batch_size=64, zero_stage=3, offload="optimizer_and_params", ep=ep) for ep in (1, 8))
    assert offload_s(MIXTRAL, eight, HW) == pytest.approx(offload_s(MIXTRAL, one, HW), rel=0.01)
    assert host_phases_gib(MIXTRAL, eight, 8).train_gib == pytest.approx(host_phases_gib(MIXTRAL, one, 8).train_gib,
                                                                       rel=0.01)
