"""Gemma-2 and Gemma-3 planned from their Hugging Face configs: transformers' parameter counts (a config no preset
ships among them), the windows the trials run, and what a layer keeps for backward (four norms, Gemma-2's eager
attention with its scores, Gemma-3's per-head norms, the soft-capped logits) against the traced engine (pure
tracing under fake tensors: no process starts)."""

import dataclasses
import json

import pytest

from hp_tool.architectures import count_parameters
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import Layout
from hp_tool.hf_config import load_hf_model
from test_finetune import transformers_count
from trace_cache import traced_and_predicted
from trial_helpers import long_context_spec

# published configs no preset ships: Gemma-2 2B (google/gemma-2-2b: 2.61B) and 27B (its query scale apart from the
# head dim: 27.2B), Gemma-3 4B's text model (google/gemma-3-4b-pt's text_config: 3.88B of its 4.3B with vision)
UNSHIPPED = {
    "gemma2_2b": dict(model_type="gemma2", hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000,
                      max_position_embeddings=8192, query_pre_attn_scalar=256, sliding_window=4096),
    "gemma2_27b": dict(model_type="gemma2", hidden_size=4608, num_hidden_layers=46, num_attention_heads=32,
                       num_key_value_heads=16, head_dim=128, intermediate_size=36864, vocab_size=256000,
                       max_position_embeddings=8192, query_pre_attn_scalar=144, sliding_window=4096),
    "gemma3_4b": dict(model_type="gemma3_text", hidden_size=2560, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, intermediate_size=10240, vocab_size=262208,
                      max_position_embeddings=131072, sliding_window=1024,
                      rope_scaling={"factor": 8.0, "rope_type": "linear"}),
}
CARDS = {"gemma2_2b": 2_614_341_888, "gemma2_27b": 27_227_128_320, "gemma3_4b": 3_880_263_168}


@pytest.mark.parametrize("name", sorted(UNSHIPPED))
def test_a_config_no_preset_ships_plans_with_transformers_count(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(UNSHIPPED[name]))
    hf = load_hf_model(str(tmp_path))
    assert count_parameters(hf.shape(4096)) == transformers_count(UNSHIPPED[name]) == CARDS[name]
    assert hf.tied_embeddings and hf.shape(4096).kv_channels == UNSHIPPED[name]["head_dim"]


def test_sequences_beyond_the_window_run_it_and_a_soft_capped_gemma3_is_refused(tmp_path):
    """Gemma's trials run each sliding layer's window (Mistral's are refused beyond theirs), so 8192 tokens over
    Gemma-2's 4096-token window plan; Gemma-3 with Gemma-2's score cap would need the eager kernel."""
    gemma2 = load_hf_model("gemma2_9b")
    gemma2.check_seq_length(8192, "train_settings.seq_lengths")
    with pytest.raises(ConfigError, match="sliding attention window of 4096"):
        load_hf_model("mistral_7b").check_seq_length(8192, "train_settings.seq_lengths")
    (tmp_path / "config.json").write_text(json.dumps({**UNSHIPPED["gemma3_4b"], "attn_logit_softcapping": 50.0}))
    with pytest.raises(ConfigError, match="attn_logit_softcapping=true describes layers"):
        load_hf_model(str(tmp_path))


def test_gemma2_refuses_selective_checkpointing_and_context_parallelism():
    """The eager attention is not the one SDPA call the selective policy counts on; the ring applies no caps."""
    shape = load_hf_model("gemma2_9b").shape(4096)
    problems = Layout.of(tp=1, pp=1, dp=8, mbs=1, global_batch_size=64, act_ckpt_mode="selective").problems(shape)
    assert [p.field for p in problems] == ["act_ckpt_mode"]
    problems = Layout.of(tp=1, pp=1, dp=4, cp=2, mbs=1, global_batch_size=64).problems(shape)
    assert [p.field for p in problems] == ["cp"]


def gemma_spec(family: str, **layout):
    """2 layers at 512 tokens x 2 sequences, 8 heads of 64 over a hidden size of 256 (2 kv heads), tied: the
    scores of the eager attention weigh as much as the rest of the layer."""
    spec = long_context_spec(**layout)
    model = dataclasses.replace(spec.model, family=family, hidden_size=256, num_attention_heads=8, num_kv_heads=2,
                                kv_channels=64, ffn_hidden_size=704, num_layers=2, vocab_size=2048, seq_length=512,
                                tied_embeddings=True)
    return dataclasses.replace(spec, model=model)


CASES = [("cpu", {}), ("cpu", dict(tp=2)), ("cuda", dict(dp=2, zero_stage=3)), ("cuda", dict(dp=2, zero_stage=3, tp=2))]
IDS = ["cpu", "tp2-cpu", "fsdp2-gpu", "fsdp2-tp2-gpu"]
# The covering set (the default run): each family on CPU (one process, the 1% check) and on a GPU with FSDP2 and
# TP 2 together (each parallelism once); TP 2 alone on CPU and FSDP2 alone on a GPU are the matrix tier (-m matrix).
COVERED = {"cpu", "fsdp2-tp2-gpu"}


@pytest.mark.e2e  # traces the model
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
@pytest.mark.parametrize("device, layout", [
    pytest.param(*case, id=name, marks=() if name in COVERED else pytest.mark.matrix) for case, name in zip(CASES, IDS)])
def test_the_memory_model_counts_what_gemma_keeps(family, device, layout):
    """What Gemma keeps beyond Llama's layers of the same shape (Gemma-2: a third of the peak, Gemma-3: a seventh),
    the model against the trace within 4% (within 1% on CPU), the whole peak within 4%."""
    spec = gemma_spec(family, **layout)
    as_llama = dataclasses.replace(spec, model=dataclasses.replace(spec.model, family="llama"))
    (traced, predicted), (traced_llama, predicted_llama) = (traced_and_predicted(s, device) for s in (spec, as_llama))
    assert predicted == pytest.approx(traced, rel=0.04)
    assert traced - traced_llama > (0.3 if family == "gemma2" else 0.12) * traced
    assert predicted - predicted_llama == pytest.approx(traced - traced_llama, rel=0.04 if device == "cuda" else 0.01)


# the covering set: a GPU's (FSDP2 over 2); one process on CPU is the matrix tier (-m matrix)
@pytest.mark.e2e  # traces the model
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.matrix), "cuda"])
def test_with_the_chunked_loss_the_eager_backward_holds_the_peak_and_is_bounded(device):
    """With the logits chunked away, Gemma-2's peak is its eager attention's backward: the model holds it from
    above, within 5% (it leaves out what the layer has freed by then)."""
    layout = dict(loss="chunked", loss_chunk_tokens=128, **({} if device == "cpu" else dict(dp=2, zero_stage=3)))
    traced, predicted = traced_and_predicted(gemma_spec("gemma2", **layout), device)
    assert traced <= predicted <= 1.05 * traced
