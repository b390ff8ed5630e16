"""Memory in one unit, GiB (2**30 bytes, as torch.cuda.mem_get_info and nvidia-smi report it), everywhere a user
reads it: the gpu presets, the estimates, the trial's measured peak, the plan's columns; and the old GB keys fail
naming the new ones."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hp_tool.estimate.layout import GIB, Hardware, Layout
from hp_tool.estimate.memory import estimate_memory
from hp_tool.families.shape import Shape
from search_helpers import main_here

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted((REPO / "hp_tool/conf/gpu").glob("*.yaml"))
# each GPU's datasheet label, GB
LABELS = {"a100_40gb": 40, "a100_80gb": 80, "a10g": 24, "a10g_g5_4xlarge": 24, "h100_80gb": 80, "h100_96gb_hbm2e": 96,
          "h200": 141, "l4": 24, "t4": 16, "v100_16gb": 16, "v100_32gb": 32, "l40s": 48, "rtx_3090": 24,
          "rtx_4090": 24, "rtx_6000_ada": 48, "rtx_a5000": 24, "rtx_a6000": 48}


@pytest.mark.e2e  # a sweep of every shipped preset
@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_each_gpu_preset_gives_the_devices_real_total_in_gib(path):
    """A preset's memory is what the device reports (a little under its label in GiB: ECC and the driver's
    reservation), never the label in GB (which would exceed it by 7%). The cpu preset's is a budget per
    process, with no label, in GiB all the same."""
    from hp_tool.cli import compose
    preset = compose([f"gpu={path.stem}"])[0].gpu
    assert "memory_gib" in preset and "memory_gb" not in preset
    assert 0 < preset["memory_overhead_gib"] < preset["memory_gib"]
    if path.stem != "cpu":
        label = LABELS[path.stem]
        assert 0.9 * label < preset["memory_gib"] < label, (preset["name"], label, preset["memory_gib"])


def test_estimates_divide_bytes_by_two_to_the_thirty():
    """DDP's states are 16 bytes a parameter: 2**26 parameters of states are exactly 1 GiB (1.07 GB)."""
    shape = Shape("gpt3", 1, 64, 1, 1, 256, 16, 8)
    hw = Hardware(gpus_per_node=1, gpu_memory_gib=80, peak_tflops=1, intra_node_bandwidth_gbps=1,
                  inter_node_bandwidth_gbps=1, memory_overhead_gib=0)
    layout = Layout.of(tp=1, pp=1, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=1, zero_stage=0, precision="fp32")
    from hp_tool.estimate.memory import stage_parameters
    params = sum(stage_parameters(shape, 1, 1))
    est = estimate_memory(shape, layout, hw)
    assert est.model_states_gib == pytest.approx(16 * params / GIB, rel=1e-9)
    assert GIB == 1024 ** 3


@pytest.mark.e2e
def test_the_trials_measured_peak_is_in_gib():
    """On CPU the trial measures the process's peak RSS: touching 1 GiB more raises it by 1.0, not 1.07.

    Peak RSS is a high-water mark, so an earlier, larger peak would hide part of the rise: an earlier
    test's in the test process, and in a fresh process the imports' transient peak (0.4 GiB above the
    settled RSS has been seen). So the fresh process first holds 1.5 GiB, which lifts the current RSS above
    any earlier peak, and the rise is read from there.
    """
    code = (
        "import torch\n"
        "from hp_tool.trial import measure\n"
        "cpu = torch.device('cpu')\n"
        f"floor = torch.ones({3 * GIB // 8}, dtype=torch.float32)\n"  # 1.5 GiB, above the imports' peak
        "before, _ = measure.peak_memory_gib(cpu)\n"
        f"block = torch.ones({GIB // 4}, dtype=torch.float32)\n"  # 1 GiB more, every page touched
        "after, _ = measure.peak_memory_gib(cpu)\n"
        "print(after - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == pytest.approx(1.0, abs=0.04)


@pytest.mark.e2e
def test_the_plans_memory_columns_are_gib_and_match_the_estimate(tmp_path):
    """The dry run's plan.csv names every memory column in GiB and its predicted peak is the estimate's."""
    out = main_here(f"base_results_dir={tmp_path}", "dry_run=true", "search_config=llama/tiny")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GiB" in out.stdout and " GB" not in out.stdout
    plan = next(tmp_path.rglob("plan.csv"))
    with plan.open() as fh:
        rows = list(csv.DictReader(fh))
    header = rows[0].keys()
    memory = [c for c in header if "memory" in c and c != "memory_check"]
    assert memory and all(c.endswith("_gib") for c in memory), memory
    assert not [c for c in header if c.endswith("_gb")]
    assert any(float(r["predicted_memory_gib"] or 0) > 0 for r in rows)


def test_a_config_with_the_old_gb_key_fails_naming_the_gib_key(tmp_path):
    out = main_here(f"base_results_dir={tmp_path}", "dry_run=true", "search_config=llama/tiny", "+gpu.memory_gb=80")
    assert out.returncode != 0
    assert "gpu.memory_gib" in out.stdout + out.stderr and "GiB" in out.stdout + out.stderr
    assert not list(tmp_path.rglob("plan.csv"))
