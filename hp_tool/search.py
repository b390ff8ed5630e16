"""The training search after planning: the plan's trials as jobs, launched through a launch session
(hp_tool/session.py: resume, detach, cancel, Ctrl-C), in the adaptive order behind the adaptive gate
(hp_tool/adaptive_gate.py) when ``search_strategy=adaptive``; then the confirmation round (the fastest
``confirm_top`` trials timed once more, each into ``training_logs/<trial_id>/confirm/``, so the report can say
how far a trial's time moves between runs and whether the top picks are apart beyond it); then the collected
table written, printed and, with ``wandb.enable=true``, logged to W&B.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

from hp_tool import tracking  # wandb itself is imported only when enabled (tracking._import_wandb)
from hp_tool.adaptive_gate import adaptive_launch
from hp_tool.config import AppConfig
from hp_tool.contracts.result import empty_result
from hp_tool.contracts.spec import TrialSpec, dump_spec
from hp_tool.deepspeed_ops import build_deepspeed_ops, needs_deepspeed_ops
from hp_tool.launch.backends import Backend
from hp_tool.launch.job import JobSpec, trial_job
from hp_tool.launch.ledger import Ledger
from hp_tool.planner import Plan
from hp_tool.results.collect import collect_trials, successful
from hp_tool.results.report import FINAL_DIR, FinalResults, collect_and_report
from hp_tool.session import Hook, LaunchSession, chain, prepare_backend
from hp_tool.vocab import CONFIRM_DIR

log = logging.getLogger(__name__)


def trial_job_spec(spec: TrialSpec, config_path: Path) -> JobSpec:
    """The launcher's view of a training trial."""
    fp = spec.fingerprint()
    return JobSpec(spec.trial_id, str(config_path), str(spec.run.output_dir), spec.resources.num_nodes,
                   spec.resources.gpus_per_node, spec.run.max_minutes, fp, trial_job,
                   blank={**empty_result(spec.trial_id, fp), "versions": None})  # the job's, not ours


def plan_jobs(plan: Plan) -> list[JobSpec]:
    """One job per trial of the plan, reading its candidate_configs/<trial_id>.yaml."""
    cand_dir = plan.results_dir / "candidate_configs"
    return [trial_job_spec(s, cand_dir / f"{s.trial_id}.yaml") for s in plan.specs]


def training_backend(app: AppConfig, plan: Plan) -> Backend:
    """The backend the plan's trials run on, its preflight passed (on SLURM the partition and account are
    checked to hold each trial), before any file is written."""
    return prepare_backend(app, plan_jobs(plan))


def _trial_logger(app: AppConfig, specs: dict[str, TrialSpec]) -> Optional[Hook]:
    """After-job hook logging each ended trial as a W&B run; None when W&B is off."""
    if not app.wandb.enable:
        return None
    return lambda job, result: tracking.log_trial(specs[job.name], job.out, result, app.wandb)


def run_training_search(app: AppConfig, plan: Plan, backend: Backend) -> int:
    """Launch (or resume) the plan's trials on ``backend`` (from training_backend), wait for all, then write
    the final results.
    Returns the exit code: 0 when at least one trial succeeded."""
    tracking.check_wandb(app.wandb)
    jobs = plan_jobs(plan)
    ts = app.search_config.train_settings
    on_end, gate = _trial_logger(app, {s.trial_id: s for s in plan.specs}), None
    if ts.search_strategy == "adaptive":
        jobs, gate = adaptive_launch(plan, jobs, ts.skip_margin)
        on_end = chain(gate.ended, on_end)
    if needs_deepspeed_ops(plan.specs):
        build_deepspeed_ops()  # here, not inside a timed trial
    session = LaunchSession(app.cluster, backend, plan.results_dir, plan.results_dir, app.detach, app.cancel,
                            on_end=on_end, gate=gate, watch=None if gate is None else gate.watch)
    code = session.launch(jobs)
    if code is not None:
        if app.cancel:
            _cancel_confirmation(app, plan, backend)
        return code
    confirm = confirmation_jobs(plan, ts.confirm_top)
    if confirm:
        log.info("Confirmation round: timing the %d fastest trials again", len(confirm))
        code = LaunchSession(app.cluster, backend, plan.results_dir, plan.results_dir, app.detach, app.cancel,
                             what="confirmation runs").launch(confirm)
        if code is not None:
            return code
    return finalize(plan.results_dir, app)


def _cancel_confirmation(app: AppConfig, plan: Plan, backend: Backend) -> None:
    """``cancel=true`` also cancels the confirmation round's jobs this search submitted (they are its jobs)."""
    submitted = Ledger(plan.results_dir).latest()
    confirm = [j for j in confirmation_jobs(plan, app.search_config.train_settings.confirm_top)
               if j.name in submitted]
    if confirm:
        LaunchSession(app.cluster, backend, plan.results_dir, plan.results_dir, cancel=True,
                      what="confirmation runs").launch(confirm)


def confirmation_jobs(plan: Plan, top: int) -> list[JobSpec]:
    """The confirmation round: the ``top`` fastest trials measured so far (by their first run's full-run step
    time), each to run once more as it ran, into ``training_logs/<trial_id>/confirm/`` from
    ``candidate_configs/confirm/<trial_id>.yaml`` (the same spec and fingerprint, another folder). The
    collector ranks these trials among themselves by the mean of their two runs. A resumed search asks for
    the same trials (the second runs only reorder them), so the ledger finds them done."""
    if top <= 0:
        return []
    specs = {s.trial_id: s for s in plan.specs}
    first = successful(collect_trials(plan.results_dir))
    chosen = [t for t in first.sort_values(["full_run_step_time_s", "trial_id"])["trial_id"] if t in specs][:top]
    jobs = []
    for trial_id in chosen:
        spec = specs[trial_id]
        again = dataclasses.replace(spec, run=dataclasses.replace(
            spec.run, output_dir=str(Path(spec.run.output_dir) / CONFIRM_DIR)))
        path = dump_spec(again, plan.results_dir / "candidate_configs" / CONFIRM_DIR / f"{trial_id}.yaml")
        jobs.append(dataclasses.replace(trial_job_spec(again, path), name=f"{trial_id}.{CONFIRM_DIR}"))
    return jobs


def finalize(results_dir: Path, app: AppConfig) -> int:
    """Collect every trial, write final_results/*, print the summary and log it to W&B when enabled.

    Returns 0 when at least one trial succeeded, else 1.
    """
    final = collect_and_report(Path(results_dir), app)
    if app.wandb.enable:
        _summary_to_wandb(final, app, Path(results_dir))
    return final.exit_code()


def _summary_to_wandb(final: FinalResults, app: AppConfig, results_dir: Path) -> None:
    """One W&B run holding the collected table; a failure is logged, the files stand."""
    full = final.full
    name = f"{full.base.model.family}_{full.label}_{full.num_nodes}nodes_summary"
    try:
        tracking.log_summary(final.table, app.wandb, results_dir, name)
    except Exception as exc:  # noqa: BLE001 - the files above are the result; W&B is a copy of them
        log.error("Logging the summary to W&B failed (%s: %s); the files in %s are complete",
                  type(exc).__name__, exc, results_dir / FINAL_DIR)
