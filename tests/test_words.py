"""Counts in the sentences hp_tool prints: one trial is a trial, a verdict is logged once and whole; a library line
that tells a trial's reader nothing is dropped."""

import logging

import pandas as pd
import pytest

from hp_tool.launch.monitor import Progress
from hp_tool.results.report import search_cost_line
from hp_tool.words import plural


def test_counts_take_the_number_of_their_noun():
    assert [plural(1, "trial"), plural(2, "trial"), plural(0, "candidate")] == ["1 trial", "2 trials", "0 candidates"]
    assert [plural(1, "CPU process"), plural(2, "CPU process")] == ["1 CPU process", "2 CPU processes"]
    assert [plural(1.0, "epoch"), plural(2.5, "epoch")] == ["1 epoch", "2.5 epochs"]


def test_the_search_cost_line_counts_one_trial_as_one_trial():
    selected = pd.DataFrame({
        "status": ["ok", "skipped", "skipped"], "stop_reason": ["max_steps", None, None],
        "start_time": ["2026-01-01T00:00:00Z", None, None], "end_time": ["2026-01-01T00:06:00Z", None, None],
        "trial_world_size": [2, 2, 2], "steps_run": [20, None, None]})
    line = search_cost_line(selected)
    assert line.startswith("Adaptive search: 1 trial ran for 0.2 GPU-hours; 2 not launched (2 skipped)")


def test_a_verdict_is_logged_once_with_its_whole_reason(caplog):
    reason = ("calibrated prediction 0.1234 s per step (raw 0.05 s) is more than skip_margin=0.25 slower than the "
              "best measured, gpt3_241k_tp1_pp1_mbs4_ac0_torch_z3_noff at 0.0812 s (measured 0.0812 s; calibrated "
              "on 3 trials)")
    progress = Progress(live=False)
    progress.add("gpt3_241k_tp2_pp1_mbs1_ac0_torch_z3_noff")
    with caplog.at_level(logging.INFO):
        progress.update("gpt3_241k_tp2_pp1_mbs1_ac0_torch_z3_noff", "skipped", {"reason": reason})
    said = [r.getMessage() for r in caplog.records if "skip_margin" in r.getMessage()]
    assert len(said) == 1 and reason in said[0]


@pytest.mark.e2e
def test_bitsandbytes_missing_hub_kernel_line_is_dropped_and_its_other_warnings_kept():
    import subprocess
    import sys

    code = ("import logging, hp_tool.trial\n"
            "import bitsandbytes\n"
            "log = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
            "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: x')\n"
            "log.warning('a real bitsandbytes warning')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kernels-community" not in proc.stderr and "a real bitsandbytes warning" in proc.stderr
