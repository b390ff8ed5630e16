"""T5 and mT5 (encoder-decoder) end to end: presets, NeMo's sizes and layer search, parameter and FLOP
counts, the per-stage memory model, bad input, and whole t5/tiny (default run) and mt5/tiny (matrix tier)
searches on this machine."""

import json

import pandas as pd
import pytest
import torch

from hp_tool.architectures import (Shape, checkpointed_layer_counts, count_parameters, model_flops_per_step,
                                   pipeline_problem, stage_layer_counts)
from hp_tool.cli import available_search_configs, compose
from hp_tool.config import to_app_config
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.memory import estimate_memory, stage_activation_bytes
from hp_tool.planner import make_plan
from hp_tool.sizing import recommend_model_size_b
from hp_tool.contracts.spec import load_spec
from search_helpers import main_here
from trial_helpers import torchrun

TS = "search_config.train_settings"
PRESETS = {"t5": ("tiny", "220m", "3b", "11b", "23b", "41b", "unknown_size"),
           "mt5": ("tiny", "170m", "390m", "3b", "11b", "23b", "unknown_size")}
H100 = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=989, intra_node_bandwidth_gbps=450,
                inter_node_bandwidth_gbps=50, memory_overhead_gib=3.0)


def plan(tmp_path, *overrides):
    cfg, name = compose(["cluster=bcm", "cluster.slurm.partition=batch", *overrides])
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def nemo_flops(L, h, F, V, s_e, s_d, B):
    """REFERENCE §10, NeMo's model FLOPs of a T5 step (A = h)."""
    enc = 8 * B * s_e * h**2 + 4 * B * s_e**2 * h + 6 * B * s_e * h * F
    dec = (8 * B * s_d * h**2 + 4 * B * s_d**2 * h + (4 * B * s_e * h**2 + 4 * B * s_d * h**2 + 4 * B * s_e * s_d * h)
           + 6 * B * s_d * h * F)
    return 3 * (L * (enc + dec) + 2 * B * s_d * h * V)


@pytest.mark.e2e  # a sweep of every shipped preset
@pytest.mark.parametrize("family, size", [(f, s) for f, sizes in PRESETS.items() for s in sizes])
def test_every_t5_and_mt5_preset_plans(tmp_path, family, size):
    assert f"{family}/{size}" in available_search_configs()
    p = plan(tmp_path, f"search_config={family}/{size}")
    shape = p.model.shape
    assert shape.family == family and shape.encoder_decoder and p.specs
    assert shape.vocab_size == {"t5": 29000 if size != "tiny" else 512, "mt5": 250000 if size != "tiny" else 2048}[family]
    assert (shape.seq_length, shape.decoder_seq_length) == ((512, 128) if size != "tiny" else (64, 32))
    assert p.base.model.decoder_seq_length == shape.decoder_seq_length
    for spec in p.specs:  # every selected layout splits both stacks
        assert pipeline_problem(shape, spec.parallel.pp) is None
        assert spec.parallel.pp == 1 or spec.parallel.pp % 2 == 0


@pytest.mark.parametrize("size, layers, hidden", [(0.22, 12, 768), (2.8, 24, 2048), (11, 24, 4096)])
def test_t5_layer_search_check_values(tmp_path, size, layers, hidden):
    p = plan(tmp_path, "search_config=t5/220m", f"{TS}.model_size_in_b={size}")
    shape = p.model.shape
    assert (shape.num_layers, shape.hidden_size, shape.head_dim) == (layers, hidden, 64)
    base = p.base
    assert base.model.init_method_std == 0.015 and base.training.lr == 1e-4
    assert base.training.warmup_steps == int(0.01 * base.training.max_steps) and base.training.constant_steps == 0


def test_t5_base_config_takes_gbs_tp_pp_from_the_table(tmp_path):
    p = plan(tmp_path, "search_config=t5/11b")  # 11 <= 11.5: GBS 1920, TP 4, PP 1
    assert p.base.training.global_batch_size == 1920
    assert (p.base.parallel.tp, p.base.parallel.pp) == (4, 1)
    assert p.base.training.max_steps == int(1000e9 / (512 * 1920))


def test_mt5_unknown_size_recommends_the_size_of_the_087_factor(tmp_path):
    p = plan(tmp_path, "search_config=mt5/unknown_size")
    expected = recommend_model_size_b("mt5", 10, 160, 140, 1000)  # 20 nodes x 8 A100 at 140 TFLOPS
    assert p.model.size_b == expected == round(0.87 * 10 * 86400 * 160 * 140e12 / (8 * 1000e9) / 1e9, 2)
    t5 = plan(tmp_path, "search_config=t5/unknown_size", f"{TS}.num_nodes=20", f"{TS}.max_training_days=10")
    assert p.model.size_b < t5.model.size_b  # the same budget buys a smaller mT5
    assert "Recommended model size" in p.sentence and "per stack" in p.sentence


@pytest.mark.parametrize("family", ["t5", "mt5"])
def test_parameter_count_is_the_real_models(family):
    from hp_tool.trial.models import build_full_model_on_meta
    from hp_tool.contracts.spec import ModelSpec

    model = ModelSpec(family=family, num_layers=24, hidden_size=4096, num_attention_heads=64, num_kv_heads=64,
                      ffn_hidden_size=10240, vocab_size=250000 if family == "mt5" else 29000, seq_length=512,
                      kv_channels=64, decoder_seq_length=128)
    real = sum(p.numel() for p in build_full_model_on_meta(model).parameters())  # tied weights once
    assert count_parameters(model.shape()) == real


def test_encoder_decoder_flops_are_nemos():
    shape = Shape("t5", 24, 4096, 64, 64, 10240, 29000, 512, 64, 128)  # 64 heads x 64 = hidden: NeMo's case
    assert model_flops_per_step(shape, 1920) == pytest.approx(nemo_flops(24, 4096, 10240, 29000, 512, 128, 1920))
    longer = Shape("t5", 24, 4096, 64, 64, 10240, 29000, 512, 64, 256)
    assert model_flops_per_step(longer, 1920) > model_flops_per_step(shape, 1920)  # the decoder length counts


def test_pipeline_stages_split_the_two_stacks():
    shape = Shape("t5", 6, 64, 4, 4, 128, 512, 64, 16, 32)
    assert pipeline_problem(shape, 3) and "cannot split the encoder and decoder" in pipeline_problem(shape, 3)
    assert pipeline_problem(shape, 4) is None and pipeline_problem(shape, 8) is not None  # 4 does not divide 6
    assert [stage_layer_counts(shape, 6, s) for s in range(6)] == [(2, 0)] * 3 + [(0, 2)] * 3
    assert stage_layer_counts(shape, 1, 0) == (6, 6)
    assert checkpointed_layer_counts(shape, 1, 0, 5) == (3, 2)  # both stacks on one stage share them
    assert checkpointed_layer_counts(shape, 2, 1, 5) == (0, 5)


def test_memory_model_uses_each_stacks_length_and_the_vocabulary():
    t5 = Shape("t5", 24, 4096, 64, 64, 10240, 29000, 512, 64, 128)
    mt5 = Shape("mt5", 24, 4096, 64, 64, 10240, 250000, 512, 64, 128)
    layout = Layout.of(tp=4, pp=2, dp=20, mbs=4, act_ckpt_layers=0, global_batch_size=1920)
    logits = estimate_memory(mt5, Layout.of(tp=4, pp=1, dp=40, mbs=4, act_ckpt_layers=0, global_batch_size=1920), H100).logits_gib
    # the decoder's 128 tokens, vocab-parallel: 16 bytes per local logit (memory.WHOLE_LOSS_BYTES under TP)
    assert logits == pytest.approx(4 * 128 * 250000 * 16 / 4 / 2**30)
    # the encoder stage does not see the decoder length; the decoder stage does
    longer = Shape("t5", 24, 4096, 64, 64, 10240, 29000, 512, 64, 256)
    assert stage_activation_bytes(longer, layout, H100, 0) == stage_activation_bytes(t5, layout, H100, 0)
    assert stage_activation_bytes(longer, layout, H100, 1)[0] > stage_activation_bytes(t5, layout, H100, 1)[0]
    # checkpointing every layer leaves only the layers' inputs (plus the encoder output for cross-attention)
    full = Layout.of(tp=4, pp=2, dp=20, mbs=4, act_ckpt_layers=24, global_batch_size=1920)
    stored, buffer = stage_activation_bytes(t5, full, H100, 1)
    assert stored == pytest.approx(24 * 4 * 128 * 4096 * 2 + 4 * 512 * 4096 * 2)
    assert buffer > 0


@pytest.mark.parametrize("override, key, words", [
    # refused by the planner: a command that would launch trials has started the warm process by then (a forkserver)
    pytest.param(f"{TS}.pipeline_parallel_sizes=[3]", f"{TS}.pipeline_parallel_sizes",
                 "cannot split the encoder and decoder", marks=pytest.mark.e2e),
    pytest.param(f"{TS}.tensor_parallel_sizes=[3]", f"{TS}.tensor_parallel_sizes", "TP=3 does not divide the 4 heads",
                 marks=pytest.mark.e2e),
    pytest.param(f"{TS}.engines=[deepspeed]", f"{TS}.engines", "torch engine only", marks=pytest.mark.e2e),
    (f"{TS}.decoder_seq_length=0", f"{TS}.decoder_seq_length", "not a usable decoder length"),
    (f"{TS}.seq_length=-8", f"{TS}.seq_length", "not a usable sequence length"),
    ("run_inference_hp_search=true", "run_inference_hp_search", "inference search covers decoder-only"),
])
def test_bad_t5_input_names_key_value_and_fix_before_any_file(tmp_path, override, key, words):
    proc = main_here("search_config=t5/tiny", "cluster=local", f"base_results_dir={tmp_path / 'res'}", override,
                     cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    assert proc.stderr.startswith(f"hp_tool: error: {key}=") and words in proc.stderr and "Fix:" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_decoder_length_belongs_to_encoder_decoders_only(tmp_path):
    with pytest.raises(ConfigError) as exc:
        plan(tmp_path, "search_config=gpt3/tiny", f"{TS}.decoder_seq_length=64")
    assert exc.value.key == f"{TS}.decoder_seq_length" and "only encoder-decoder" in str(exc.value)


@pytest.mark.e2e
@pytest.mark.parametrize("family, runs", [
    # the covering set: t5, the encoder-decoder code path (hp_tool/trial/families/t5.py registers t5 and mt5
    # through one builder: the same stage, TP plan and memory model, another transformers class and vocabulary;
    # test_encoder_decoder_stage_matches_the_transformers_model checks both classes); mt5's search: the matrix tier
    ("t5", 3),
    pytest.param("mt5", 2, marks=pytest.mark.matrix),
])
def test_tiny_search_end_to_end_and_the_optimal_config_trains(tmp_path, warm_process, family, runs):
    """A whole tiny search on the local backend (the CLI's entry in this process; trials of 2 CPU processes each),
    then its optimal config trained for 3 steps by the engine on as many ranks as it names (forked as torchrun
    starts them)."""
    proc = main_here(f"search_config={family}/tiny", "cluster=local", f"{TS}.limit_search_runs={runs}",
                     f"{TS}.max_steps_per_run=6", f"{TS}.search_strategy=exhaustive",
                     f"base_results_dir={tmp_path / 'res'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "res" / family / "tiny"
    summary = pd.read_csv(out / "final_results" / "final_summary_1nodes.csv")
    assert len(summary) == runs and set(summary["status"]) == {"ok"}
    assert list(summary["rank"]) == list(range(1, runs + 1))
    assert summary["measured_step_time_s"].is_monotonic_increasing
    # MFU counts the encoder-decoder's FLOPs (NeMo's formula: 4 heads x 16 channels = hidden 64)
    vocab = 2048 if family == "mt5" else 512
    for row in summary.itertuples():
        flops = nemo_flops(2, 64, 128, vocab, 64, 32, row.global_batch_size)
        assert row.model_tflops_per_gpu == pytest.approx(flops / row.measured_step_time_s / row.num_gpus / 1e12,
                                                         rel=1e-4)
    [optimal] = (out / "final_results").glob("optimal_config_*_1nodes.yaml")
    spec = load_spec(optimal)
    assert spec.model.family == family and spec.model.decoder_seq_length == 32 and spec.model.kv_channels == 16
    assert spec.trial_id == summary.iloc[0]["trial_id"]
    spec_path = tmp_path / "short.yaml"
    spec_path.write_text(optimal.read_text().replace(f"max_steps: {spec.run.max_steps}", "max_steps: 3"))
    world = spec.parallel.tp * spec.parallel.pp * spec.parallel.dp
    run = torchrun(spec_path, tmp_path / "full", world, timeout=600)  # one thread per rank, as before
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "full" / "result.json").read_text())
    assert result["status"] == "ok" and result["steps_run"] == 3 and result["world_size"] == world


def test_encoder_decoder_stage_matches_the_transformers_model():
    """The pipeline-ready stage computes what T5ForConditionalGeneration / MT5ForConditionalGeneration do."""
    from transformers import MT5ForConditionalGeneration, T5ForConditionalGeneration

    from hp_tool.trial.models import build_stage, hf_config
    from hp_tool.contracts.spec import ModelSpec
    from hp_tool.trial.weights import materialize

    for family, cls in (("t5", T5ForConditionalGeneration), ("mt5", MT5ForConditionalGeneration)):
        model = ModelSpec(family=family, num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4,
                          ffn_hidden_size=128, vocab_size=512, seq_length=16, kv_channels=16,
                          decoder_seq_length=8)
        stage = build_stage(model, 1, 0)
        materialize(stage, torch.device("cpu"), 1234, 0.015)
        reference = cls(hf_config(model))
        state = {}
        for name in reference.state_dict():
            parts = name.split(".")
            if parts[0] in ("shared", "lm_head") or parts[1] == "embed_tokens":
                source = stage.embed_tokens.weight
            elif parts[1] == "block":
                offset = 0 if parts[0] == "encoder" else 2
                source = stage.get_parameter(".".join(["layers", str(int(parts[2]) + offset), *parts[3:]]))
            else:
                source = (stage.enc_norm if parts[0] == "encoder" else stage.dec_norm).weight
            state[name] = source.detach()
        reference.load_state_dict(state)
        enc, dec = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 8))
        expected = reference(input_ids=enc, decoder_input_ids=dec).logits
        torch.testing.assert_close(stage(enc, dec), expected, rtol=1e-5, atol=1e-5)
