"""Trials of a Hugging Face model start from its checkpoint: with the same weights, the trial's first loss is
transformers' own model's loss on the same batch, in every layout the grid produces (2 CPU processes, gloo;
GPUs are not here, so every layout runs in fp32)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from hp_tool.contracts.spec import ModelSpec
from hp_tool.errors import ConfigError
from trial_helpers import launched, read_metrics, read_result, tiny_spec, torchrun, write_spec

SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=176, vocab_size=512, max_position_embeddings=256)
# mixtures of experts: 4 experts of the dense FFN's width, top-2; Qwen2-MoE with a shared expert
EXPERTS = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
           "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=176,
                             shared_expert_intermediate_size=64),
           "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=176, norm_topk_prob=True)}
# Qwen3 with its heads wider than hidden / heads (4 heads of 32 over 64), as Qwen3-0.6B's 16 of 128 over 1024
HEAD_DIM = {"qwen3": dict(head_dim=32), "qwen3_moe": dict(head_dim=32), "gemma2": dict(head_dim=32),
            "gemma3_text": dict(head_dim=32)}
# Phi3Config's default padding token (32000) lies outside the tiny vocabulary
EXTRA = {"phi3": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
         # Gemma: windows shorter than the 64-token sequences, on layers the config lists in a pattern of its own
         # (neither Gemma-2's alternation nor Gemma-3's five in six, which the config would derive without the list);
         # Gemma-2's caps tight enough and its scores sharp enough (1/sqrt(head dim)) for each to move the loss
         # by more than the test's tolerance
         "gemma2": dict(sliding_window=4, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
                        final_logit_softcapping=3.0,
                        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
         "gemma3_text": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                              "sliding_attention"])}


def make_checkpoint(folder, model_type: str = "llama", tie: bool = False) -> dict:
    """A randomly initialised transformers model saved as a Hugging Face checkpoint: matrices 5x
    transformers' init (so the logits are far from uniform), norm weights and biases perturbed, so a
    parameter loaded into the wrong place changes the loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    config = AutoConfig.for_model(model_type, tie_word_embeddings=tie, **SHAPE, **EXPERTS.get(model_type, {}),
                                  **HEAD_DIM.get(model_type, {}), **EXTRA.get(model_type, {}))
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    model.save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


def spec_for(folder, config: dict, ep: int = 1, sequence_parallel: bool = False, **layout):
    spec = tiny_spec("llama", max_steps=1, **layout)
    m = spec.model
    model = ModelSpec(config["model_type"], m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads,
                      m.ffn_hidden_size, m.vocab_size, m.seq_length, qkv_bias=config["model_type"] in ("qwen2", "qwen2_moe"),
                      tied_embeddings=config["tie_word_embeddings"], hf_config=config, checkpoint=str(folder),
                      num_experts=config.get("num_local_experts", config.get("num_experts", 0)),
                      top_k=config.get("num_experts_per_tok", 0),
                      shared_expert_ffn_hidden_size=config.get("shared_expert_intermediate_size", 0),
                      kv_channels=HEAD_DIM.get(config["model_type"], {}).get("head_dim"))
    return dataclasses.replace(spec, model=model,
                               parallel=dataclasses.replace(spec.parallel, ep=ep, sequence_parallel=sequence_parallel),
                               trial_id=spec.trial_id.replace("llama", config["model_type"]))


def reference_loss(folder, spec) -> float:
    """transformers' own model, loaded from the checkpoint, on the trial's first global batch."""
    from transformers import AutoModelForCausalLM

    from hp_tool.trial.data import TokenBatches

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    whole = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, tp=1, pp=1, dp=1, engine="torch",
                                                                   sequence_parallel=False,
                                                                   zero_stage=0, offload="none", virtual_stages=1, ep=1),
                                resources=dataclasses.replace(spec.resources, num_nodes=1, gpus_per_node=1))
    (ids,), labels = TokenBatches(whole, 0, torch.device("cpu")).replica_batch(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return float(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def matrix(model_type, tie, layout):
    return pytest.param(model_type, tie, layout, marks=pytest.mark.matrix)


# The default run keeps a covering set (the cells not marked matrix): each family's loading code once (every model
# type of the list), and each layout once per engine (torch: DDP, FSDP2, TP with a tied head, TP with sequence
# parallelism, PP with a tied head apart from the embedding, EP over FSDP2 and over DDP; DeepSpeed: AutoTP with
# ZeRO-1, whose save consolidates the split weights as ZeRO-3's does). The other cells of the product are the
# matrix tier (-m matrix).
LAYOUTS = [
    matrix("llama", False, dict(dp=2, zero_stage=0)),  # DDP
    ("llama", False, dict(dp=2, zero_stage=3)),  # FSDP2
    matrix("llama", False, dict(dp=2, engine="deepspeed", zero_stage=1)),
    matrix("llama", False, dict(dp=2, engine="deepspeed", zero_stage=3)),
    ("qwen2", False, dict(tp=2, zero_stage=0)),  # TP splits the q/k/v biases with their columns
    ("qwen2", True, dict(pp=2, zero_stage=0)),  # a tied head on the last stage, apart from the embedding
    ("mistral", False, dict(tp=2, engine="deepspeed", zero_stage=1)),  # DeepSpeed's AutoTP
    # published MoE checkpoints store each expert's projections apart (as save_pretrained writes them): fused on
    # load, split over EP ranks
    ("mixtral", False, dict(dp=2, ep=2, zero_stage=3)),
    ("qwen2_moe", False, dict(dp=2, ep=2, zero_stage=0)),
    # per-head q and k norms, heads wider than hidden / heads: DDP, FSDP2, and TP (the norms whole beside each
    # rank's heads) with a tied head
    matrix("qwen3", False, dict(dp=2, zero_stage=0)),
    matrix("qwen3", False, dict(dp=2, zero_stage=3)),
    ("qwen3", True, dict(tp=2, zero_stage=0)),
    # fused q/k/v and gate/up (no TP for the family): DDP, FSDP2, and pipeline stages
    ("phi3", False, dict(dp=2, zero_stage=0)),
    matrix("phi3", False, dict(dp=2, zero_stage=3)),
    matrix("phi3", False, dict(pp=2, zero_stage=0)),
    # Gemma-2 (eager attention with soft-capped scores, soft-capped logits, scaled embeddings, windows) and Gemma-3
    # (per-head norms, local and global RoPE): DDP, FSDP2, TP with sequence parallelism (the four norms on shards)
    ("gemma2", True, dict(dp=2, zero_stage=0)),
    matrix("gemma2", True, dict(dp=2, zero_stage=3)),
    matrix("gemma2", True, dict(tp=2, zero_stage=0, sequence_parallel=True)),
    matrix("gemma3_text", True, dict(dp=2, zero_stage=3)),
    ("gemma3_text", True, dict(tp=2, zero_stage=0, sequence_parallel=True)),
    # Qwen3-MoE: the per-head norms over routed experts stored per expert, split over EP ranks
    ("qwen3_moe", False, dict(dp=2, ep=2, zero_stage=0)),
]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("model_type, tie, layout", LAYOUTS)
def test_first_loss_equals_transformers_on_the_checkpoint(tmp_path, model_type, tie, layout):
    config = make_checkpoint(tmp_path / "model", model_type, tie)
    spec = spec_for(tmp_path / "model", config, **layout)
    spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, save_dir=str(tmp_path / "saved")))
    proc = torchrun(write_spec(spec, tmp_path), tmp_path / "out", 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert read_result(tmp_path / "out")["status"] == "ok"
    first = read_metrics(tmp_path / "out")[0]["loss"]
    expected = reference_loss(tmp_path / "model", spec)
    assert first == pytest.approx(expected, rel=1e-4)
    assert expected > 6.238 + 0.2  # random labels: sharp logits cost more than ln 512, so these are the checkpoint's
    assert_saved_after_one_step(tmp_path / "model", tmp_path / "saved")


def assert_saved_after_one_step(original, saved):
    """The run's saved checkpoint loads in transformers with every tensor, each moved by one AdamW step
    (at most lr = 1e-3 per element, plus weight decay) from the checkpoint it started from."""
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).state_dict()
    model, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in after.items():
        step = (value - before[name]).abs().max().item()
        assert 0 < step < 2e-3, (name, step)


def test_a_checkpoint_of_another_model_is_named(tmp_path):
    from hp_tool.trial.checkpoint import check_checkpoint

    config = make_checkpoint(tmp_path / "model")
    spec = spec_for(tmp_path / "model", config)
    check_checkpoint(spec.model, tmp_path / "model")  # the right one passes
    wider = dataclasses.replace(spec.model, ffn_hidden_size=192, hf_config={**config, "intermediate_size": 192})
    with pytest.raises(ConfigError) as err:
        check_checkpoint(wider, tmp_path / "model")
    assert err.value.key == "model.checkpoint" and "[176, 64] in the checkpoint but [192, 64]" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_checkpoint(spec.model, tmp_path)
    assert "has no model.safetensors" in str(err.value)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(dp=2, zero_stage=1), dict(dp=2, engine="deepspeed", zero_stage=2)])
def test_sgd_with_momentum_trains_in_the_sharded_layouts(tmp_path_factory, layout):
    """SGD (momentum 0.9) through torch's ZeRO-1 (ZeroRedundancyOptimizer) and DeepSpeed ZeRO-2: the first
    loss is the model's, later steps follow SGD, not AdamW."""
    losses = {}
    for optimizer in ("adamw", "sgd_momentum"):
        # 2 untimed steps: a spec another test launches too (the same dict) runs once a session (launched)
        spec = tiny_spec("llama", max_steps=3, warmup_steps=2, **layout)
        spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training, optimizer=optimizer))
        run = launched(tmp_path_factory, spec)
        assert run.returncode == 0, run.stderr[-4000:]
        losses[optimizer] = [m["loss"] for m in run.metrics()]
    assert losses["adamw"][0] == pytest.approx(losses["sgd_momentum"][0], rel=1e-6)
    assert abs(losses["adamw"][2] - losses["sgd_momentum"][2]) > 1e-4
