"""`main.py ... dry_run=true` as a user runs it: files, table, no torch, and bad input writing nothing."""

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hp_tool.contracts.spec import load_spec
from search_helpers import main_here

REPO = Path(__file__).resolve().parent.parent


def main_process(tmp_path, *args):
    """`python3 main.py` as a user starts it: the smoke tests of the entry point as a process."""
    return subprocess.run([sys.executable, str(REPO / "main.py"), f"base_results_dir={tmp_path / 'res'}", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def main(tmp_path, *args):
    """The same command run in this process (search_helpers.main_here)."""
    return main_here(f"base_results_dir={tmp_path / 'res'}", *args, cwd=tmp_path)


@pytest.mark.e2e
def test_dry_run_writes_plan_and_prints_table(tmp_path):
    proc = main_process(tmp_path, "search_config=gpt3/5b", "dry_run=true")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "res" / "gpt3" / "5b"
    assert "Model size: 5.05B parameters (24 layers x 4096 hidden)" in proc.stdout
    assert "7.75 days" in proc.stdout
    assert "gpt3_5b_tp" in proc.stdout

    base = load_spec(out / "base_cfg_5b.yaml")
    assert base.run.mode == "full"
    assert (base.model.num_layers, base.model.hidden_size, base.model.num_attention_heads) == (24, 4096, 32)
    assert (base.training.max_steps, base.training.warmup_steps, base.training.constant_steps) == (71525, 107, 11873)
    assert base.training.lr == pytest.approx(1.2e-4) and base.training.min_lr == pytest.approx(1.2e-5)
    assert base.training.global_batch_size == 2048
    assert base.model.init_method_std == pytest.approx(0.64 / 4096 ** 0.5, rel=1e-4)

    rows = list(csv.DictReader(open(out / "candidate_configs" / "plan.csv")))
    specs = sorted((out / "candidate_configs").glob("*.yaml"))
    selected = [r for r in rows if r["plan_status"] == "selected"]
    assert len(specs) == len(selected) > 0
    assert all(r["reason"] for r in rows if r["plan_status"] != "selected")
    assert "None" not in open(out / "candidate_configs" / "plan.csv").read()
    for path in specs:
        spec = load_spec(path)
        assert spec.trial_id == path.stem and spec.run.mode == "benchmark"
        assert spec.estimates.memory_gib > 0 and spec.estimates.step_time_s > 0
        assert spec.run.output_dir.endswith(f"training_logs/{spec.trial_id}")
    assert not (out / "training_logs").exists()  # dry run submits nothing


def test_unknown_size_recommends_12_9b(tmp_path):
    proc = main(tmp_path, "search_config=gpt3/unknown_size", "dry_run=true")
    assert proc.returncode == 0, proc.stderr
    assert "Recommended model size: 12.9B parameters" in proc.stdout
    assert (tmp_path / "res" / "gpt3" / "unknown_size" / "base_cfg_12.9b.yaml").exists()


@pytest.mark.e2e
def test_planning_never_imports_torch(tmp_path):
    code = (
        "import sys\n"
        "from hp_tool.cli import compose, run\n"
        "from hp_tool.config import to_app_config\n"
        f"cfg, name = compose(['search_config=gpt3/175b', 'dry_run=true', 'base_results_dir={tmp_path}'])\n"
        "assert run(to_app_config(cfg), name) == 0\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not leaked, leaked\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "gpt3" / "175b" / "candidate_configs" / "plan.csv").exists()


@pytest.mark.parametrize("args, key", [
    (["search_config=gpt3/nope"], "search_config='gpt3/nope'"),
    (["search_config.train_settings.tensor_parallel_sizes=[3]"], "search_config.train_settings.tensor_parallel_sizes"),
    (["search_config.train_settings.pipeline_parallel_sizes=[7]"], "search_config.train_settings.pipeline_parallel_sizes"),
    (["search_config.train_settings.num_nodes=-2"], "search_config.train_settings.num_nodes"),
    (["search_config.train_settings.global_batch_size=1001"], "search_config.train_settings.global_batch_size"),
    (["search_config.train_settings.seq_length=0"], "search_config.train_settings.seq_length"),
    (["cluster=bcm"], "cluster.slurm.partition"),
])
def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, args, key):
    proc = main(tmp_path, "dry_run=true", *args)
    assert proc.returncode == 2
    assert key in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.e2e
def test_unknown_key_fails_before_writing(tmp_path):
    proc = main_process(tmp_path, "dry_run=true", "search_config.train_settings.micro_batch=[1]")
    assert proc.returncode != 0
    assert "micro_batch" in proc.stdout + proc.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("preset, recommended", [("gpt3/unknown_size", True), ("finetune/llama2_7b_a10g", False)])
def test_the_headline_time_is_the_best_rows_and_names_the_sizing_assumption(tmp_path, preset, recommended):
    """One time estimate: the headline's time is the rank-1 row's predicted days (what the table's best row
    says), and the tflops_per_gpu sizing figure, which differs, is named as an assumption with its own time."""
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.planner import make_plan
    from hp_tool.plan_output import plan_rows
    from hp_tool.sizing import format_days

    cfg, name = compose([f"search_config={preset}"])
    plan = make_plan(to_app_config(cfg), name, tmp_path / name)
    best = next(r for r in plan_rows(plan) if r["predicted_rank"] == 1)
    said = re.search(r"takes about ([\d.]+) (days|hours|minutes) with the best predicted layout", plan.sentence)
    per_day = {"days": 1, "hours": 24, "minutes": 1440}[said[2]]
    assert float(said[1]) == pytest.approx(best["predicted_days_to_train"] * per_day, rel=0.01)
    assumed = f"{plan.cluster.sizing_tflops_per_gpu:g} TFLOPS per GPU (tflops_per_gpu)"
    assert assumed in plan.sentence and format_days(plan.days_to_train) in plan.sentence
    assert format_days(plan.days_to_train) != format_days(best["predicted_days_to_train"])
    assert ("the size was chosen assuming" in plan.sentence) == recommended
