"""The full training run a search is for, read from the planner's ``base_cfg_<label>.yaml``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hp_tool.architectures import Shape
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import Hardware
from hp_tool.contracts.spec import TrialSpec, load_spec

log = logging.getLogger(__name__)

BASE_PREFIX = "base_cfg_"


@dataclass(frozen=True)
class FullRun:
    """Shape, cluster and schedule of the full run; memory in GiB, price in dollars per GPU-hour."""

    label: str  # model size label used in file names, e.g. 5b
    base: TrialSpec
    path: Path

    @property
    def shape(self) -> Shape:
        return self.base.model.shape()

    @property
    def epoch_tokens(self) -> Optional[float]:
        """Tokens in one pass over a fine-tuning run's data; None for pretraining."""
        return self.base.full_run.epoch_tokens

    @property
    def hw(self) -> Hardware:
        return self.base.resources.hardware()

    @property
    def num_nodes(self) -> int:
        return self.base.full_run.num_nodes

    @property
    def max_steps(self) -> int:
        """Optimizer steps of the full run."""
        return self.base.full_run.max_steps

    @property
    def gpu_memory_gib(self) -> float:
        return self.base.resources.gpu_memory_gib

    @property
    def gpu_hour_price(self) -> Optional[float]:
        return self.base.resources.gpu_hour_price

    @property
    def peak_tflops_per_gpu(self) -> float:
        return self.base.resources.peak_tflops_per_gpu


def _label(path: Path) -> str:
    return path.stem[len(BASE_PREFIX):]


def find_base_config(results_dir: Path, trial_ids: tuple[str, ...] = ()) -> Path:
    """The base config of this search: the one whose label the trial ids carry, else the newest."""
    found = sorted(results_dir.glob(f"{BASE_PREFIX}*.yaml"))
    if not found:
        raise ConfigError("results_dir", str(results_dir), f"has no {BASE_PREFIX}<size>.yaml",
                          "run the planner first (python3 main.py search_config=... dry_run=true)")
    matching = [p for p in found if any(f"_{_label(p)}_tp" in t or f"_{_label(p)}_s" in t for t in trial_ids)]
    if len(matching) == 1:
        return matching[0]
    newest = max(matching or found, key=lambda p: p.stat().st_mtime)
    if len(found) > 1:
        log.warning("Several base configs in %s; using the newest, %s", results_dir, newest.name)
    return newest


def load_full_run(results_dir: Path, trial_ids: tuple[str, ...] = ()) -> FullRun:
    path = find_base_config(results_dir, trial_ids)
    return FullRun(_label(path), load_spec(path), path)
