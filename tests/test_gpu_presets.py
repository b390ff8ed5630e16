"""GPUs without bf16 (V100, T4): their presets plan, bf16 on them is refused before anything is written,
and a null precision picks the GPU's own (bf16, else fp16).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config, training_precision
from hp_tool.contracts.spec import load_spec
from hp_tool.planner import make_plan

REPO = Path(__file__).resolve().parent.parent
NO_BF16 = {"v100_16gb": (15.78, 125, 15.7, 150), "v100_32gb": (31.74, 125, 15.7, 150), "t4": (14.56, 65, 8.1, 16)}
PRECISION = "search_config.train_settings.precision"


def main(tmp_path, *args):
    return subprocess.run([sys.executable, str(REPO / "main.py"), f"base_results_dir={tmp_path / 'res'}", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def load(*overrides):
    cfg, name = compose(list(overrides))
    return to_app_config(cfg), name


# ------------------------------------------------------------------------------ presets and precision

@pytest.mark.e2e
@pytest.mark.parametrize("gpu", sorted(NO_BF16))
def test_a_gpu_without_bf16_plans_a_dry_run_in_fp16(tmp_path, gpu):
    node = ["search_config.train_settings.gpus_per_node=4"] if gpu == "t4" else []
    proc = main(tmp_path, f"gpu={gpu}", "search_config=llama/llama2_7b", "dry_run=true", f"{PRECISION}=fp16", *node)
    assert proc.returncode == 0, proc.stderr
    memory, fp16, _, _ = NO_BF16[gpu]
    base = load_spec(next((tmp_path / "res" / "llama" / "llama2_7b").glob("base_cfg_*.yaml")))
    assert base.training.precision == "fp16" and base.resources.peak_tflops_per_gpu == fp16
    assert (base.resources.gpu, base.resources.gpu_memory_gib) == (gpu, memory)


@pytest.mark.e2e
@pytest.mark.parametrize("gpu", sorted(NO_BF16))
def test_bf16_on_a_gpu_without_it_names_key_value_and_fix_and_writes_nothing(tmp_path, gpu):
    proc = main(tmp_path, f"gpu={gpu}", "search_config=llama/llama2_7b", "dry_run=true")  # the preset's bf16
    assert proc.returncode == 2
    assert f"{PRECISION}='bf16': gpu={gpu} has no bf16" in proc.stderr
    assert f"Fix: set {PRECISION}=fp16 (trained with dynamic loss scaling) or fp32" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("gpu, precision, peak", [("t4", "fp16", 65), ("v100_32gb", "fp16", 125),
                                                  ("a100_80gb", "bf16", 312)])
def test_null_precision_is_bf16_where_the_gpu_has_it_else_fp16(tmp_path, gpu, precision, peak):
    app, search = load(f"gpu={gpu}", "search_config=gpt3/1b", f"{PRECISION}=null")
    assert app.search_config.train_settings.precision is None and training_precision(app) == precision
    plan = make_plan(app, search, tmp_path)
    assert plan.cluster.hw.precision == precision and plan.cluster.hw.peak_tflops == peak
    assert plan.base.training.precision == precision
    assert {s.training.precision for s in plan.specs} == {precision}


@pytest.mark.parametrize("gpu", sorted(NO_BF16))
def test_presets_carry_their_datasheet_figures(gpu):
    memory, fp16, fp32, intra = NO_BF16[gpu]
    g = load(f"gpu={gpu}", "search_config=gpt3/tiny")[0].gpu
    figures = (g.memory_gib, g.peak_tflops.fp16, g.peak_tflops.fp32, g.intra_node_bandwidth_gbps)
    assert figures == (memory, fp16, fp32, intra)
    assert g.peak_tflops.bf16 is None and not g.supports("bf16") and g.supports("fp16")
