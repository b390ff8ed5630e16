"""Qwen3 planned from its Hugging Face config: the per-head q and k norms in the parameter count and in the
saved activations, checked against the traced engine (pure tracing under fake tensors: no process starts)."""

import dataclasses

import pytest

from hp_tool.families import llama, qwen3
from hp_tool.hf_config import load_hf_model
from trace_cache import traced_and_predicted
from trial_helpers import long_context_spec


def qwen3_spec(**layout):
    """2 Qwen3 layers at 2048 tokens x 2 sequences, 8 heads of 128 over a hidden size of 512 (the heads twice
    the hidden size, as Qwen3-0.6B's), 2 kv heads: q and k are wide enough that their norms weigh."""
    spec = long_context_spec(**layout)
    model = dataclasses.replace(spec.model, family="qwen3", hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                                kv_channels=128, ffn_hidden_size=1408, num_layers=2, vocab_size=2048,
                                seq_length=2048)
    return dataclasses.replace(spec, model=model)


def test_the_shipped_configs_read_as_qwen3_with_the_head_dim_apart():
    small, large = load_hf_model("qwen3_0_6b"), load_hf_model("qwen3_8b")
    assert (small.model_type, small.head_dim, small.hidden_size, small.tied_embeddings) == ("qwen3", 128, 1024, True)
    assert small.shape(2048).attention_dim == 2048 and large.shape(2048).kv_channels is None  # 32 x 128 = 4096
    shape = small.shape(2048)
    assert qwen3.layer_parameters(shape) - llama.layer_parameters(shape) == 2 * 128


CASES = [("cpu", {}), ("cuda", dict(dp=2, zero_stage=3)), ("cuda", dict(dp=2, zero_stage=3, tp=2))]
IDS = ["cpu", "fsdp2-gpu", "fsdp2-tp2-gpu"]


@pytest.mark.e2e
@pytest.mark.parametrize("device, layout", CASES, ids=IDS)
def test_the_memory_model_counts_what_the_qk_norms_keep(device, layout):
    """The whole peak within 3% of the trace, and what the norms add (Qwen3 against Llama's layers of the same
    shape) within 3% of what they add to the traced peak: a fifth of the activations here."""
    spec = qwen3_spec(**layout)
    as_llama = dataclasses.replace(spec, model=dataclasses.replace(spec.model, family="llama"))
    (traced, predicted), (traced_llama, predicted_llama) = (traced_and_predicted(s, device) for s in (spec, as_llama))
    assert predicted == pytest.approx(traced, rel=0.03)
    assert traced - traced_llama > 0.1 * traced
    assert predicted - predicted_llama == pytest.approx(traced - traced_llama, rel=0.03)


@pytest.mark.e2e
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_qwen3_moe_counts_what_its_qk_norms_keep_over_the_experts(device):
    """Qwen3-MoE against Mixtral's layers of the same shape (4 experts of 32, top-2, 8 heads of 128 over 512):
    what the per-head norms add to the traced peak, as the model adds it (within 3%)."""
    from trial_helpers import tiny_spec

    base = tiny_spec("moe")
    peaks = {}
    for family in ("qwen3_moe", "moe"):
        model = dataclasses.replace(base.model, family=family, hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                                    kv_channels=128, seq_length=1024)
        peaks[family] = traced_and_predicted(dataclasses.replace(base, model=model), device)
    (traced, predicted), (traced_mixtral, predicted_mixtral) = peaks["qwen3_moe"], peaks["moe"]
    assert traced - traced_mixtral > 0.05 * traced
    assert predicted - predicted_mixtral == pytest.approx(traced - traced_mixtral, rel=0.03)


@pytest.mark.e2e
@pytest.mark.parametrize("device, layout", CASES, ids=IDS)
def test_heads_wider_than_the_hidden_size_keep_their_width_in_the_attention(device, layout):
    """Llama's layers with 8 heads of 128 over a hidden size of 512: q and the attention's output are 1024 wide,
    not 512 (the formula took the hidden size: 5.3% low on CPU, where it is now exact; a GPU target's trace is
    1.9% under the model with the heads as wide as the hidden size, 2.4% with them twice as wide)."""
    spec = qwen3_spec(**layout)
    traced, predicted = traced_and_predicted(
        dataclasses.replace(spec, model=dataclasses.replace(spec.model, family="llama")), device)
    assert predicted == pytest.approx(traced, rel=0.001 if device == "cpu" else 0.03)
