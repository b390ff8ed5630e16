"""Weights & Biases: one run per trial (its metrics.jsonl, spec and result) and one for the summary.

``wandb`` itself, an optional dependency, is imported only when ``wandb.enable=true`` (``_import_wandb``).
The searches call this module after each job and with the ranked table the collector returns; nothing
below them imports it. The API key is the first line of ``wandb.api_key_file``; it is handed to wandb
inside this process only, through ``wandb.Settings(api_key=...)`` (``wandb.login(key=...)`` would also
save it to ~/.netrc), and is never printed, logged or written anywhere. With
``WANDB_MODE=offline`` no key is needed: runs are written under ``WANDB_DIR`` (default: the trial's
output directory, or the results directory) for a later ``wandb sync``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from hp_tool.config import WandbConfig
from hp_tool.errors import ConfigError
from hp_tool.results.trial_files import number, read_metrics
from hp_tool.sizing import size_label
from hp_tool.vocab import METRICS_FILE
from hp_tool.contracts.spec import TrialSpec
from hp_tool.wandb_key import check_key_file, offline, read_api_key

log = logging.getLogger(__name__)

INSTALL_FIX = 'pip install -e ".[wandb]", or set wandb.enable=false'
STEP_FIELDS = ("step_time_s", "loss", "lr", "tokens", "memory_gib")  # logged per step, by name


def _import_wandb():
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError("wandb.enable", True, f"wandb is not importable ({exc})", INSTALL_FIX) from exc
    return wandb


def check_wandb(cfg: WandbConfig) -> None:
    """At start, before any job: wandb importable and (unless offline) an API key readable."""
    if not cfg.enable:
        return
    _import_wandb()
    check_key_file(cfg)


def _init(cfg: WandbConfig, default_dir: Path, **kwargs: Any):
    wandb = _import_wandb()
    settings = wandb.Settings() if offline() else wandb.Settings(api_key=read_api_key(cfg))
    folder = Path(os.environ.get("WANDB_DIR") or default_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=cfg.project, dir=str(folder), settings=settings, reinit="create_new",
                      **kwargs)


def _group(spec: TrialSpec) -> str:
    """Model family and size, e.g. gpt3_5b: the trials of one search share a group."""
    size = size_label(spec.model.num_parameters) if spec.model.num_parameters else "custom"
    return f"{spec.model.family}_{size}"


def log_trial(spec: TrialSpec, output_dir: str | os.PathLike, result: dict, wandb_cfg: WandbConfig) -> None:
    """One W&B run for a finished trial: named by its trial id (model, size, layout); config = the
    TrialSpec; history = metrics.jsonl (seconds, GiB, tokens); summary = result.json's fields."""
    log_run(spec.trial_id, _group(spec), spec.to_dict(), output_dir, result, wandb_cfg)


def log_run(name: str, group: str, config: dict, output_dir: str | os.PathLike, result: dict,
            wandb_cfg: WandbConfig, job_type: str = "trial") -> None:
    """One W&B run for a finished job (a training trial or an inference config): per-step history from
    its metrics.jsonl when there is one, the result's fields as the summary."""
    output_dir = Path(output_dir)
    steps, _ = read_metrics(output_dir / METRICS_FILE) if (output_dir / METRICS_FILE).is_file() else ([], 0)
    run = _init(wandb_cfg, output_dir, name=name, group=group, job_type=job_type, config=config)
    ok = result.get("status") == "ok"
    try:
        last = 0
        for s in steps:
            row = {k: number(s.get(k)) for k in STEP_FIELDS if number(s.get(k)) is not None}
            step = s.get("step")
            if isinstance(step, int) and step > last:  # wandb drops steps that go backwards
                run.log({**row, "timed": bool(s.get("timed"))}, step=step)
                last = step
        run.summary.update({k: v for k, v in result.items() if v is not None})
    finally:
        run.finish(exit_code=0 if ok else 1)


def _cells(df: pd.DataFrame) -> pd.DataFrame:
    """Plain Python values (None for missing) so wandb.Table accepts nullable integer columns."""
    return df.astype(object).where(df.notna(), None)


def log_summary(table: pd.DataFrame, wandb_cfg: WandbConfig, results_dir: Path,
                name: Optional[str] = None) -> None:
    """One W&B run holding the collected table (every candidate) and the best row in its summary."""
    wandb = _import_wandb()
    run = _init(wandb_cfg, Path(results_dir), name=name or "summary", job_type="summary",
                config={"results_dir": str(results_dir)})
    try:
        run.log({"all_trials": wandb.Table(dataframe=_cells(table))})
        if "rank" in table:  # training: ranked trials; inference: the frame is ordered best first
            ranked = table[table["rank"].notna()].sort_values("rank")
        else:
            ranked = table[table["status"] == "ok"]
        if not ranked.empty:
            best = _cells(ranked.head(1)).iloc[0].to_dict()
            run.summary.update({f"best/{k}": v for k, v in best.items() if v is not None})
        run.summary.update({"trials": len(table), "succeeded": len(ranked)})
    finally:
        run.finish()
