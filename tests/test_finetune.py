"""Fine-tuning a published model: the Hugging Face config as input, the sequence length searched with the
micro-batch, the per-epoch answer, bad input refused before anything is written, and a real search on CPU."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hp_tool.architectures import count_parameters
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.contracts.spec import load_spec
from hp_tool.errors import ConfigError
from hp_tool.hf_config import SHIPPED, load_hf_model
from hp_tool.planner import make_plan
from search_helpers import main_here
from shared_finetune_searches import METHODS_TRIALS, SAVERS_TRIALS

REPO = Path(__file__).resolve().parent.parent

# Published parameter counts (the models' Hugging Face cards / safetensors metadata).
PUBLISHED = {"llama2_7b": 6_738_415_616, "llama2_13b": 13_015_864_320, "llama2_70b": 68_976_648_192,
             "llama3_8b": 8_030_261_248, "mistral_7b": 7_241_732_096, "qwen2_5_7b": 7_615_616_512,
             # Qwen3's cards: 8.2B (6.95B without embeddings) and 0.6B (0.44B), tied in the small one
             "qwen3_8b": 8_190_735_360, "qwen3_0_6b": 596_049_920,
             "phi3_mini_4k": 3_821_079_552,  # Phi-3-mini's card: 3.8B
             "qwen3_30b_a3b": 30_532_122_624,  # Qwen3-30B-A3B's card: 30.5B, 3.3B active
             # Gemma-2 9B's card: 9.24B; Gemma-3 1B's 1B; Gemma-3 12B's text model (its card's 12.2B holds the vision
             # tower too)
             "gemma2_9b": 9_241_705_984, "gemma3_1b": 999_885_952, "gemma3_12b": 11_766_034_176}


def transformers_count(config: dict) -> int:
    """Parameters of transformers' own model for ``config``, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_count_the_published_parameters(name):
    hf = load_hf_model(name)
    n = count_parameters(hf.shape(4096))
    assert n == PUBLISHED[name] == transformers_count(hf.config)


# published configs no preset ships (Gemma's: tests/test_gemma.py): Qwen3-4B (Qwen/Qwen3-4B, tied: 4.02B) and Phi-4
# (microsoft/phi-4, model_type phi3: 14.66B)
UNSHIPPED = {
    "qwen3_4b": (dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                      max_position_embeddings=40960, tie_word_embeddings=True), 4_022_468_096),
    "phi4": (dict(model_type="phi3", hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=10, intermediate_size=17920, vocab_size=100352, max_position_embeddings=16384,
                  tie_word_embeddings=False, pad_token_id=100349), 14_659_507_200),
}


@pytest.mark.parametrize("name", sorted(UNSHIPPED))
def test_a_config_no_preset_ships_plans_with_transformers_count(tmp_path, name):
    config, card = UNSHIPPED[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert count_parameters(load_hf_model(str(tmp_path)).shape(4096)) == transformers_count(config) == card


def test_shape_facts_come_from_the_config(tmp_path):
    qwen = load_hf_model("qwen2_5_7b")
    assert (qwen.model_type, qwen.num_kv_heads, qwen.qkv_bias, qwen.tied_embeddings) == ("qwen2", 4, True, False)
    # A small Qwen2.5-style model ties its head; a head dim set apart from hidden / heads (as Mistral-Nemo's)
    config = {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 96, "intermediate_size": 512, "vocab_size": 1000,
              "tie_word_embeddings": True, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = load_hf_model(str(tmp_path))
    shape = hf.shape(1024)
    assert shape.tied_head and shape.qkv_bias and shape.kv_channels == 96 and shape.attention_dim == 384
    assert count_parameters(shape) == transformers_count(config)


def plan(tmp_path, *overrides):
    cfg, name = compose(list(overrides))
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def test_sequence_lengths_are_searched_at_the_same_tokens_per_step(tmp_path):
    p = plan(tmp_path, "search_config=finetune/llama2_7b")
    seqs = {c.shape.seq_length for c in p.candidates}
    assert seqs == {512, 1024, 2048, 4096}
    assert {c.full.global_batch_size * c.shape.seq_length for c in p.candidates} == {262144}
    # every selected trial's YAML runs its own sequence length with the model's Hugging Face config
    shipped = json.loads((SHIPPED / "llama2_7b" / "config.json").read_text())
    assert {s.model.seq_length for s in p.specs} >= {512, 1024}
    for spec in p.specs:
        assert f"_s{spec.model.seq_length}_" in spec.trial_id and spec.model.hf_config == shipped
        assert spec.full_run.global_batch_size * spec.model.seq_length == 262144
        assert spec.full_run.max_steps == int(300e6 / 262144) and spec.full_run.epochs == 3
    ranks = sorted((c for c in p.candidates if c.rank), key=lambda c: c.rank)
    assert [c.step_time_s for c in ranks] == sorted(c.step_time_s for c in ranks)


@pytest.fixture(scope="module")
def llama2_7b_on_two_gpus(tmp_path_factory):
    """One dry-run multirun (in this process) of finetune/llama2_7b at 2048 tokens over 50M tokens an epoch, on an
    A100 80GB node and on an L4 node: read by the per-epoch answer of a dry run (the A100's job) and by the GPU
    comparison (comparison.csv). Its readers only read."""
    base = tmp_path_factory.mktemp("llama2_7b_gpus")
    proc = main_here("-m", "search_config=finetune/llama2_7b", "gpu=a100_80gb,l4", "dry_run=true",
                     f"base_results_dir={base}", "search_config.train_settings.seq_lengths=[2048]",
                     "search_config.train_settings.dataset_tokens_in_m=50", cwd=base)
    return proc, base


@pytest.mark.e2e
def test_the_dry_run_answers_per_epoch(llama2_7b_on_two_gpus):
    proc, base = llama2_7b_on_two_gpus
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Fine-tuning llama2_7b (llama, 6.74B parameters" in proc.stdout and "h/epoch" in proc.stdout
    job = next(base.glob("multirun/*/0"))  # the first GPU's job: a100_80gb
    assert "a100_80gb" in next(job.glob("finetune/llama2_7b/base_cfg_*.yaml")).read_text()
    rows = list(csv.DictReader(open(job / "finetune" / "llama2_7b" / "candidate_configs" / "plan.csv")))
    fitted = [r for r in rows if r["predicted_step_time_s"]]
    assert fitted
    price, gpus = 5.12, 8  # a100_80gb's example price, one node of 8
    for r in fitted:
        per_hour = float(r["predicted_tokens_per_s_per_gpu"]) * gpus * 3600
        assert float(r["predicted_tokens_per_hour"]) == pytest.approx(per_hour, rel=1e-3)
        hours = 50e6 / per_hour
        assert float(r["predicted_hours_per_epoch"]) == pytest.approx(hours, rel=1e-3)
        assert float(r["predicted_cost_usd_per_epoch"]) == pytest.approx(price * gpus * hours, rel=1e-3, abs=0.01)
        assert 0 < float(r["predicted_mfu"]) < 1
    base_cfg = load_spec(next((job / "finetune" / "llama2_7b").glob("base_cfg_*.yaml")))
    assert base_cfg.training.lr == pytest.approx(2e-5) and base_cfg.full_run.num_tokens_in_b == pytest.approx(0.15)


def write_config(folder: Path, **changes) -> Path:
    config = json.loads((SHIPPED / "tiny" / "config.json").read_text())
    config.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.e2e
def test_a_hub_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "abc123"
    write_config(snapshot)
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs" / "main").write_text("abc123")
    code = ("import sys; from hp_tool.hf_config import load_hf_model; from hp_tool.errors import ConfigError\n"
            "print(load_hf_model('acme/tiny-llama').num_layers)\n"
            "try: load_hf_model('acme/not-downloaded')\n"
            "except ConfigError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    first, rest = out.stdout.split("\n", 1)
    assert first == "4"
    assert "not in the local Hugging Face cache" in rest and "huggingface-cli download acme/not-downloaded" in rest


BAD = [
    (lambda d: write_config(d, model_type="gpt2"), "search_config.model.hf_config", "is not supported"),
    (lambda d: d / "missing", "search_config.model.hf_config", "no such directory or file"),
    (lambda d: (d.mkdir(parents=True), d)[1], "search_config.model.hf_config", "has no config.json"),
    (lambda d: (d.mkdir(parents=True), (d / "config.json").write_text("{not json"), d)[2],
     "search_config.model.hf_config", "is not a readable JSON config"),
    (lambda d: write_config(d, attention_bias=True), "search_config.model.hf_config", "attention_bias=true describes layers"),
    (lambda d: write_config(d, max_position_embeddings=100), "search_config.train_settings.seq_lengths",
     "above the model's max_position_embeddings=100"),
]


@pytest.mark.parametrize("make, key, words", BAD)
def test_bad_model_input_fails_before_anything_is_written(tmp_path, make, key, words):
    model = make(tmp_path / "model")
    proc = main_here("search_config=finetune/custom", "dry_run=true", f"search_config.model.hf_config={model}",
                     f"base_results_dir={tmp_path / 'res'}", "search_config.train_settings.seq_lengths=[64,128]",
                     cwd=tmp_path)
    assert proc.returncode == 2 and key in proc.stderr and words in proc.stderr and "Fix:" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_a_sequence_beyond_mistrals_sliding_window_is_refused(tmp_path):
    p = plan(tmp_path, "search_config=finetune/mistral_7b", "search_config.train_settings.seq_lengths=[4096]")
    assert p.specs
    cfg, _ = compose(["search_config=finetune/mistral_7b", "search_config.train_settings.seq_lengths=[4096,8192]",
                      "search_config.train_settings.global_batch_tokens=262144"])
    with pytest.raises(ConfigError) as err:
        make_plan(to_app_config(cfg), "finetune/mistral_7b", tmp_path / "x")
    assert err.value.key == "search_config.train_settings.seq_lengths" and "sliding attention window of 4096" in str(err.value)
    assert not (tmp_path / "x").exists()


def test_rope_scaling_allows_longer_sequences(tmp_path):
    model = write_config(tmp_path / "m", max_position_embeddings=100, rope_scaling={"rope_type": "linear", "factor": 2.0})
    p = plan(tmp_path, "search_config=finetune/custom", f"search_config.model.hf_config={model}",
             "search_config.train_settings.seq_lengths=[64,128]")
    assert {s.model.seq_length for s in p.specs} <= {64, 128} and p.specs


@pytest.mark.parametrize("overrides, key", [
    (["search_config=finetune/custom"], "search_config.model.hf_config"),
    (["search_config=gpt3/tiny", "+search_config.model.hf_config=tiny"], "search_config.model.hf_config"),
    (["search_config=finetune/tiny", "search_config.train_settings.global_batch_tokens=1000"],
     "search_config.train_settings.global_batch_tokens"),
    (["search_config=finetune/tiny", "search_config.train_settings.global_batch_size=8"],
     "search_config.train_settings.global_batch_size"),
    (["search_config=finetune/tiny", "search_config.model.num_layers=2", "search_config.model.hidden_size=64",
      "search_config.model.num_attention_heads=4"], "search_config.model"),
])
def test_keys_of_the_other_kind_of_search_are_refused(overrides, key):
    cfg, _ = compose(overrides)
    with pytest.raises(ConfigError) as err:
        to_app_config(cfg)
    assert err.value.key == key


@pytest.mark.e2e
@pytest.mark.parametrize("search, trials", [("finetune_methods_search", METHODS_TRIALS),
                                            ("finetune_savers_search", SAVERS_TRIALS)],
                         ids=["methods_s64", "savers_s256"])
def test_tiny_fine_tuning_search_ranks_real_trials_per_epoch(request, search, trials):
    """A real search of finetune/tiny ranks every trial it ran with its per-epoch figures: the two searches of
    tests/shared_finetune_searches.py (full, LoRA and QLoRA at 64 tokens; the long-context savers at 256), each
    at the preset's 1024 tokens a step and 0.1M tokens an epoch."""
    searched = request.getfixturevalue(search)
    [run] = searched.runs
    assert run.returncode == 0, run.output
    rows = list(csv.DictReader(open(searched.final / "final_summary_1nodes.csv")))
    assert len(rows) == trials and [r["rank"] for r in rows] == [str(n) for n in range(1, trials + 1)]
    for r in rows:
        assert r["status"] == "ok" and f"_s{r['seq_length']}_" in r["trial_id"]
        per_hour = float(r["full_run_tokens_per_s_per_gpu"]) * int(r["num_gpus"]) * 3600
        assert float(r["tokens_per_hour"]) == pytest.approx(per_hour, rel=1e-4)
        assert float(r["hours_per_epoch"]) == pytest.approx(0.1e6 / per_hour, rel=1e-4)
        assert int(r["global_batch_size"]) * int(r["seq_length"]) == 1024


def test_rank0_saving_needs_more_host_ram_than_a_small_node_and_stays_selected(tmp_path):
    """Llama-2 70B fully fine-tuned on 32 single-A10G nodes of 64 GiB (REFERENCE §13): training fits with
    ZeRO-3 and optimizer offload; saving gathers the 16-bit model (2 bytes x 69B) on rank 0 only, so the plan
    keeps the layout and says what rank 0's node needs instead of pruning it."""
    p = plan(tmp_path, "search_config=finetune/llama2_70b", "gpu=a10g_g5_4xlarge",
             "search_config.train_settings.num_nodes=32", "search_config.train_settings.gpus_per_node=1",
             "search_config.train_settings.seq_lengths=[1024]", "search_config.train_settings.global_batch_tokens=131072")
    selected = [c for c in p.candidates if c.status == "selected"]
    assert selected and all(c.host_memory_gib <= 64 * 0.95 for c in selected)
    from hp_tool.estimate.memory import host_phases_gib

    for c in selected:
        training = host_phases_gib(c.shape, c.full, 1).train_gib  # the full run's node while it trains
        assert c.rank0_host_memory_gib == pytest.approx(training + 2 * 68_976_648_192 / 2**30, rel=1e-6)
        assert c.rank0_host_memory_gib > 64
    from hp_tool.plan_output import render_plan

    text = render_plan(p)
    need = max(c.rank0_host_memory_gib for c in selected)
    assert f"needs up to {need:.0f} GiB of host RAM" in text and "run rank 0 on a node with at least" in text


def test_optimizers_are_searched_with_their_own_state_bytes(tmp_path):
    from hp_tool.estimate.memory import model_state_bytes, stage_parameters

    p = plan(tmp_path, "search_config=finetune/llama2_7b_a10g", "search_config.train_settings.optimizers=[adamw,sgd,sgd_momentum]")
    by = {}
    for c in p.candidates:
        by.setdefault((c.shape.seq_length, c.tp, c.pp, c.mbs, c.act_ckpt_layers, c.engine, c.zero_stage, c.offload,
                       c.full.act_ckpt_mode), {})[
            c.optimizer] = c
    # torch engine, FSDP2 over 6 GPUs, nothing offloaded: Adam's 8 bytes of moments per parameter, momentum's
    # 4, plain SGD's none, all sharded 6 ways
    same = [v for k, v in by.items() if k[5:8] == ("torch", 3, "none") and len(v) == 3 and k[2] == 1]
    assert same
    psi = stage_parameters(same[0]["adamw"].shape, 1, 1)[0]
    for trio in same:
        a, m, s = (trio[o].full_memory_gib for o in ("adamw", "sgd_momentum", "sgd"))  # the full run, DP=6
        assert a - m == pytest.approx(4 * psi / 6 / 2**30, rel=1e-6) and m - s == pytest.approx(4 * psi / 6 / 2**30, rel=1e-6)
    assert model_state_bytes(100, 1, 0, engine="deepspeed", optimizer="sgd") == 8 * 100  # 2 + 2 + fp32 master
    assert model_state_bytes(100, 1, 0, engine="deepspeed", optimizer="adamw_8bit") == 10 * 100
    assert model_state_bytes(100, 1, 0, engine="torch", optimizer="adamw") == 16 * 100
    # DeepSpeed steps offloaded states with its CPU Adam: SGD with offload is an invalid row with the reason
    bad = [c for c in p.candidates if c.engine == "deepspeed" and c.offload != "none" and c.optimizer != "adamw"]
    assert bad and all(c.status == "invalid" for c in bad)
    runnable = [c for c in bad if c.zero_stage == 3 and c.pp == 1 and c.act_ckpt_layers == 0]  # DeepSpeed runs these savers
    assert runnable and all(c.reason_key.endswith("optimizers") and "CPU Adam" in c.reason for c in runnable)
    ids = {s.trial_id.removesuffix("_compiled").removesuffix("_sac").rsplit("_", 1)[-1] for s in p.specs if s.training.optimizer == "sgd_momentum"}
    assert ids <= {"sgdm"} and all(s.training.optimizer in ("adamw", "sgd", "sgd_momentum") for s in p.specs)


def test_8bit_adam_needs_a_gpu():
    cfg, _ = compose(["search_config=finetune/tiny", "search_config.train_settings.optimizers=[adamw_8bit]"])
    with pytest.raises(ConfigError) as err:
        to_app_config(cfg)
    assert err.value.key == "search_config.train_settings.optimizers" and "CUDA GPUs only" in str(err.value)


@pytest.mark.e2e
def test_gpu_types_compared_for_a_fine_tune(llama2_7b_on_two_gpus):
    proc, base = llama2_7b_on_two_gpus
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(next(base.glob("multirun/*/comparison.csv")))))
    assert {r["gpu"] for r in rows} == {"a100_80gb", "l4"} and all(r["status"] == "ok" for r in rows)
    costs = [float(r["predicted_full_run_cost_usd"]) for r in rows]
    assert costs == sorted(costs) and rows[0]["rank"] == "1"
    for r in rows:
        assert r["seq_length"] == "2048" and r["engine"] and r["optimizer"] == "adamw"
        assert r["method"] in ("full", "lora", "qlora") and (r["lora_rank"] == "") == (r["method"] == "full")
        assert f"_{r['method']}{r['lora_rank']}_" in r["best_trial_id"] or r["method"] == "full"
        hours = float(r["predicted_hours_per_epoch"])
        assert hours == pytest.approx(50e6 / float(r["predicted_tokens_per_hour"]), rel=1e-3)
        assert float(r["predicted_cost_usd_per_epoch"]) == pytest.approx(
            hours * float(r["gpu_hour_price_usd"]) * int(r["num_gpus"]), rel=1e-3, abs=0.01)
