"""Hydra entry point: compose -> validate -> plan -> (launch -> collect). Also the `hp-tool` script."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from hp_tool.config import AppConfig, to_app_config
from hp_tool.errors import ConfigError

log = logging.getLogger("hp_tool")

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def compose(overrides: list[str] = ()) -> tuple[DictConfig, str]:
    """The config `main.py` would see for these command-line overrides, and the search_config name."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    name = cfg.hydra.runtime.choices["search_config"]
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, name


def results_dir(app: AppConfig, search_name: str) -> Path:
    """<base_results_dir>/<search_config>/, relative to the directory the user runs from."""
    return Path(app.base_results_dir) / search_name


def _log_to_file(out: Path) -> None:
    """After validation only: the orchestrator's log lives in the results directory."""
    path = out / "logs" / f"hp_tool_{time.strftime('%Y%m%d-%H%M%S')}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)


def run(app: AppConfig, search_name: str) -> int:
    """Plan (and unless dry_run, search). Returns the process exit code."""
    from hp_tool.plan_output import render_plan, write_plan
    from hp_tool.planner import make_plan

    out = results_dir(app, search_name)
    plan = make_plan(app, search_name, out)  # raises ConfigError before anything is written
    _log_to_file(out)
    write_plan(plan)
    print(render_plan(plan), flush=True)
    if app.dry_run:
        log.info("Dry run: plan written to %s; no job submitted.", out)
        return 0
    code = 0
    if app.run_training_hp_search:
        from hp_tool.search import run_training_search

        code = run_training_search(app, plan)
    if app.run_inference_hp_search and not (app.detach or app.cancel):
        from hp_tool.inference.search import run_inference_search

        code = max(code, run_inference_search(app, search_name, out))
    return code


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    search_name = HydraConfig.get().runtime.choices["search_config"]
    try:
        app = to_app_config(cfg)
        code = run(app, search_name)
    except ConfigError as exc:
        print(f"hp_tool: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if code:
        sys.exit(code)


def available_search_configs() -> list[str]:
    root = Path(CONF_DIR) / "search_config"
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def _check_search_config_arg(argv: list[str]) -> None:
    """Name the unknown search_config and list the shipped ones (Hydra alone only says 'not found')."""
    for arg in argv:
        if arg.startswith("search_config="):
            name = arg.split("=", 1)[1]
            if name not in available_search_configs():
                err = ConfigError("search_config", name, "no such search config under conf/search_config/",
                                  f"use one of {available_search_configs()}")
                print(f"hp_tool: error: {err}", file=sys.stderr)
                sys.exit(2)


def main() -> None:
    _check_search_config_arg(sys.argv[1:])
    _hydra_main()
