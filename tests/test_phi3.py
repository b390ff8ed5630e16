"""Phi-3 planned from its Hugging Face config: the fused q/k/v and gate/up projections as peft names them, TP
refused with its reason, and what a layer keeps for backward checked against the traced engine (pure tracing
under fake tensors: no process starts)."""

import dataclasses

import pytest

from hp_tool.estimate.layout import Layout
from hp_tool.estimate.memory import estimate_memory
from hp_tool.families import phi3
from hp_tool.hf_config import load_hf_model
from hp_tool.trial.memterms import target_hardware, target_layout
from hp_tool.trial.trace.replay import trace_stage
from trial_helpers import long_context_spec, tiny_spec

FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def phi3_spec(family: str = "phi3", **layout):
    """2 layers at 2048 tokens x 2 sequences, 8 heads over a hidden size of 512, 2 kv heads (q 512 and k 128
    wide, so the fused buffer and the copied attention output weigh)."""
    spec = long_context_spec(**layout)
    model = dataclasses.replace(spec.model, family=family, hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                                ffn_hidden_size=1408, num_layers=2, vocab_size=2048, seq_length=2048)
    return dataclasses.replace(spec, model=model)


def test_the_shipped_config_reads_as_phi3_with_its_fused_linears():
    hf = load_hf_model("phi3_mini_4k")
    assert (hf.model_type, hf.num_kv_heads, hf.tied_embeddings, hf.sliding_window) == ("phi3", 32, False, 2047)
    shape = hf.shape(2047)
    assert tuple(phi3.linear_shapes(shape)) == FUSED
    assert phi3.linear_shapes(shape)["qkv_proj"] == (3072, 3 * 3072)
    assert phi3.linear_shapes(shape)["gate_up_proj"] == (3072, 2 * 8192)


def test_tp_is_refused_with_its_reason_and_tp1_is_not():
    shape = load_hf_model("phi3_mini_4k").shape(2047)
    refused = Layout.of(tp=2, pp=1, dp=4, mbs=1, global_batch_size=64).problems(shape)
    assert [(p.field, p.rule) for p in refused] == [("tp", "family")]
    assert "fused qkv_proj and gate_up_proj" in refused[0].reason
    assert Layout.of(tp=1, pp=1, dp=8, mbs=1, global_batch_size=64).problems(shape) == []


@pytest.mark.e2e
@pytest.mark.parametrize("device, layout", [("cpu", {}), ("cuda", dict(dp=2, zero_stage=3))], ids=["cpu", "fsdp2-gpu"])
def test_the_memory_model_counts_the_fused_buffer_and_the_copied_attention_output(device, layout):
    """What Phi-3 keeps beyond Llama's layers of the same shape, the model against the trace (within 2%; exact
    on CPU), and the whole peak within 3%."""
    peaks = {}
    for family in ("phi3", "llama"):
        spec = phi3_spec(family, **layout)
        traced = trace_stage(spec, 0, device).peak_bytes
        predicted = estimate_memory(spec.model.shape(), target_layout(spec, device),
                                    target_hardware(device)).total_gib * 2**30
        peaks[family] = traced, predicted
    (traced, predicted), (traced_llama, predicted_llama) = peaks["phi3"], peaks["llama"]
    assert predicted == pytest.approx(traced, rel=0.03)
    assert traced - traced_llama > 0.03 * traced
    assert predicted - predicted_llama == pytest.approx(traced - traced_llama, rel=0.02)
