"""Components of the trial engine, in process: model stages, weights, data, schedule, stop rule."""

from __future__ import annotations

import resource

import pytest
import torch

from hp_tool.architectures import count_parameters
from hp_tool.trial import measure
from hp_tool.trial.data import TokenBatches
from hp_tool.trial.models import build_full_model_on_meta, build_stage, loss_fn
from hp_tool.trial.optim import lr_at
from hp_tool.contracts.result import RESULT_FIELDS, describe_failure, empty_result, throughput
from hp_tool.contracts.spec import ModelSpec, RunSpec, TrainingSpec
from hp_tool.trial.weights import init_weights
from trial_helpers import tiny_spec

GPT3_175B = ModelSpec(family="gpt3", num_layers=96, hidden_size=12288, num_attention_heads=96,
                      num_kv_heads=96, ffn_hidden_size=49152, vocab_size=51200, seq_length=2048)


def test_175b_builds_on_meta_without_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = build_full_model_on_meta(GPT3_175B)
    assert all(p.is_meta for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    # exact: GPT-3's one position row per position (OPT's own table held 2 more, 24,576 parameters here)
    assert numel == count_parameters(GPT3_175B.shape()) == 174_615_846_912
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / 2**30
    assert grown_gib < 1.0  # 175B fp32 would be 700 GiB


def test_175b_stage_keeps_only_its_layers():
    middle = build_stage(GPT3_175B, pp=48, stage=20)
    assert list(middle.layers) == ["40", "41"]
    assert middle.embed_tokens is None and middle.lm_head is None and middle.norm is None
    h, f = GPT3_175B.hidden_size, GPT3_175B.ffn_hidden_size
    per_layer = 4 * h * h + 2 * h * f + 9 * h + f  # q,k,v,o + fc1,fc2 + biases and norms
    assert sum(p.numel() for p in middle.parameters()) == 2 * per_layer
    last = build_stage(GPT3_175B, pp=48, stage=47)
    assert last.lm_head is not None and last.norm is not None and last.embed_tokens is None


def test_materialised_stage_matches_the_transformers_model():
    spec = tiny_spec("llama")
    stage = build_stage(spec.model, pp=1, stage=0)
    stage.to_empty(device=torch.device("cpu"))
    stage.retie()
    stage.reset_buffers(torch.device("cpu"))
    init_weights(stage, seed=1, std=0.02, tied=stage.tied)
    from transformers import LlamaForCausalLM

    from hp_tool.trial.models import hf_config

    reference = LlamaForCausalLM(hf_config(spec.model))
    state = {k.removeprefix("model."): v for k, v in reference.state_dict().items()}
    reference.load_state_dict({("model." + k if not k.startswith("lm_head") else k): v
                               for k, v in stage.state_dict().items()})
    assert set(state) == set(stage.state_dict())
    tokens = torch.randint(0, spec.model.vocab_size, (2, spec.model.seq_length))
    torch.testing.assert_close(stage(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_tied_gpt_head_shares_the_embedding_after_materialising():
    stage = build_stage(tiny_spec("gpt3").model, pp=1, stage=0)
    stage.to_empty(device=torch.device("cpu"))
    stage.retie()
    assert stage.lm_head.weight is stage.embed_tokens.weight


def test_weights_do_not_depend_on_the_stage_split():
    spec = tiny_spec("gpt3")
    whole = build_stage(spec.model, pp=1, stage=0)
    second = build_stage(spec.model, pp=2, stage=1)
    for stage in (whole, second):
        stage.to_empty(device=torch.device("cpu"))
        stage.retie()
        init_weights(stage, seed=7, std=0.02, tied=stage.tied)
    torch.testing.assert_close(second.layers["3"].fc1.weight, whole.layers["3"].fc1.weight)
    torch.testing.assert_close(second.lm_head.weight, whole.embed_tokens.weight)


def test_global_batch_is_the_same_whatever_the_layout():
    single = TokenBatches(tiny_spec("gpt3", mbs=2), dp_rank=0, device=torch.device("cpu"))
    whole = torch.cat([x for (x,), _ in single.micro_batches(step=3)])
    shards = [TokenBatches(tiny_spec("gpt3", dp=2, mbs=1), dp_rank=d, device=torch.device("cpu"))
              for d in range(2)]
    split = torch.cat([torch.cat([x for (x,), _ in s.micro_batches(step=3)]) for s in shards])
    assert torch.equal(whole, split)
    (inputs,), labels = single.replica_batch(step=0)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are the next tokens


def test_token_file_is_memory_mapped(tmp_path):
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.arange(10_000, dtype=np.uint16).tofile(path)
    spec = tiny_spec("gpt3")
    spec.training.data.source, spec.training.data.path = "file", str(path)
    batches = TokenBatches(spec, dp_rank=0, device=torch.device("cpu"))
    assert isinstance(batches.stream, np.memmap)
    (inputs,), _ = batches.replica_batch(step=0)
    assert inputs[1, 0].item() == 65  # second window starts at seq + 1


def test_learning_rate_schedule():
    t = TrainingSpec(lr=1.0, min_lr=0.1, warmup_steps=10, constant_steps=5, max_steps=115)
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(14, t) == 1.0
    assert lr_at(65, t) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_at(115, t) == pytest.approx(0.1) and lr_at(500, t) == pytest.approx(0.1)


def test_stop_rule_order_and_stability():
    rule = measure.StopRule(RunSpec(max_steps=10, stable_window=3, stable_cv=0.05), budget_s=100.0,
                            warmup=2)
    assert rule.reason(3, 1.0, 0.1, [1.0], signalled=False) is None
    assert rule.reason(5, 1.0, 0.1, [1.0, 1.01, 0.99], signalled=False) == "stable"
    assert rule.reason(5, 1.0, 0.1, [1.0, 2.0, 0.5], signalled=False) is None
    assert rule.reason(5, 99.5, 1.0, [1.0], signalled=False) == "time_budget"
    assert rule.reason(10, 1.0, 0.1, [], signalled=False) == "max_steps"
    assert rule.reason(4, 1.0, 0.1, [], signalled=True) == "signal"
    assert measure.time_budget_s(RunSpec(max_minutes=30)) == 30 * 60 - 60


def test_throughput_and_failures():
    spec = tiny_spec("gpt3")
    assert throughput(spec, None, 2) == dict.fromkeys(throughput(spec, None, 2))
    rates = throughput(spec, 0.5, 2)
    assert rates["tokens_per_s_per_gpu"] == spec.training.global_batch_size * 64 / 0.5 / 2
    assert set(empty_result(spec.trial_id)) == set(RESULT_FIELDS)
    assert describe_failure(MemoryError("x"), 3)["status"] == "oom"
    failure = describe_failure(ValueError("bad value"), 1)
    assert failure["status"] == "failed" and failure["reason"].startswith("rank 1: ValueError: bad")


def test_loss_is_mean_token_cross_entropy():
    logits = torch.zeros(2, 3, 4)
    assert loss_fn(logits, torch.zeros(2, 3, dtype=torch.long)).item() == pytest.approx(1.3862944)


@pytest.mark.parametrize("change, key", [
    ({"pp": 1, "dp": 2, "vp": 2}, "parallel.virtual_stages"),  # no pipeline to interleave
    ({"pp": 2, "vp": 4}, "parallel.virtual_stages"),  # 2 layers per stage
    ({"pp": 2, "vp": 2, "act_ckpt": 1}, "parallel.act_ckpt_layers"),  # one chunk would recompute, one not
    ({"pp": 2, "vp": 2, "gbs": 10}, "training.global_batch_size"),  # 5 micro-batches in rounds of 2
])
def test_a_layout_interleaved_1f1b_cannot_run_is_refused_with_its_key(change, key):
    from hp_tool.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        tiny_spec("gpt3", **change)
    assert err.value.key == key
