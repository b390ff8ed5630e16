"""`python3 -m hp_tool.train`'s command line: the steps follow the data, the learning rate follows the method (or
``training.lr``), the run's folder sits beside the search's final_results, ``-h`` prints the usage, and bad input
is refused, naming the key, before anything is written. Most of it runs in this process up to the launch (the
tiny checkpoint and tokenizer of test_finetune_train, a fine-tuning plan of finetune/tiny on it); the ``e2e`` tests
train for real on 2 CPU processes."""

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hp_tool import train
from hp_tool.base_config import finetune_lr
from hp_tool.contracts import result as res
from hp_tool.contracts.spec import dump_spec, load_spec
from test_finetune_train import WORDS, make_tokenizer
from test_finetune_trials import make_checkpoint

REPO = Path(__file__).resolve().parent.parent
TOKENS_PER_STEP = 16 * 64  # finetune/tiny at sequence length 64: 1024 tokens per step


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(count)]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A checkpoint with its tokenizer, one without, two data files of different sizes, and a search's
    final_results folder holding a full and a LoRA config of finetune/tiny planned on the checkpoint."""
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.planner import make_plan

    root = tmp_path_factory.mktemp("train_entry")
    make_checkpoint(root / "model")
    make_tokenizer(root / "model", texts(200, 3))
    make_checkpoint(root / "no_tokenizer")
    cfg, name = compose(["search_config=finetune/tiny", f"search_config.model.hf_config={root / 'model'}",
                         "search_config.train_settings.seq_lengths=[64]",
                         "search_config.train_settings.methods=[full,lora]"])
    plan = make_plan(to_app_config(cfg), name, root / "res")
    final = root / "res" / "final_results"
    final.mkdir(parents=True)
    lora = next(s for s in plan.specs if s.model.method == "lora")
    configs = {"full": dump_spec(plan.base, final / "optimal_config_full_1nodes.yaml"),
               "lora": dump_spec(dataclasses.replace(lora, run=plan.base.run),  # the full run's, as an optimal config's
                                 final / "optimal_config_lora_1nodes.yaml")}
    return dict(root=root, model=root / "model", no_tokenizer=root / "no_tokenizer", configs=configs, plan=plan,
                small=write_jsonl(root / "small.jsonl", texts(60, 5)),
                large=write_jsonl(root / "large.jsonl", texts(300, 7)))


def prepared(world, *keys: str, method: str = "full", data: str = "large"):
    """What ``hp_tool.train`` runs with these keys, up to the launch: (the spec read back from its run_spec.yaml,
    the tokens in its token file, the plan)."""
    options = train.parse([str(world["configs"][method]), f"model.checkpoint={world['model']}",
                           f"data.path={world[data]}", *keys])
    _, spec_path, plan = train.prepare(options)
    spec = load_spec(spec_path)
    return spec, np.fromfile(spec.training.data.path, dtype=np.uint32).size, plan


def test_steps_follow_the_data_file_and_epochs(world, tmp_path):
    steps = {}
    for data in ("small", "large"):
        for epochs in (1, 3):
            spec, tokens, _ = prepared(world, f"output_dir={tmp_path / f'{data}{epochs}'}", f"epochs={epochs}",
                                       data=data)
            expected = max(1, tokens * epochs // TOKENS_PER_STEP)
            assert spec.training.global_batch_size * spec.model.seq_length == TOKENS_PER_STEP
            assert spec.run.max_steps == spec.training.max_steps == expected  # the schedule is the data's
            assert spec.full_run.epochs == epochs and spec.full_run.max_steps == expected
            steps[data, epochs] = expected
    assert steps["small", 1] < steps["large", 1] and steps["large", 3] == pytest.approx(3 * steps["large", 1], abs=2)
    # the search planned 100K tokens (97 steps): not what trains
    assert world["plan"].base.training.max_steps not in steps.values()


def test_epochs_default_to_the_configs_and_max_steps_caps(world, tmp_path):
    spec, tokens, plan = prepared(world, f"output_dir={tmp_path / 'a'}")
    assert plan.epochs == world["plan"].base.full_run.epochs == 1
    assert spec.run.max_steps == tokens // TOKENS_PER_STEP
    spec, tokens, plan = prepared(world, f"output_dir={tmp_path / 'b'}", "max_steps=2", "epochs=2")
    assert spec.run.max_steps == 2 and spec.training.max_steps == 2 * tokens // TOKENS_PER_STEP
    assert plan.passes == pytest.approx(2 * TOKENS_PER_STEP / tokens)
    said = plan.sentence(world["large"], spec)
    assert f"{tokens:,} tokens" in said and "max_steps stops after 2" in said and "in 2 steps" in said
    assert f"{plan.passes:.2f} passes over the data" in said


def test_a_file_shorter_than_one_step_trains_one_step(world, tmp_path):
    short = write_jsonl(tmp_path / "short.jsonl", texts(5, 11))
    options = train.parse([str(world["configs"]["full"]), f"model.checkpoint={world['model']}", f"data.path={short}",
                           f"output_dir={tmp_path / 'run'}"])
    spec, _, plan = train.prepare(options)
    assert 64 < plan.tokens < TOKENS_PER_STEP and spec.run.max_steps == plan.steps == 1


@pytest.mark.parametrize("method, keys, lr", [
    ("full", (), 2e-5),
    ("lora", (), 2e-4),
    ("lora", ("training.lr=1e-3",), 1e-3),
    ("full", ("training.lr=1e-3",), 1e-3),
])
def test_learning_rate_by_method_or_training_lr(world, tmp_path, method, keys, lr):
    spec, _, _ = prepared(world, f"output_dir={tmp_path / 'run'}", *keys, method=method)
    assert spec.model.method == method
    assert spec.training.lr == pytest.approx(lr) and spec.training.min_lr == pytest.approx(lr / 10)


def test_a_learning_rate_edited_in_the_config_is_kept(world, tmp_path):
    config = load_spec(world["configs"]["lora"])
    edited = tmp_path / "edited.yaml"
    dump_spec(dataclasses.replace(config, training=dataclasses.replace(config.training, lr=5e-5, min_lr=5e-6)), edited)
    options = train.parse([str(edited), f"model.checkpoint={world['model']}", f"data.path={world['large']}",
                           f"output_dir={tmp_path / 'run'}"])
    spec = load_spec(train.prepare(options)[1])
    assert spec.training.lr == pytest.approx(5e-5) and spec.training.min_lr == pytest.approx(5e-6)


def test_the_planner_and_hp_tool_train_share_the_methods_learning_rate(world):
    assert finetune_lr("full") == 2e-5 and finetune_lr("lora") == finetune_lr("qlora") == 2e-4
    plan = world["plan"]
    assert plan.base.training.lr == finetune_lr("full")
    assert {s.model.method for s in plan.specs} == {"full", "lora"}
    for spec in plan.specs:
        assert spec.training.lr == finetune_lr(spec.model.method)
        assert spec.training.min_lr == pytest.approx(finetune_lr(spec.model.method) / 10)


def test_the_run_folder_defaults_to_beside_final_results(world):
    spec, _, _ = prepared(world, "max_steps=1")
    run = world["root"] / "res" / "finetune_run"
    assert Path(spec.run.output_dir) == run and (run / "tokens.bin").is_file() and (run / "run_spec.yaml").is_file()
    assert Path(spec.run.save_dir) == run / "model"
    assert train.default_output_dir(world["root"] / "elsewhere.yaml") == world["root"] / "finetune_run"


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_every_key(flag, capsys):
    assert train.main([flag]) == 0
    out = capsys.readouterr()
    assert "Usage:" in out.out and "python3 -m hp_tool.train <optimal_config.yaml>" in out.out and not out.err
    assert all(key in out.out for key in train.KEYS)


BAD = {  # name: (arguments in place of the good ones, the key the error names, a word of its problem)
    "config is data": (dict(config="large", data="config"), "config", "JSON-lines data file"),
    "data is a config": (dict(data="config"), "data.path", "is a YAML file"),
    "no tokenizer": (dict(checkpoint="no_tokenizer"), "model.checkpoint", "has no tokenizer"),
    "max_steps 2.5": (dict(keys=["max_steps=2.5"]), "max_steps", "is not a whole number"),
    "max_steps 0": (dict(keys=["max_steps=0"]), "max_steps", "must be at least 1"),
    "nproc two": (dict(keys=["nproc=two"]), "nproc", "is not a whole number"),
    "nproc 3": (dict(keys=["nproc=3"]), "nproc", "runs on 2 processes"),
    "epochs 1.5": (dict(keys=["epochs=1.5"]), "epochs", "is not a whole number"),
    "epochs 0": (dict(keys=["epochs=0"]), "epochs", "must be at least 1"),
    "lr": (dict(keys=["training.lr=fast"]), "training.lr", "is not a number"),
    "unknown key": (dict(keys=["lr=1e-3"]), "lr", "is not a key of hp_tool.train"),
    "option": (dict(keys=["--epochs=2"]), "--epochs", "is not an option"),
    "no data": (dict(data=None), "data.path", "is required"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_before_anything_is_written(world, tmp_path, capsys, name):
    bad, key, problem = BAD[name]
    files = {**world, "config": world["configs"]["full"], None: None}
    config, data = files[bad.get("config", "config")], files[bad.get("data", "large")]
    args = [str(config), f"model.checkpoint={world[bad.get('checkpoint', 'model')]}",
            *([f"data.path={data}"] if data else []), *bad.get("keys", [])]
    default_run = world["root"] / "res" / "finetune_run"
    before = sorted(default_run.rglob("*")) if default_run.exists() else None
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert f"{key}=" in err and problem in err and "Fix:" in err, err
    after = sorted(default_run.rglob("*")) if default_run.exists() else None
    assert after == before  # nothing written to the default run folder (nor made)
    args.append(f"output_dir={tmp_path / 'run'}")
    assert train.main(args) == 2 and key in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_header_of_a_fine_tuning_config_names_hp_tool_train(world):
    from hp_tool.results.optimal import _header

    best = pd.Series(dict(days_to_train=0.01, full_run_cost_usd=float("nan"), measured_step_time_s=0.5,
                          full_run_step_time_s=0.5))
    spec = world["plan"].base
    header = _header(spec, best, 1, "ds.json")
    assert "# Train: python3 -m hp_tool.train <this file> model.checkpoint=... data.path=... save_dir=..." in header
    assert "torchrun" not in header and "sbatch" not in header
    nodes = dataclasses.replace(spec, resources=dataclasses.replace(spec.resources, num_nodes=4),
                                parallel=dataclasses.replace(spec.parallel, dp=spec.parallel.dp * 4),
                                training=dataclasses.replace(spec.training,
                                                             global_batch_size=spec.training.global_batch_size * 4))
    header = _header(nodes, best, 1, "ds.json")
    assert "python3 -m hp_tool.train <this file>" in header and "--nodes=4" in header and "run_spec.yaml" in header


def run(*args, cwd=REPO, timeout=600):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.e2e
def test_help_exits_0_from_the_command_line():
    proc = run("-m", "hp_tool.train", "--help")
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "training.lr" in proc.stdout, proc.stderr


@pytest.mark.e2e
def test_a_lora_run_trains_at_2e_4_shows_progress_and_says_once_what_it_saved(world, tmp_path):
    from hp_tool.trial.optim import lr_at

    proc = run("-m", "hp_tool.train", str(world["configs"]["lora"]), f"model.checkpoint={world['model']}",
               f"data.path={world['small']}", f"output_dir={tmp_path / 'run'}", "max_steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spec = load_spec(tmp_path / "run" / "run_spec.yaml")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert spec.training.lr == 2e-4 and [m["lr"] for m in metrics] == [lr_at(i, spec.training) for i in range(2)]
    said = proc.stdout + proc.stderr
    assert said.count("saved the") == 1 and "saved the lora adapters to" in said and "PeftModel" in said
    assert "step 1/2  loss " in proc.stdout and "step 2/2  loss " in proc.stdout and "tokens/s" in proc.stdout
    # the last line's MFU is the trials' own (contracts.result.throughput) at the step time since the first step
    last = next(line for line in proc.stdout.splitlines() if line.startswith("step 2/2"))
    world = spec.resources.num_nodes * spec.resources.gpus_per_node
    mfu = res.throughput(spec, metrics[1]["time"] - metrics[0]["time"], world)["mfu"]
    assert f"  MFU {mfu:.3g}  " in last and mfu > 0
    assert (tmp_path / "run" / "model" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()
