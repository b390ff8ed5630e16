"""Searches of gpt3/tiny run in the test process on the in-process backend (cluster=in_process), one process
per trial; the real-subprocess searches (cluster=local) build their own command lines. No tests here."""

from __future__ import annotations

from pathlib import Path

from hp_tool.cli import compose, results_dir, run
from hp_tool.config import AppConfig, to_app_config

TS = "search_config.train_settings"
ONE_PROCESS = (f"{TS}.gpus_per_node=1", f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.pipeline_parallel_sizes=[1]")


def in_process_app(tmp_path: Path, *overrides: str) -> tuple[AppConfig, str]:
    """gpt3/tiny on cluster=in_process with one-process trials, results under tmp_path/res, plus overrides."""
    cfg, name = compose(["search_config=gpt3/tiny", "cluster=in_process", "memory_check=analytic", *ONE_PROCESS,
                         f"base_results_dir={tmp_path / 'res'}", *overrides])
    return to_app_config(cfg), name


def search_here(tmp_path: Path, *overrides: str) -> tuple[int, Path]:
    """Run the command `python3 main.py` would, in this process; returns (exit code, results folder)."""
    app, name = in_process_app(tmp_path, *overrides)
    return run(app, name), results_dir(app, name)
