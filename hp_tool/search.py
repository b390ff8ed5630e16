"""The training search after planning: launch or resume the trials, watch them, collect the results.

Shared with the inference search (hp_tool/inference/search.py): ``preflight`` checks the SLURM target
before anything is written, ``launch`` runs any list of JobSpecs through the one launcher with detach,
cancel and Ctrl-C handling.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Callable, Optional

from hp_tool.config import AppConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.job import JobSpec, trial_job
from hp_tool.launch.ledger import search_id
from hp_tool.launch.monitor import Progress
from hp_tool.launch.runner import Launcher
from hp_tool.launch.slurm import check_slurm_target
from hp_tool.planner import Plan
from hp_tool.contracts.result import empty_result
from hp_tool.contracts.spec import TrialSpec

log = logging.getLogger(__name__)

INTERRUPTED = 130


def _same_command(extra: str = "") -> str:
    args = [a for a in sys.argv[1:] if not a.startswith(("detach=", "cancel="))]
    return " ".join(["python3", "main.py", *map(shlex.quote, args), extra]).strip()


def trial_job_spec(spec: TrialSpec, config_path: Path) -> JobSpec:
    """The launcher's view of a training trial."""
    fp = spec.fingerprint()
    return JobSpec(spec.trial_id, str(config_path), str(spec.run.output_dir), spec.resources.num_nodes,
                   spec.resources.gpus_per_node, spec.run.max_minutes, fp, trial_job,
                   blank={**empty_result(spec.trial_id, fp), "versions": None})  # the job's, not ours


def preflight(app: AppConfig, jobs: list[JobSpec]) -> None:
    """SLURM: the partition and account exist and can ever hold each job (ConfigError otherwise)."""
    per_task = app.cluster.cpus_per_task or 1  # unset: the node's CPUs are shared, at least one each
    check_slurm_target(app.cluster, [(j.name, j.num_nodes, j.tasks_per_node, j.tasks_per_node * per_task)
                                     for j in jobs])


def plan_jobs(plan: Plan) -> list[JobSpec]:
    cand_dir = plan.results_dir / "candidate_configs"
    return [trial_job_spec(s, cand_dir / f"{s.trial_id}.yaml") for s in plan.specs]


def launch(app: AppConfig, kind: str, results_dir: Path, ledger_dir: Path, jobs: list[JobSpec],
           on_end: Optional[Callable[[JobSpec, dict], None]] = None, max_parallel: Optional[int] = None,
           what: str = "trials", gate: Optional[Callable[[JobSpec], Optional[tuple[str, str]]]] = None,
           watch: Optional[Callable[[JobSpec, float], Optional[tuple[str, str]]]] = None) -> Optional[Launcher]:
    """Submit, resume, detach or cancel ``jobs``; returns the launcher once every job has ended, None when
    the command only detached or cancelled. Raises KeyboardInterrupt after telling how to resume.
    On SLURM the caller has run ``preflight`` before writing any file."""
    if kind != "slurm" and app.detach:
        raise ConfigError("detach", True, "a detached search needs SLURM (local jobs die with the shell)",
                          "drop detach=true, or use cluster=bcm")
    log.info("Launching %d %s with the %s executor", len(jobs), what, kind)
    progress = Progress()
    launcher = Launcher(app, ledger_dir, jobs, kind, progress, search_id(results_dir), on_end, gate, watch)
    launcher.resume()
    if app.cancel:
        n = launcher.cancel_all()
        print(f"Cancelled {n} jobs; {len(launcher.pending)} {what} were never submitted.")
        return None
    if app.detach:
        launcher.submit_all_now()
        print(f"Submitted; to watch and collect later run:\n  {_same_command()}\n"
              f"to cancel:\n  {_same_command('cancel=true')}")
        return None
    try:
        with progress:
            launcher.run(max_parallel)
    except KeyboardInterrupt:
        print(f"\nInterrupted: submitted jobs keep running. Resume with:\n  {_same_command()}\n"
              f"or cancel them with:\n  {_same_command('cancel=true')}", file=sys.stderr)
        raise
    for name, cause in launcher.hook_failures:
        print(f"W&B: {name} was not uploaded ({cause}); its files are complete.", file=sys.stderr)
    return launcher


def _trial_logger(app: AppConfig, specs: dict[str, TrialSpec]):
    if not app.wandb.enable:
        return None
    from hp_tool import tracking

    return lambda job, result: tracking.log_trial(specs[job.name], job.out, result, app.wandb)


def _chain(*hooks: Optional[Callable[[JobSpec, dict], None]]) -> Callable[[JobSpec, dict], None]:
    """One after-job hook that calls each of ``hooks`` (None: skipped) in turn."""
    def on_end(job: JobSpec, result: dict) -> None:
        for hook in hooks:
            if hook is not None:
                hook(job, result)
    return on_end


def plan_options(plan: Plan) -> list:
    """The adaptive search's view of the plan's selected candidates (hp_tool/adaptive.py's Option)."""
    from hp_tool.adaptive import Option
    from hp_tool.vocab import SELECTED
    from hp_tool.planner import candidate_trial_id

    return [Option(candidate_trial_id(plan.model, c), c.tp, c.pp, c.compute_time_s, c.comm_time_s, c.memory_gb)
            for c in plan.candidates if c.status == SELECTED]


class AdaptiveGate:
    """The adaptive search's decisions as the Launcher asks for them: its ``gate`` (a verdict on a trial
    about to be submitted) and its ``watch`` (stop a running trial that is losing), from the plan's
    predictions and the trials ended so far as the collector tables them (full-run step times
    extrapolated as the ranking does). The ended trials are read again only after a trial ends ok or out
    of memory (``ended``, called after each job), the only outcomes the decisions depend on. A decision
    that cannot be made launches the trial, or lets it run."""

    def __init__(self, options: list, results_dir: Path, skip_margin: float):
        from hp_tool.results.collect import full_run_for, read_plan

        self.options, self.results_dir, self.skip_margin = options, results_dir, skip_margin
        self.full = full_run_for(results_dir)
        self.plan_rows = {row["trial_id"]: row for row in read_plan(results_dir)}
        self._decided: Optional[tuple[list, dict[str, tuple[str, str]]]] = None  # (outcomes, verdicts)
        self._metrics_size: dict[str, int] = {}  # a running trial's metrics.jsonl size when last judged

    def __call__(self, job: JobSpec) -> Optional[tuple[str, str]]:
        try:
            return self._decisions()[1].get(job.name)
        except Exception as exc:  # noqa: BLE001 - a decision that cannot be made launches the trial
            log.warning("%s: adaptive decision failed (%s: %s); launching it", job.name, type(exc).__name__, exc)
            return None

    def watch(self, job: JobSpec, submitted: float) -> Optional[tuple[str, str]]:
        try:
            return self._losing(job, submitted)
        except Exception as exc:  # noqa: BLE001 - a decision that cannot be made lets the trial run
            log.warning("%s: early-stop decision failed (%s: %s); it runs on", job.name, type(exc).__name__, exc)
            return None

    def ended(self, job: JobSpec, result: dict) -> None:
        if result.get("status") in ("ok", "oom"):
            self._decided = None

    def _decisions(self) -> tuple[list, dict[str, tuple[str, str]]]:
        from hp_tool.adaptive import Outcome, verdicts
        from hp_tool.results.collect import RANK_COLUMN, collect_trials

        if self._decided is None:
            df = collect_trials(self.results_dir, full=self.full)
            ended = df[((df["status"] == "ok") & df[RANK_COLUMN].notna()) | (df["status"] == "oom")]
            outcomes = [Outcome(r.trial_id, r.status, getattr(r, RANK_COLUMN)) for r in ended.itertuples()]
            self._decided = outcomes, verdicts(self.options, outcomes, self.skip_margin)
        return self._decided

    def _losing(self, job: JobSpec, submitted: float) -> Optional[tuple[str, str]]:
        from hp_tool.adaptive import losing
        from hp_tool.results.collect import full_run_columns
        from hp_tool.results.trial_files import number, read_metrics, timing_of
        from hp_tool.vocab import METRICS_FILE

        path = Path(job.out) / METRICS_FILE
        size = path.stat().st_size if path.is_file() else 0
        if size == self._metrics_size.get(job.name, 0):
            return None  # no new step since it was last judged
        self._metrics_size[job.name] = size
        steps, _ = read_metrics(path)
        fresh = [s for s in steps if (number(s.get("time")) or 0) >= submitted]  # not an earlier run's
        timing = timing_of(fresh)
        measured = timing["step_time_s_median"]
        if measured is None:
            return None
        row = dict(self.plan_rows[job.name], measured_step_time_s=measured)
        full_run_s = full_run_columns(row, self.full).get("full_run_step_time_s")
        return losing(job.name, measured, timing["steps_measured"], full_run_s, self._decisions()[0],
                      self.skip_margin)


def ordered_for_adaptive(options: list, jobs: list[JobSpec]) -> list[JobSpec]:
    """``jobs`` most promising first, spread over the TP/PP regimes (adaptive.launch_order)."""
    from hp_tool.adaptive import launch_order

    rank = {name: i for i, name in enumerate(launch_order(options))}
    return sorted(jobs, key=lambda j: rank.get(j.name, len(rank)))


def run_training_search(app: AppConfig, plan: Plan, kind: str) -> int:
    """Launch (or resume) the plan's trials with the ``kind`` of executor (`slurm` or `local`, from
    executors.resolve_kind), wait for all, then write the final results.
    Returns the exit code: 0 when at least one trial succeeded."""
    if app.wandb.enable:
        from hp_tool import tracking

        tracking.check_wandb(app.wandb)
    jobs = plan_jobs(plan)
    specs = {s.trial_id: s for s in plan.specs}
    ts = app.search_config.train_settings
    on_end, gate = _trial_logger(app, specs), None
    if ts.search_strategy == "adaptive":
        options = plan_options(plan)
        jobs = ordered_for_adaptive(options, jobs)
        gate = AdaptiveGate(options, plan.results_dir, ts.skip_margin)
        on_end = _chain(gate.ended, on_end)
    try:
        launcher = launch(app, kind, plan.results_dir, plan.results_dir, jobs, on_end, gate=gate,
                          watch=None if gate is None else gate.watch)
    except KeyboardInterrupt:
        return INTERRUPTED
    if launcher is None:
        return 0
    from hp_tool.results.report import finalize

    return finalize(plan.results_dir, app)
