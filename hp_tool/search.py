"""The training search after planning: launch or resume the trials, watch them, collect the results."""

from __future__ import annotations

import logging
import shlex
import sys

from hp_tool.config import AppConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.executors import check_slurm_target
from hp_tool.launch.monitor import Progress
from hp_tool.launch.runner import Launcher
from hp_tool.planner import Plan

log = logging.getLogger(__name__)


def _same_command(extra: str = "") -> str:
    args = [a for a in sys.argv[1:] if not a.startswith(("detach=", "cancel="))]
    return " ".join(["python3", "main.py", *map(shlex.quote, args), extra]).strip()


def _trial_logger(app: AppConfig):
    if not app.wandb.enable:
        return None
    from hp_tool import tracking

    return lambda spec, result: tracking.log_trial(spec, spec.run.output_dir, result, app.wandb)


def run_training_search(app: AppConfig, plan: Plan, kind: str) -> int:
    """Launch (or resume) the plan's trials with the ``kind`` of executor (`slurm` or `local`, from
    executors.resolve_kind), wait for all, then write the final results.
    Returns the exit code: 0 when at least one trial succeeded."""
    if app.wandb.enable:
        from hp_tool import tracking

        tracking.check_wandb(app.wandb)
    if kind == "slurm":
        check_slurm_target(app.cluster)
    elif app.detach:
        raise ConfigError("detach", True, "a detached search needs SLURM (local trials die with the shell)",
                          "drop detach=true, or use cluster=bcm")
    log.info("Launching %d trials with the %s executor", len(plan.specs), kind)
    progress = Progress()
    launcher = Launcher(app, plan.results_dir, plan.specs, kind, progress, _trial_logger(app))
    launcher.resume()
    if app.cancel:
        n = launcher.cancel_all()
        print(f"Cancelled {n} jobs of {plan.search_name}; {len(launcher.pending)} trials were never submitted.")
        return 0
    if app.detach:
        launcher.submit_all_now()
        print(f"Submitted; to watch and collect later run:\n  {_same_command()}\n"
              f"to cancel:\n  {_same_command('cancel=true')}")
        return 0
    try:
        with progress:
            launcher.run()
    except KeyboardInterrupt:
        print(f"\nInterrupted: submitted jobs keep running. Resume with:\n  {_same_command()}\n"
              f"or cancel them with:\n  {_same_command('cancel=true')}", file=sys.stderr)
        return 130
    from hp_tool.results.report import finalize

    return finalize(plan.results_dir, app)
