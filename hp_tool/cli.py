"""Hydra entry point: compose -> validate -> plan -> (launch -> collect). Also the `hp-tool` script.

Configs live in the package (``hp_tool/conf``, Hydra search path ``pkg://hp_tool.conf``), so an
installed ``hp-tool`` finds them from any directory. ``-m`` (multirun) runs one plan per combination and
writes a comparison table beside them (hp_tool/compare.py).
"""

from __future__ import annotations

import logging
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from hp_tool.compare import comparison_row, error_row
from hp_tool.config import GROUPS, AppConfig, check_override_keys, memory_check_mode, to_app_config
from hp_tool.errors import ConfigError
from hp_tool.hf_config import model_name
from hp_tool.launch.backends import warm
from hp_tool.memory_check import Tracer, trace_device
from hp_tool.plan_output import render_plan, write_plan
from hp_tool.planner import Plan, make_plan
from hp_tool.launch.lock import ResultsLock
from hp_tool.wandb_key import check_key_file

if TYPE_CHECKING:  # the launch stack is imported only when a search launches (see _launch_backend)
    from hp_tool.launch.backends.base import Backend

log = logging.getLogger("hp_tool")

CONF_MODULE = "hp_tool.conf"
CONF_DIR = Path(__file__).resolve().parent / "conf"


def compose(overrides: list[str] = ()) -> tuple[DictConfig, str]:
    """The config `main.py` would see for these command-line overrides, and the search_config name."""
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    name = cfg.hydra.runtime.choices["search_config"]
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, name


def results_dir(app: AppConfig, search_name: str) -> Path:
    """<base_results_dir>/<search_folder>/, relative to the directory the user runs from."""
    return Path(app.base_results_dir) / search_folder(app, search_name)


def search_folder(app: AppConfig, search_name: str) -> Path:
    """A search's folder under the results root: its search_config name (results/finetune/llama2_7b), except
    for a search config that names no model (finetune/custom: the model comes from the command line), whose
    searches would otherwise all share one folder and overwrite each other's plan: it is named after the model,
    finetune/<model name> (hf_config.model_name), with ``_custom`` added where that name is also a shipped
    preset's, so a preset's folder holds only its own search."""
    hf_config = app.search_config.model.hf_config
    if not app.search_config.finetune or not hf_config or _names_its_model(search_name):
        return Path(search_name)
    group = Path(search_name).parent
    name = model_name(hf_config)
    if (CONF_DIR / "search_config" / group / f"{name}.yaml").is_file():
        name += "_custom"
    return group / name


@lru_cache(maxsize=None)
def _names_its_model(search_name: str) -> bool:
    """Whether the search config sets model.hf_config itself (every preset but finetune/custom). One this
    package does not ship counts as naming its model: its folder stays its name."""
    path = CONF_DIR / "search_config" / f"{search_name}.yaml"
    return not path.is_file() or OmegaConf.select(OmegaConf.load(path), "model.hf_config", default=None) is not None


def _log_to_file(out: Path) -> logging.Handler:
    """After validation only: the orchestrator's log lives in the results directory."""
    path = out / "logs" / f"hp_tool_{time.strftime('%Y%m%d-%H%M%S')}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def _tracer(app: AppConfig, out: Path) -> Optional[Tracer]:
    """The memory tracer of memory_check=traced (with the traces an earlier run of this search kept), else
    None: the analytic check, and no torch import."""
    if memory_check_mode(app) != "traced":
        return None
    return Tracer.load(trace_device(app.gpu.name), out / "candidate_configs")


def _launch_backend(app: AppConfig, plan: Plan) -> Optional["Backend"]:
    """The backend the plan's trials would run on (None: no training trial launches); on SLURM, the
    partition and account are checked to hold each trial before any file is written."""
    if app.dry_run or not app.run_training_hp_search:
        return None
    # Imported here, as the searches below are: a dry run never loads the launch and results stack
    # (submitit, pandas, matplotlib), which would more than double its start-up time.
    from hp_tool.search import training_backend

    return training_backend(app, plan)


def run(app: AppConfig, search_name: str, out: Optional[Path] = None, plans: Optional[list] = None) -> int:
    """Plan (and unless dry_run, search) into ``out`` (default: results_dir). Returns the exit code;
    the plan is appended to ``plans`` when given. Bad input raises ConfigError before anything is written;
    so does a results folder that another orchestrator holds (unless wait_for_lock)."""
    out = out or results_dir(app, search_name)
    check_key_file(app.wandb)
    local_trials = app.cluster.type in ("local", "auto") and not app.dry_run and app.run_training_hp_search
    if memory_check_mode(app) == "traced" or (local_trials and warm.forks_trials(app.gpu.name)):
        warm.start()  # traces and local CPU trials fork from it: its imports overlap the planning
    plan = make_plan(app, search_name, out)
    backend = _launch_backend(app, plan)  # a SLURM target that can never run the trials fails here, in seconds
    tracer = _tracer(app, out)
    if tracer is not None:  # then the minutes of tracing, and the check again on what the trace selected
        plan = make_plan(app, search_name, out, tracer)
        backend = _launch_backend(app, plan)
    if plans is not None:
        plans.append(plan)
    serving = None
    if app.run_inference_hp_search:  # its settings checked before anything is written, dry run or not
        from hp_tool.inference.search import plan_inference

        serving = plan_inference(app, out)
    with ResultsLock(out).acquire(app.wait_for_lock):
        return _write_and_search(app, plan, search_name, out, backend, serving)


def _write_and_search(app: AppConfig, plan: Plan, search_name: str, out: Path,
                      backend: Optional["Backend"], serving=None) -> int:
    """Under the results folder's lock: write the plan (and the inference search's, ``serving``), then search (unless
    dry_run)."""
    handler = _log_to_file(out)
    try:
        write_plan(plan)
        print(render_plan(plan), flush=True)
        if app.dry_run:
            if serving is not None:
                from hp_tool.inference.search import plan_summary, write_configs

                write_configs(serving)
                print(plan_summary(serving), flush=True)
            log.info("Dry run: plan written to %s; no job submitted.", out)
            return 0
        code = 0
        if app.run_training_hp_search:
            from hp_tool.search import run_training_search  # not on the dry-run path (see _launch_backend)

            code = run_training_search(app, plan, backend)
        if app.run_inference_hp_search:
            from hp_tool.inference.search import run_inference_search  # not on the dry-run path either

            code = max(code, run_inference_search(app, search_name, out, serving))
        return code
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def _multirun_job(app: AppConfig, search_name: str) -> dict[str, Any]:
    """One job of a multirun: its plan under the job's own folder, and its row of the comparison."""
    out = Path(HydraConfig.get().runtime.output_dir) / search_folder(app, search_name)
    plans: list = []
    try:
        code = run(app, search_name, out, plans)
    except ConfigError as exc:
        print(f"hp_tool: error: {exc}", file=sys.stderr, flush=True)
        return error_row(app, search_name, HydraConfig.get().job.num, str(exc))
    return comparison_row(plans[0], app, HydraConfig.get().job.num, code)


@hydra.main(version_base="1.3", config_path=f"pkg://{CONF_MODULE}", config_name="config")
def _hydra_main(cfg: DictConfig) -> Optional[dict[str, Any]]:
    search_name = HydraConfig.get().runtime.choices["search_config"]
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        app = to_app_config(cfg)
        if multirun:
            return _multirun_job(app, search_name)
        code = run(app, search_name)
    except ConfigError as exc:
        print(f"hp_tool: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if code:
        sys.exit(code)
    return None


def available(group: str) -> list[str]:
    """The shipped options of a config group, e.g. available("gpu") -> ["a100_40gb", ...]."""
    root = CONF_DIR / group
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def available_search_configs() -> list[str]:
    return available("search_config")


def _check_args(argv: list[str]) -> None:
    """Before Hydra: every key exists (with or without +; moved keys name their new place) and every
    group option is shipped (Hydra alone only says 'not found'). Comma lists are multirun sweeps."""
    overrides = [a for a in argv if not a.startswith("-")]
    check_override_keys(overrides)
    for arg in overrides:
        group, sep, value = arg.partition("=")
        if sep and group in GROUPS:
            for name in value.split(","):
                if name not in available(group):
                    raise ConfigError(group, name, f"no such option under hp_tool/conf/{group}/",
                                      f"use one of {available(group)}")


def main() -> None:
    try:
        _check_args(sys.argv[1:])
    except ConfigError as exc:
        print(f"hp_tool: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    _hydra_main()
