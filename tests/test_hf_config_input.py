"""A model's own config.json as the fine-tuning search's input: every shape key read from the file itself (a
missing or inconsistent one refused, naming it, before anything is written), LoRA targets that are not an
empty list, and each custom model planned into its own results folder."""

import json
from pathlib import Path

import pytest

from hp_tool.cli import compose, results_dir
from hp_tool.config import to_app_config
from hp_tool.errors import ConfigError
from hp_tool.hf_config import KEY, SHIPPED, load_hf_model, model_name
from search_helpers import main_here

TS = "search_config.train_settings"
SMALL = [f"{TS}.seq_lengths=[64,128]", f"{TS}.global_batch_tokens=1024"]  # fits the tiny config's 256 positions


def write_config(folder: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """The shipped tiny Llama's config.json in ``folder``, with ``changes`` and without the keys in ``drop``."""
    config = json.loads((SHIPPED / "tiny" / "config.json").read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def refused(folder: Path) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_hf_model(str(folder))
    return err.value


def run_main(tmp_path, *overrides):
    """`python3 main.py` with results under tmp_path/res, run in this process (search_helpers.main_here)."""
    return main_here(f"base_results_dir={tmp_path / 'res'}", *overrides, cwd=tmp_path)


# --- the config.json's own keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                 "vocab_size", "max_position_embeddings"])
def test_a_missing_shape_key_is_refused_not_defaulted(tmp_path, key):
    err = refused(write_config(tmp_path / "m", drop=(key,)))
    assert err.key == KEY and f'"{key}"' in str(err) and "Fix:" in str(err)
    assert "transformers" in err.problem  # it says what would have happened: transformers' default


@pytest.mark.parametrize("changes, words", [
    (dict(hidden_size=64, num_attention_heads=5), '"num_attention_heads"=5 does not divide "hidden_size"=64'),
    (dict(num_attention_heads=4, num_key_value_heads=3),
     '"num_key_value_heads"=3 does not divide "num_attention_heads"=4'),
    (dict(hidden_size=0), '"hidden_size"=0 is not a positive integer'),
    (dict(num_hidden_layers=-2), '"num_hidden_layers"=-2 is not a positive integer'),
    (dict(vocab_size="512"), "\"vocab_size\"='512' is not a positive integer"),
    (dict(num_key_value_heads=0), '"num_key_value_heads"=0 is not a positive integer'),
    (dict(head_dim=0), '"head_dim"=0 is not a positive integer'),
])
def test_an_inconsistent_shape_is_refused_naming_the_key_and_value(tmp_path, changes, words):
    err = refused(write_config(tmp_path / "m", **changes))
    assert err.key == KEY and words in err.problem and err.fix


def test_kv_heads_left_to_transformers_are_checked_too(tmp_path):
    """Without num_key_value_heads a Llama has one per head (what transformers builds); a Qwen2 gets
    transformers' default of 32, which a 4-head model cannot have."""
    assert load_hf_model(str(write_config(tmp_path / "llama", drop=("num_key_value_heads",)))).num_kv_heads == 4
    err = refused(write_config(tmp_path / "qwen", drop=("num_key_value_heads",), model_type="qwen2"))
    assert '"num_key_value_heads"=32 (transformers\' qwen2 default: the file has none) does not divide' in err.problem


def test_a_moe_config_without_its_experts_is_refused(tmp_path):
    config = json.loads((SHIPPED / "tiny_moe" / "config.json").read_text())
    config.pop("num_experts_per_tok")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    err = refused(tmp_path / "m")
    assert '"num_experts_per_tok"' in str(err)


def test_an_error_inside_transformers_becomes_a_config_error(tmp_path, monkeypatch):
    """Whatever transformers raises while reading the config (its strict dataclass validation, a bad value it
    cannot parse) is reported as bad input, not a traceback."""
    import transformers

    class Broken(Exception):
        pass

    def boom(*args, **kwargs):
        raise Broken("validator said no")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", boom)
    monkeypatch.setenv("HP_TOOL_CACHE", str(tmp_path / "cache"))  # what no earlier read of this config answered
    err = refused(write_config(tmp_path / "m"))
    assert err.key == KEY and "validator said no" in err.problem and "Fix:" in str(err)


@pytest.mark.e2e  # starts three processes
def test_a_config_read_before_is_planned_without_importing_transformers(tmp_path):
    """transformers' config classes import torch (seconds of every dry run): what they fill in is kept per config,
    transformers version and reading code, so a second read of the same config.json needs neither, and gives the
    same model; a changed config, or one transformers refuses, is read by transformers again."""
    import subprocess
    import sys

    folder = write_config(tmp_path / "m", drop=("num_key_value_heads",))  # left to transformers' default (4)
    env = {**__import__("os").environ, "HP_TOOL_CACHE": str(tmp_path / "cache")}
    probe = ("import sys, json; from hp_tool.hf_config import load_hf_model; m = load_hf_model(sys.argv[1]); "
             "print(json.dumps([m.num_kv_heads, m.head_dim, m.tied_embeddings, 'transformers' in sys.modules]))")

    def read(path):
        out = subprocess.run([sys.executable, "-c", probe, str(path)], env=env, capture_output=True, text=True,
                             check=True)
        return json.loads(out.stdout)

    assert read(folder) == [4, 16, False, True]  # the first read: transformers fills the kv heads in
    assert read(folder) == [4, 16, False, False]  # the same config again: nothing imported
    write_config(folder, drop=("num_key_value_heads",), tie_word_embeddings=True)
    assert read(folder) == [4, 16, True, True]  # a changed config is read anew
    assert len(list((tmp_path / "cache" / "hf_facts").iterdir())) == 2


def test_an_explicit_head_dim_is_kept_and_shipped_configs_still_load(tmp_path):
    hf = load_hf_model(str(write_config(tmp_path / "m", head_dim=32)))
    assert hf.head_dim == 32 and hf.num_attention_heads == 4
    for name in ("tiny", "tiny_moe", "llama2_7b", "mistral_7b", "qwen2_5_7b", "qwen1_5_moe_a2_7b", "mixtral_8x22b"):
        assert load_hf_model(name).num_layers > 0


def test_a_config_without_hidden_size_is_refused_before_anything_is_written(tmp_path):
    model = write_config(tmp_path / "mine", drop=("hidden_size",))
    proc = run_main(tmp_path, "search_config=finetune/custom", f"search_config.model.hf_config={model}",
                    "dry_run=true", *SMALL)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert KEY in proc.stderr and '"hidden_size"' in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("changes, words", [
    (dict(hidden_size=64, num_attention_heads=5), '"num_attention_heads"=5 does not divide "hidden_size"=64'),
    (dict(num_attention_heads=4, num_key_value_heads=3), '"num_key_value_heads"=3 does not divide'),
])
def test_inconsistent_heads_end_in_a_config_error_not_a_traceback(tmp_path, changes, words):
    model = write_config(tmp_path / "mine", **changes)
    proc = run_main(tmp_path, "search_config=finetune/custom", f"search_config.model.hf_config={model}",
                    "dry_run=true", *SMALL)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert KEY in proc.stderr and words in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "res").exists()


# --- LoRA targets -----------------------------------------------------------------------------------------

def test_empty_lora_target_modules_are_refused_like_every_empty_list():
    cfg, _ = compose(["search_config=finetune/tiny", f"{TS}.lora.target_modules=[]"])
    with pytest.raises(ConfigError) as err:
        to_app_config(cfg)
    assert err.value.key == f"{TS}.lora.target_modules" and "is an empty list" in str(err.value)
    assert "null" in err.value.fix  # null: every linear module, as documented
    cfg, _ = compose(["search_config=finetune/tiny", f"{TS}.lora.target_modules=[q_proj,v_proj]"])
    assert to_app_config(cfg).search_config.train_settings.lora.target_modules == ["q_proj", "v_proj"]


def test_empty_lora_target_modules_are_refused_on_the_command_line(tmp_path):
    proc = run_main(tmp_path, "search_config=finetune/tiny", f"{TS}.lora.target_modules=[]", "dry_run=true")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{TS}.lora.target_modules" in proc.stderr and "is an empty list" in proc.stderr
    assert "Fix:" in proc.stderr and not (tmp_path / "res").exists()


# --- the results folder -----------------------------------------------------------------------------------

def folder_of(*overrides: str) -> Path:
    cfg, name = compose(list(overrides))
    return results_dir(to_app_config(cfg), name)


def test_a_custom_model_plans_into_a_folder_named_after_it(tmp_path):
    custom = "search_config=finetune/custom"
    a = write_config(tmp_path / "my-llama")
    assert folder_of(custom, f"search_config.model.hf_config={a}") == Path("results/finetune/my-llama")
    assert folder_of(custom, f"search_config.model.hf_config={a / 'config.json'}") == Path("results/finetune/my-llama")
    odd = write_config(tmp_path / "my model (v2)")
    assert folder_of(custom, f"search_config.model.hf_config='{odd}'") == Path("results/finetune/my_model_v2")
    # a name that is also a shipped preset's folder gets its own: that folder holds only the preset's search
    assert folder_of(custom, "search_config.model.hf_config=llama2_7b") == Path("results/finetune/llama2_7b_custom")
    for preset in ("finetune/llama2_7b", "finetune/llama2_7b_a10g", "finetune/tiny", "gpt3/tiny"):
        assert folder_of(f"search_config={preset}") == Path("results") / preset
    # a shipped preset keeps its folder whatever model it is given
    tiny = folder_of("search_config=finetune/tiny", f"search_config.model.hf_config={a}")
    assert tiny == Path("results/finetune/tiny")


@pytest.mark.parametrize("value, name", [
    ("meta-llama/Llama-2-7b-hf", "Llama-2-7b-hf"), ("acme/tiny.llama", "tiny.llama"), ("tiny_moe", "tiny_moe"),
    ("/no/such/dir/", "dir"), ("..", None), ("/", "model"),
])
def test_the_model_name_is_a_path_part(value, name):
    got = model_name(value)
    assert got and "/" not in got and not got.startswith(".") and got not in ("..", ".")
    if name is not None:
        assert got == name


@pytest.fixture(scope="module")
def two_custom_models(tmp_path_factory):
    """The documented CPU route (docs/fine-tuning.md, "Your own small model on CPU") for two custom models, cut to
    one short one-process trial a model run in the orchestrator's process (cluster=in_process), each search run
    by the CLI's entry in this process (search_helpers.main_here), then a dry run of the finetune/tiny preset into
    the same results folder. What each step left is recorded as it finishes (the first model's optimal config
    right after its search, the results folder before and after the preset's plan), so each reader checks its
    own moment; they only read."""
    root = tmp_path_factory.mktemp("two_custom_models")
    cpu = ["search_config=finetune/custom", "gpu=cpu", "cluster=in_process", f"{TS}.seq_lengths=[128]",
           f"{TS}.global_batch_tokens=1024", f"{TS}.gpus_per_node=1", f"{TS}.tensor_parallel_sizes=[1]",
           f"{TS}.pipeline_parallel_sizes=[1]", f"{TS}.engines=[torch]", f"{TS}.precision=fp32",
           f"{TS}.limit_search_runs=1", f"{TS}.max_steps_per_run=4", f"{TS}.methods=[full]",
           f"{TS}.search_strategy=exhaustive", "memory_check=analytic"]
    models = {"alpha": write_config(root / "alpha"), "beta": write_config(root / "beta", num_hidden_layers=2)}
    searches, optimal = {}, {}
    for name, model in models.items():
        searches[name] = run_main(root, *cpu, f"search_config.model.hf_config={model}")
        found = sorted((root / "res" / "finetune" / name / "final_results").glob("optimal_config_*.yaml"))
        optimal[name] = [(path, path.read_text()) for path in found]
    folders_after_searches = sorted(p.name for p in (root / "res" / "finetune").iterdir())
    preset = run_main(root, "search_config=finetune/tiny", "dry_run=true")
    folders_after_preset = sorted(p.name for p in (root / "res" / "finetune").iterdir())
    return dict(res=root / "res" / "finetune", searches=searches, optimal=optimal, preset=preset,
                folders_after_searches=folders_after_searches, folders_after_preset=folders_after_preset)


@pytest.mark.e2e
def test_two_custom_models_plan_into_two_folders_and_a_preset_keeps_its_own(two_custom_models):
    """Each custom model's search plans into its own folder, and the finetune/tiny preset's plan into its own
    beside them (the module's searches: two_custom_models)."""
    for name, proc in two_custom_models["searches"].items():
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = two_custom_models["preset"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = two_custom_models["res"]
    assert two_custom_models["folders_after_preset"] == ["alpha", "beta", "tiny"]
    for name in ("alpha", "beta", "tiny"):
        assert (res / name / "candidate_configs" / "plan.csv").is_file()
    # each folder holds its own model's plan
    alpha = next((res / "alpha").glob("base_cfg_*.yaml")).read_text()
    beta = next((res / "beta").glob("base_cfg_*.yaml")).read_text()
    assert "num_layers: 4" in alpha and "num_layers: 2" in beta


@pytest.mark.e2e
def test_two_custom_models_searched_on_cpu_keep_their_own_results(two_custom_models):
    """Each search's winner lands in its model's folder, and the second leaves the first's untouched (the
    module's searches: two_custom_models)."""
    optimal = {}
    for name, proc in two_custom_models["searches"].items():
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "not in plan.csv" not in proc.stdout + proc.stderr
        found = two_custom_models["optimal"][name]
        assert len(found) == 1
        optimal[name] = found[0]
    assert optimal["alpha"][0].read_text() == optimal["alpha"][1]  # the second search wrote elsewhere
    assert "num_layers: 4" in optimal["alpha"][1] and "num_layers: 2" in optimal["beta"][1]
    assert two_custom_models["folders_after_searches"] == ["alpha", "beta"]
