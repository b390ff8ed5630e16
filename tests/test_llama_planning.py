"""Llama-style models in the planner: presets, parameter counts, shapes by size, the activation memory of
GQA + SwiGLU, the grid for long sequences, bad input; and a whole llama/tiny search on this machine, training then
inference in one command (tests/shared_searches.py's llama_tiny_search)."""

import csv
import json

import pytest

from hp_tool.architectures import Shape, count_parameters, model_flops_per_step, vocab_parallel_parameters
from hp_tool.base_config import base_spec, choose_model, resolve_cluster
from hp_tool.vocab import PRUNED, SELECTED
from hp_tool.candidates import plan_candidates
from hp_tool.cli import available_search_configs, compose
from hp_tool.config import to_app_config, training_precision
from hp_tool.errors import ConfigError
from hp_tool.families.llama import llama_activation_bytes_per_layer, llama_ffn, llama_shape
from hp_tool.planner import make_plan
from hp_tool.contracts.spec import load_spec
from search_helpers import main_here
from trial_helpers import torchrun

TS = "search_config.train_settings"
PUBLISHED = {  # preset: (parameters in billions from the model cards, layers, kv heads, vocab, seq)
    "llama2_7b": (6.74, 32, 32, 32000, 4096), "llama2_13b": (13.02, 40, 40, 32000, 4096),
    "llama2_70b": (68.98, 80, 8, 32000, 4096), "llama3_8b": (8.03, 32, 8, 128256, 8192),
    "llama3_70b": (70.55, 80, 8, 128256, 8192),
}


def plan(tmp_path, *overrides):
    cfg, name = compose(["cluster=bcm", "cluster.slurm.partition=batch", *overrides])
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def test_every_llama_preset_is_shipped():
    assert {f"llama/{p}" for p in (*PUBLISHED, "tiny", "unknown_size")} <= set(available_search_configs())


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_shapes_have_the_published_parameter_counts(tmp_path, preset):
    billions, layers, kv, vocab, seq = PUBLISHED[preset]
    p = plan(tmp_path, f"search_config=llama/{preset}")
    shape = p.model.shape
    assert (shape.family, shape.num_layers, shape.num_kv_heads, shape.vocab_size, shape.seq_length) == \
        ("llama", layers, kv, vocab, seq)
    assert count_parameters(shape) / 1e9 == pytest.approx(billions, rel=0.005)
    assert p.base.model.num_parameters == count_parameters(shape)
    assert p.specs, "nothing selected"


def test_llama_flops_count_gqa_swiglu_and_the_untied_head():
    shape = Shape("llama", 32, 4096, 32, 8, 14336, 128256, 8192)
    h, k, f, s, v = 4096, 8 * 128, 14336, 8192, 128256
    per_token_layer = 2 * h * (h + 2 * k) + 4 * s * h + 2 * h * h + 3 * 2 * h * f
    by_hand = 3 * s * (32 * per_token_layer + 2 * h * v)
    assert model_flops_per_step(shape, 1) == pytest.approx(by_hand)


def test_llama_ffn_rounds_as_meta_does():
    assert llama_ffn(4096, 1.0, 256) == 11008 and llama_ffn(5120, 1.0, 256) == 13824
    assert llama_ffn(4096, 1.3, 256) == 14336 and llama_ffn(8192, 1.3, 4096) == 28672


@pytest.mark.parametrize("size_b, layers, hidden, kv", [(70, 80, 8192, 8), (8, 32, 4096, 8), (3, 22, 3072, 8)])
def test_shape_by_size_follows_the_table(size_b, layers, hidden, kv):
    shape, _ = llama_shape(size_b, 128256, 8192)
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (layers, hidden, kv)
    assert count_parameters(shape) == pytest.approx(size_b * 1e9, rel=0.1)


def test_unknown_size_recommends_from_the_budget_and_builds_a_llama_shape(tmp_path):
    p = plan(tmp_path, "search_config=llama/unknown_size")
    assert p.model.recommended and p.model.shape.family == "llama"
    assert p.model.shape.num_kv_heads < p.model.shape.num_attention_heads  # GQA
    assert p.base.training.global_batch_size == 2**22 // 4096  # 4M tokens at seq 4096
    assert p.base.model.init_method_std == 0.02


def test_activation_memory_by_hand():
    # s=8, b=2, h=16, 4 heads (d=4), 2 kv heads (k=8), f=40, bf16, no TP: counted tensor by tensor
    shape = Shape("llama", 1, 16, 4, 2, 40, 100, 8)
    sbh, sbk, sbf, abs_ = 8 * 2 * 16, 8 * 2 * 8, 8 * 2 * 40, 4 * 2 * 8
    norms = 2 * (4 * sbh + 2 * 2 * sbh)         # fp32 input, bf16 normalised value and output of both RMSNorms
    attention = 2 * (2 * sbh + 2 * sbk) + 4 * abs_  # q, output, k, v; fp32 log-sum-exp
    mlp = 4 * 2 * sbf                           # gate, up, SiLU(gate), product
    assert llama_activation_bytes_per_layer(shape, 2) == norms + attention + mlp
    tp2 = llama_activation_bytes_per_layer(shape, 2, tp=2)
    assert tp2 == norms + (attention + mlp) / 2  # norms stay whole on every TP rank


def test_a_stacks_fused_norms_keep_their_input_alone_where_the_family_counts_them():
    """A stack whose RMSNorm is one fused kernel (torchtitan's fused_rmsnorm: ``Hardware.fused_norms``, which
    benchmarks/published_runs.py sets for its runs that ran it) keeps the norm's input, not the eager norm's fp32 copy:
    a Llama layer keeps 4 bytes a token per hidden unit fewer per norm, two norms, split along the sequence under SP;
    Qwen3's per-head norms 4 bytes a value of q and k more; Gemma's four fp32 norms are not counted (their eager
    bytes stand); hp_tool's own engines run the eager norms (the flag off: unchanged)."""
    import dataclasses

    from hp_tool.estimate.layout import Hardware, Layout
    from hp_tool.estimate.memory import layer_activation_bytes

    hw = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
                  inter_node_bandwidth_gbps=25, memory_overhead_gib=3)
    fused = dataclasses.replace(hw, fused_norms=True)
    s, b, h = 4096, 2, 5120
    llama = Shape("llama", 40, h, 40, 40, 13824, 32000, s)
    layout = Layout.of(tp=1, pp=1, dp=8, mbs=b, act_ckpt_layers=0, global_batch_size=16)
    eager = layer_activation_bytes(llama, layout, hw)
    assert eager == llama_activation_bytes_per_layer(llama, b)
    assert eager - layer_activation_bytes(llama, layout, fused) == 2 * 4 * s * b * h
    sp = Layout.of(tp=4, pp=1, dp=2, mbs=b, act_ckpt_layers=0, global_batch_size=16, sequence_parallel=True)
    assert layer_activation_bytes(llama, sp, hw) - layer_activation_bytes(llama, sp, fused) == 2 * 4 * s * b * h / 4
    qwen3 = dataclasses.replace(llama, family="qwen3")
    q_and_k = s * b * (qwen3.attention_dim + qwen3.kv_dim)
    assert layer_activation_bytes(qwen3, layout, hw) - layer_activation_bytes(qwen3, layout, fused) == \
        2 * 4 * s * b * h + 4 * q_and_k
    gemma = dataclasses.replace(llama, family="gemma2")
    assert layer_activation_bytes(gemma, layout, fused) == layer_activation_bytes(gemma, layout, hw)


def test_70b_at_seq_8192_never_proposes_an_unsharded_layout_that_cannot_fit(tmp_path):
    p = plan(tmp_path, "search_config=llama/llama3_70b", f"{TS}.num_nodes=16")
    selected = [c for c in p.candidates if c.status == SELECTED]
    assert selected and all(c.tp * c.pp >= 32 for c in selected)
    cfg, _ = compose(["search_config=llama/llama3_70b", f"{TS}.num_nodes=16", f"{TS}.tensor_parallel_sizes=[1,8]",
                      f"{TS}.pipeline_parallel_sizes=[1,8]", f"{TS}.act_ckpt_layers=[0]",
                      f"{TS}.min_model_parallel_size=1"])
    app = to_app_config(cfg)
    cluster = resolve_cluster(app)
    model = choose_model(app, cluster)
    gbs = base_spec(app, model, cluster).training.global_batch_size
    forced = plan_candidates(model.shape, model.size_b, app.search_config.train_settings, cluster, gbs,
                             model.recipe("full", training_precision(app)))
    unsharded = [c for c in forced if c.tp == 1 and c.pp == 1]
    assert unsharded and all(c.status == PRUNED and c.memory_gib > 80 for c in unsharded)


@pytest.mark.parametrize("override, key, words", [
    ("search_config.model.num_kv_heads=3", "search_config.model.num_kv_heads", "num_attention_heads=4"),
    (f"{TS}.seq_length=512", f"{TS}.seq_length", "context of 256 tokens"),
    ("search_config.model.ffn_hidden_size=0", "search_config.model.ffn_hidden_size", "positive"),
    ("search_config.model.ffn_hidden_size=17.5", "search_config.model.ffn_hidden_size", ""),
])
def test_bad_llama_input_names_key_value_and_fix(tmp_path, override, key, words):
    proc = main_here("search_config=llama/tiny", "dry_run=true", f"base_results_dir={tmp_path / 'res'}", override,
                     cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"hp_tool: error: {key}=") and words in proc.stderr and "Fix:" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_tp_not_dividing_the_kv_heads_names_both_numbers(tmp_path):
    with pytest.raises(ConfigError) as exc:
        plan(tmp_path, "search_config=llama/tiny", f"{TS}.tensor_parallel_sizes=[4]")
    assert exc.value.key == f"{TS}.tensor_parallel_sizes"
    assert "TP=4 does not divide the 2 key/value heads (4 query heads)" in str(exc.value)


@pytest.mark.e2e
def test_llama_tiny_search_end_to_end_and_the_optimal_config_trains(llama_tiny_search, tmp_path):
    """llama/tiny's 3 fastest trials on the local backend (tests/shared_searches.py), then its optimal config
    trained for 3 steps by the engine on as many ranks as it names (forked as torchrun starts them)."""
    [search] = llama_tiny_search.runs
    assert search.returncode == 0, search.output
    out = llama_tiny_search.results
    summary = search.summary_frame()
    assert len(summary) == 3 and set(summary["status"]) == {"ok"}
    assert list(summary["rank"]) == [1, 2, 3]
    [optimal] = (out / "final_results").glob("optimal_config_*_1nodes.yaml")
    spec = load_spec(optimal)
    assert spec.model.family == "llama" and spec.model.num_kv_heads == 2
    spec_path = tmp_path / "short.yaml"
    text = optimal.read_text().replace(f"max_steps: {spec.run.max_steps}", "max_steps: 3")
    spec_path.write_text(text)
    world = spec.parallel.tp * spec.parallel.pp * spec.parallel.dp
    run = torchrun(spec_path, tmp_path / "full", world, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "full" / "result.json").read_text())
    assert result["status"] == "ok" and result["steps_run"] == 3 and result["world_size"] == world


@pytest.mark.e2e
def test_llama_tiny_inference_search_runs_locally(llama_tiny_search):
    """The inference search of the same command (run_inference_hp_search=true, batch 2): TP 1 and TP 2 ran."""
    [search] = llama_tiny_search.runs
    assert search.returncode == 0, search.output
    rows = list(csv.DictReader(open(llama_tiny_search.results / "inference" / "final_summary" /
                                    "final_output.csv")))
    assert {r["config_id"].split("_")[2] for r in rows if r["status"] == "ok"} == {"tp1", "tp2"}


def test_vocab_parallel_parameters_follow_the_engine():
    llama = Shape("llama", 32, 4096, 32, 8, 14336, 128256, 8192)
    vh = 128256 * 4096
    assert vocab_parallel_parameters(llama, 4, 1) == (vh / 4, 4096 + vh / 4)  # untied head, final norm
    gpt = Shape("gpt3", 24, 4096, 32, 32, 16384, 51200, 2048)
    positions, norm = 2048 * 4096, 2 * 4096
    assert vocab_parallel_parameters(gpt, 2, 1) == (51200 * 4096 / 2 + positions, norm)  # head tied
    assert vocab_parallel_parameters(gpt, 2, 4)[1] == norm + 51200 * 4096 / 2  # last stage's own copy
