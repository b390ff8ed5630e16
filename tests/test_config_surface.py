"""The config surface as a cluster user meets it: gpu presets, moved and mistyped keys, multirun
comparison, cluster=auto without SLURM, the W&B key file in dry runs, cpus per task.

The preset checks plan through tests/plan_cache.py: each distinct plan once a test session, shared with
tests/test_engine_agreement.py and tests/test_preset_equivalence.py (the cluster group is no part of a plan)."""

import csv
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import plan_cache
from hp_tool.cli import CONF_DIR, available, available_search_configs, compose
from hp_tool.config import MOVED_KEYS, to_app_config
from hp_tool.errors import ConfigError
from hp_tool.launch.backends.base import JobShape
from hp_tool.launch.backends.local import local_problem
from hp_tool.launch.backends.slurm import cpus_per_task
from hp_tool.launch.slurm import partition_cpus_per_node
from hp_tool.session import prepare_backend
from search_helpers import main_here

REPO = Path(__file__).resolve().parent.parent
GPUS = ("a100_40gb", "a100_80gb", "h100_80gb", "h100_96gb_hbm2e", "h200", "a10g", "a10g_g5_4xlarge", "l4", "v100_16gb", "v100_32gb",
        "t4", "cpu", "l40s", "rtx_3090", "rtx_4090", "rtx_6000_ada", "rtx_a5000", "rtx_a6000")
GPU_CLUSTERS = [(g, ("local", "auto", "bcm")[i % 3]) for i, g in enumerate(GPUS)]  # every cluster preset six times


def gpu_search(gpu: str, cluster: str) -> tuple[str, tuple[str, ...]]:
    """(preset, overrides) the GPU-preset checks compose and plan on ``gpu`` with the cluster preset: gpt3/1b,
    or on the CPU preset gpt3/tiny in fp32 (null: bf16, or fp16 on a GPU without bf16)."""
    model = "gpt3/tiny" if gpu == "cpu" else "gpt3/1b"
    precision = "fp32" if gpu == "cpu" else "null"
    return model, (f"gpu={gpu}", f"cluster={cluster}", "cluster.slurm.partition=batch",
                   f"search_config.train_settings.precision={precision}")


def split(args):
    """Hydra's flags (-m), which come before the overrides, and the overrides."""
    return [a for a in args if a.startswith("-")], [a for a in args if not a.startswith("-")]


def main(tmp_path, *args, env=None):
    """`python3 main.py` with results under tmp_path/res, run in this process (search_helpers.main_here)."""
    flags, overrides = split(args)
    return main_here(*flags, f"base_results_dir={tmp_path / 'res'}", *overrides, cwd=tmp_path, env=env)


def main_process(tmp_path, *args, env=None):
    """The same command as a process, as a user starts it."""
    flags, overrides = split(args)
    return subprocess.run([sys.executable, str(REPO / "main.py"), *flags, f"base_results_dir={tmp_path / 'res'}",
                           *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def load(*overrides):
    cfg, name = compose(list(overrides))
    return to_app_config(cfg), name


def resolve_kind(app, jobs):
    """The kind of backend that runs jobs of (nodes, processes per node), its preflight passed."""
    return prepare_backend(app, [JobShape(f"a job of {n} node(s) x {p}", n, p) for n, p in jobs]).kind


def fake_command(folder: Path, name: str, output: str) -> None:
    """A stand-in for a cluster tool this machine lacks (GPUs, a many-core SLURM node)."""
    path = folder / name
    path.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


# ------------------------------------------------------------------------------------------ presets

@pytest.mark.e2e  # a sweep of every shipped preset
def test_every_gpu_preset_is_shipped_and_documents_each_value_with_a_source():
    assert set(available("gpu")) == set(GPUS)
    for name in GPUS:
        text = (CONF_DIR / "gpu" / f"{name}.yaml").read_text()
        assert "Sources:" in text or name == "cpu", name
        for line in text.splitlines():
            if re.match(r"^\s*\w+:\s*\S", line):  # a value line carries its comment
                assert "#" in line, (name, line)
    for name, cluster in GPU_CLUSTERS:  # composed as the plan below composes it (tests/plan_cache.py: once)
        model, overrides = gpu_search(name, cluster)
        app, _ = plan_cache.composed(plan_cache.preset_overrides(model, *overrides))
        assert app.gpu.name == name and app.cluster.type == cluster


@pytest.mark.parametrize("name, memory, bf16, intra", [
    ("a100_80gb", 79.25, 312, 300), ("h100_80gb", 79.2, 989, 450), ("h200", 139.8, 989, 450), ("a10g", 22.06, 125, 32)])
def test_gpu_presets_carry_datasheet_values_into_the_plan(name, memory, bf16, intra):
    plan = plan_cache.plan("gpt3/1b", f"gpu={name}")
    hw = plan.cluster.hw
    assert (hw.gpu_memory_gib, hw.peak_tflops, hw.intra_node_bandwidth_gbps) == (memory, bf16, intra)
    assert plan.base.resources.gpu == name and plan.base.resources.peak_tflops_per_gpu == bf16


def test_peak_follows_the_training_precision():
    plan = plan_cache.plan("gpt3/1b", "gpu=h100_80gb", "search_config.train_settings.precision=fp32")
    assert plan.cluster.hw.peak_tflops == 67


def test_faster_gpu_predicts_faster_steps_and_sizing_scales_with_peak():
    a100 = plan_cache.plan("gpt3/unknown_size", "gpu=a100_80gb")
    h100 = plan_cache.plan("gpt3/unknown_size", "gpu=h100_80gb")
    assert a100.cluster.sizing_tflops_per_gpu == pytest.approx(140.0)  # NeMo's A100 assumption
    assert h100.cluster.sizing_tflops_per_gpu == pytest.approx(140 / 312 * 989, abs=0.1)
    assert h100.model.size_b > 3 * a100.model.size_b


@pytest.mark.e2e
@pytest.mark.parametrize("name, cluster", [(n, ("local", "auto", "bcm")[i % 3])
                                           for i, n in enumerate(available_search_configs())])
def test_every_search_config_composes_and_plans_on_its_default_gpu(name, cluster):
    """Each shipped search config composes, validates and plans, on one of the cluster presets in turn
    (the cluster group is independent of the search config). finetune/custom gets the user's model
    (plan_cache.CUSTOM_MODEL). The plan is tests/plan_cache.py's: the planner reads nothing of the cluster
    group, so it is the plan tests/test_engine_agreement.py and tests/test_preset_equivalence.py read."""
    overrides = (f"cluster={cluster}", "cluster.slurm.partition=batch")
    app, search = plan_cache.composed(plan_cache.preset_overrides(name, *overrides))
    assert app.search_config.model_family == name.split("/")[0] and app.cluster.type == cluster
    plan = plan_cache.plan(name, *overrides)
    assert plan.search_name == search
    assert plan.specs and plan.base.resources.gpu == app.gpu.name
    own = {"finetune/llama2_7b_a10g": "a10g_g5_4xlarge", "llama/llama3_8b_128k": "h100_80gb"}  # presets made for one GPU type select it
    assert app.gpu.name == own.get(name, "cpu" if name.rsplit("/", 1)[-1].startswith("tiny") else "a100_80gb")


@pytest.mark.parametrize("gpu, cluster", GPU_CLUSTERS)
def test_every_gpu_and_cluster_preset_plans(gpu, cluster):
    """Each GPU preset plans, each on one of the cluster presets (every cluster preset six times): the
    cluster kind changes how trials are launched, not what is planned (tests/plan_cache.py plans it, its
    command line composed once with the check above)."""
    model, overrides = gpu_search(gpu, cluster)
    assert plan_cache.plan(model, *overrides).specs


# ------------------------------------------------------------------------------------- strict keys

@pytest.mark.parametrize("plus", ["", "+"])
def test_every_moved_key_fails_naming_the_new_key(plus):
    """The command line is checked before Hydra composes anything: each moved key, with or without +."""
    from hp_tool.cli import _check_args

    for old, new in sorted(MOVED_KEYS.items()):
        with pytest.raises(ConfigError) as exc:
            _check_args(["search_config=gpt3/tiny", "dry_run=true", f"{plus}{old}=2"])
        assert exc.value.key == old and f"{old}='2': was moved to {new}" in str(exc.value)


def test_a_moved_key_exits_2_and_writes_nothing(tmp_path):
    old = "search_config.train_settings.gpu_memory_gb"
    proc = main(tmp_path, "search_config=gpt3/tiny", "dry_run=true", f"{old}=2")
    assert proc.returncode == 2, proc.stderr
    assert f"{old}='2': was moved to {MOVED_KEYS[old]}" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "res").exists()


@pytest.mark.parametrize("plus", ["", "+", "++"])
def test_a_typo_fails_with_its_name_with_or_without_plus(tmp_path, plus):
    proc = main(tmp_path, "dry_run=true", f"{plus}search_config.train_settings.tensr_parallel_sizes=[1]")
    assert proc.returncode == 2
    assert "search_config.train_settings.tensr_parallel_sizes" in proc.stderr
    assert "did you mean search_config.train_settings.tensor_parallel_sizes?" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_a_moved_key_in_a_composed_config_fails_naming_the_new_key():
    with pytest.raises(ConfigError) as exc:
        load("+cluster.gpu_peak_tflops=989")
    assert exc.value.key == "cluster.gpu_peak_tflops" and "gpu.peak_tflops.bf16" in str(exc.value)


def test_unknown_gpu_preset_lists_the_shipped_ones(tmp_path):
    proc = main(tmp_path, "gpu=h100", "dry_run=true")
    assert proc.returncode == 2
    assert "gpu='h100'" in proc.stderr and "h100_80gb" in proc.stderr


def test_free_form_sbatch_parameters_still_take_any_key():
    app, _ = load("cluster=bcm", "cluster.slurm.partition=p", "+cluster.slurm.additional_sbatch_parameters.reservation=r")
    assert app.cluster.slurm.additional_sbatch_parameters == {"reservation": "r"}


# ----------------------------------------------------------------------------------- W&B key file

@pytest.mark.parametrize("content", [None, "", "\n  \nkey-on-line-two\n"])
def test_wandb_key_file_is_checked_in_a_dry_run(tmp_path, content):
    key_file = tmp_path / "wandb.key"
    if content is not None:
        key_file.write_text(content)
    proc = main(tmp_path, "search_config=gpt3/tiny", "dry_run=true", "wandb.enable=true",
                f"wandb.api_key_file={key_file}", env={"WANDB_MODE": "online"})
    assert proc.returncode == 2
    assert "wandb.api_key_file=" in proc.stderr and "Fix:" in proc.stderr
    assert "key-on-line-two" not in proc.stderr + proc.stdout
    assert not (tmp_path / "res").exists()


@pytest.mark.e2e
def test_wandb_key_file_that_is_fine_passes_a_dry_run_and_is_never_written(tmp_path):
    key_file = tmp_path / "wandb.key"
    key_file.write_text("secret-key-123\n")
    proc = main(tmp_path, "search_config=gpt3/tiny", "dry_run=true", "wandb.enable=true",
                f"wandb.api_key_file={key_file}", env={"WANDB_MODE": "online"})
    assert proc.returncode == 0, proc.stderr
    written = "".join(p.read_text() for p in (tmp_path / "res").rglob("*") if p.is_file())
    assert "secret-key-123" not in written + proc.stdout + proc.stderr


# ------------------------------------------------------------------------- cluster=auto, no SLURM

@pytest.mark.e2e
def test_auto_without_slurm_refuses_a_gpu_search_on_a_machine_without_gpus(tmp_path):
    # an empty PATH directory: no sinfo/sbatch (no SLURM), no nvidia-smi (no GPU)
    env = {"PATH": f"{tmp_path}:{Path(sys.executable).parent}"}
    proc = main(tmp_path, "search_config=gpt3/5b", "cluster=auto", env=env)
    assert proc.returncode == 2
    assert "cluster='auto': found no SLURM" in proc.stderr
    assert "cluster=bcm cluster.slurm.partition=" in proc.stderr and "gpu=cpu" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_explicit_local_refuses_a_gpu_preset_on_a_machine_without_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    app, _ = load("search_config=gpt3/1b", "cluster=local")
    with pytest.raises(ConfigError) as exc:
        resolve_kind(app, [(1, 8)])
    assert exc.value.key == "cluster" and "no GPU" in exc.value.problem


def test_auto_without_slurm_runs_cpu_presets_here(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    app, _ = load("search_config=gpt3/tiny", "cluster=auto")
    assert resolve_kind(app, [(1, 2)]) == "local"


@pytest.mark.e2e
def test_auto_without_slurm_runs_here_when_the_gpus_fit(tmp_path, monkeypatch):
    # GPUs cannot be had here: a stand-in nvidia-smi reports eight 80 GiB parts (81559 MiB each)
    fake_command(tmp_path, "nvidia-smi", "81559\\n" * 8)
    monkeypatch.setenv("PATH", str(tmp_path))
    app, _ = load("search_config=gpt3/1b", "cluster=auto", "gpu=h100_80gb")
    assert resolve_kind(app, [(1, 8)]) == "local"
    with pytest.raises(ConfigError, match="a trial spans 2 nodes"):
        resolve_kind(app, [(2, 8)])
    app40, _ = load("search_config=gpt3/1b", "cluster=auto", "gpu=h200")
    with pytest.raises(ConfigError, match="less than the 139.8 GiB of gpu=h200"):
        resolve_kind(app40, [(1, 8)])


def test_local_problem_names_what_is_missing():
    app, _ = load("search_config=gpt3/1b", "gpu=a100_80gb")
    assert local_problem(app.gpu, [(1, 8)], gpus_here=[85.5] * 8) is None
    assert "needs 8 GPUs and this machine has 2" in local_problem(app.gpu, [(1, 8)], gpus_here=[85.5] * 2)
    assert "no GPU" in local_problem(app.gpu, [(1, 1)], gpus_here=[])


# ---------------------------------------------------------------------------------- cpus per task

@pytest.mark.e2e
def test_cpus_per_task_shares_the_nodes_cpus_among_its_tasks(tmp_path, monkeypatch):
    # a 64-core SLURM node cannot be had here: a stand-in sinfo reports it
    fake_command(tmp_path, "sinfo", "n1|64|gpu:8|idle\\nn2|64|gpu:8(S:0-1)|mixed\\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    partition_cpus_per_node.cache_clear()
    try:
        app, _ = load("cluster=bcm", "cluster.slurm.partition=batch")
        assert cpus_per_task(app.cluster, 8) == 8
        assert cpus_per_task(app.cluster, 3) == 21
        app.cluster.cpus_per_task = 4
        assert cpus_per_task(app.cluster, 8) == 4
    finally:
        partition_cpus_per_node.cache_clear()


# --------------------------------------------------------------------------------------- multirun

@pytest.mark.e2e
def test_multirun_over_gpu_types_writes_plans_and_a_comparison_ranked_by_cost(tmp_path):
    proc = main(tmp_path, "-m", "gpu=a10g,a100_80gb,h100_80gb", "search_config=gpt3/8b", "dry_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [sweep] = list((tmp_path / "res" / "multirun").iterdir())
    rows = list(csv.DictReader(open(sweep / "comparison.csv")))
    assert sorted(r["gpu"] for r in rows) == ["a100_80gb", "a10g", "h100_80gb"]
    costs = [float(r["predicted_full_run_cost_usd"]) for r in rows]
    assert costs == sorted(costs) and [r["rank"] for r in rows] == ["1", "2", "3"]
    for r in rows:
        plan_csv = Path(r["results_dir"]) / "candidate_configs" / "plan.csv"
        best = next(p for p in csv.DictReader(open(plan_csv)) if p["predicted_rank"] == "1")
        assert r["best_trial_id"] == best["trial_id"]
        # the cost by hand: price per GPU-hour x GPUs x days x 24
        by_hand = float(r["gpu_hour_price_usd"]) * int(r["num_gpus"]) * float(best["predicted_days_to_train"]) * 24
        assert float(r["predicted_full_run_cost_usd"]) == pytest.approx(by_hand, rel=2e-3)
        assert Path(r["results_dir"]).is_relative_to(sweep)
    assert "Comparison (cheapest full run first)" in proc.stdout


@pytest.mark.e2e
def test_multirun_shows_a_gpu_where_nothing_fits_last_with_its_reason(tmp_path):
    proc = main(tmp_path, "-m", "gpu=cpu,a100_80gb", "search_config=gpt3/5b", "dry_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [sweep] = list((tmp_path / "res" / "multirun").iterdir())
    rows = list(csv.DictReader(open(sweep / "comparison.csv")))
    assert [(r["gpu"], r["status"], r["rank"]) for r in rows] == [("a100_80gb", "ok", "1"), ("cpu", "error", "")]
    assert "no valid layout fits in host RAM" in rows[1]["reason"]  # offload fits 4 GiB, not 16 GiB of RAM


@pytest.mark.e2e
def test_multirun_where_no_job_can_plan_exits_2(tmp_path):
    """The multirun smoke test of the entry point as a process (main.py -m, Hydra's sweep, the exit code)."""
    proc = main_process(tmp_path, "-m", "gpu=cpu", "search_config=gpt3/5b,gpt3/8b", "dry_run=true")
    assert proc.returncode == 2
    assert proc.stderr.count("no valid layout fits in host RAM") == 2


@pytest.mark.e2e
@pytest.mark.parametrize("override", ["cluster.job_name_prefix=t1a2:", "cluster.slurm.setup=[sleep 300,echo a: b]",
                                      "search_config.train_settings.max_minutes_per_run=1",
                                      "search_config.train_settings.precision=fp32"])
def test_values_hydra_reads_as_plain_strings_or_lists_pass_the_type_check(tmp_path, override):
    proc = main(tmp_path, "search_config=gpt3/tiny", "cluster=bcm", "cluster.slurm.partition=p", "dry_run=true", override)
    assert proc.returncode == 0, proc.stderr[-2000:]
