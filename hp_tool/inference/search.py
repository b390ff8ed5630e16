"""The inference search: plan the TP x PP x batch grid, run each valid layout as a job, rank what ran.

    run_inference_search(app, search_name, results_dir)

Jobs go through submitit like the training trials: one job of TP*PP tasks per config, on this machine
(``LocalExecutor``, one at a time) or SLURM (``AutoExecutor`` with the cluster's partition, account,
container and setup lines). Results live under ``<results_dir>/inference/``; a config with a result.json
is not run again, so re-running the same command resumes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from hp_tool.base_config import choose_model, resolve_cluster
from hp_tool.config import AppConfig
from hp_tool.inference import report
from hp_tool.inference.grid import (FP32_BYTES, HALF_BYTES, InferenceCandidate, InferenceJobConfig,
                                    dump_job_config, plan_grid)
from hp_tool.launch import job as jobmod
from hp_tool.launch.executors import make_executor, resolve_kind
from hp_tool.trial.spec import ModelSpec

log = logging.getLogger(__name__)

GRACE_S = 120.0  # past a job's time limit before it is cancelled and recorded as timeout
POLL_MIN_S = 0.5
POLL_MAX_S = {"local": 1.0, "slurm": 15.0}  # local jobs are short; SLURM is polled gently
REPEATS, WARMUP = 10, 2  # timed and untimed generations per config


def inference_job(config_path: str) -> dict:
    """The submitted function; imports torch only inside the job, never in the orchestrator."""
    from hp_tool.inference.worker import inference_job as run

    return run(config_path)


@dataclass
class InferencePlan:
    candidates: list[InferenceCandidate]
    configs: dict[str, InferenceJobConfig]  # config_id -> job config, valid candidates only
    root: Path  # <results_dir>/inference

    def config_path(self, config_id: str) -> Path:
        return self.root / "candidate_configs" / f"{config_id}.yaml"


def plan_inference(app: AppConfig, results_dir: Path) -> InferencePlan:
    """The checked grid and one job config per valid layout. Pure: raises ConfigError, writes nothing."""
    cluster = resolve_cluster(app)
    model = choose_model(app, cluster)
    inf, ts = app.search_config.inference_settings, app.search_config.train_settings
    bytes_per_value = FP32_BYTES if ts.precision == "fp32" else HALF_BYTES
    grid = plan_grid(model.shape, model.label, inf, cluster.hw, bytes_per_value)
    s = model.shape
    spec = ModelSpec(s.family, s.num_layers, s.hidden_size, s.num_attention_heads, s.num_kv_heads,
                     s.ffn_hidden_size, inf.vocab_size, s.seq_length,
                     init_method_std=round(0.64 / math.sqrt(s.hidden_size), 6),
                     num_parameters=model.num_parameters)
    root = Path(results_dir) / "inference"
    configs = {
        c.config_id: InferenceJobConfig(
            c.config_id, spec, c.tp, c.pp, c.batch_size, inf.input_seq_len, inf.output_seq_len,
            inf.start_id, inf.end_id, str(root / c.config_id), warmup=WARMUP, repeats=REPEATS,
            precision=ts.precision, max_minutes=ts.max_minutes_per_run)
        for c in grid if c.status == "valid"}
    return InferencePlan(grid, configs, root)


def make_inference_executor(kind: str, cfg: InferenceJobConfig, app: AppConfig):
    """The training search's executor for a TP*PP-task, one-node job (``make_executor`` reads only
    these fields of a trial spec, so the same SLURM parameters apply)."""
    like_spec = SimpleNamespace(trial_id=cfg.config_id, run=SimpleNamespace(max_minutes=cfg.max_minutes),
                                resources=SimpleNamespace(num_nodes=1, gpus_per_node=cfg.tp * cfg.pp))
    return make_executor(kind, Path(cfg.output_dir) / "job", like_spec, app.cluster)


@dataclass
class Running:
    cfg: InferenceJobConfig
    job: Any
    started: float


def _end_state(kind: str, r: Running) -> tuple[str, str]:
    """(status, reason) of a job that ended without writing result.json."""
    folder = Path(r.cfg.output_dir) / "job"
    tail = jobmod.log_tail(folder, str(r.job.job_id))
    if kind == "slurm":
        return jobmod.classify_slurm_end(str(r.job.state), tail)
    return "failed", "local job ended without a result" + (f"; log tail: {tail}" if tail else "")


def _finish(kind: str, r: Running) -> dict:
    result = report.read_result(Path(r.cfg.output_dir))
    if result is None:
        status, reason = _end_state(kind, r)
        result = report.empty_result(r.cfg)
        result.update(status=status, reason=reason)
        report.write_result(Path(r.cfg.output_dir), result)
    log.info("inference %s: %s", r.cfg.config_id, result.get("status"))
    return result


def _overdue(r: Running) -> bool:
    return time.time() - r.started > r.cfg.max_minutes * 60 + GRACE_S


def run_jobs(app: AppConfig, plan: InferencePlan, kind: str) -> None:
    """Submit every config without a result (local: one at a time; SLURM: up to max_parallel_runs) and
    wait for each, bounded by its time limit plus a grace period."""
    pending = [c for cid, c in plan.configs.items() if report.read_result(Path(c.output_dir)) is None]
    limit = 1 if kind == "local" else app.cluster.max_parallel_runs
    active: list[Running] = []
    delay = POLL_MIN_S
    while pending or active:
        while pending and len(active) < limit:
            cfg = pending.pop(0)
            job = make_inference_executor(kind, cfg, app).submit(inference_job,
                                                                 str(plan.config_path(cfg.config_id)))
            log.info("inference %s submitted as job %s", cfg.config_id, job.job_id)
            active.append(Running(cfg, job, time.time()))
        changed = False
        for r in list(active):
            if r.job.done():
                active.remove(r)
                _finish(kind, r)
                changed = True
            elif _overdue(r):
                log.warning("inference %s outlived its limit: cancelling", r.cfg.config_id)
                r.job.cancel()
                active.remove(r)
                result = report.empty_result(r.cfg)
                result.update(status="timeout", reason="job did not end within its time limit plus grace")
                report.write_result(Path(r.cfg.output_dir), result)
        delay = POLL_MIN_S if changed else min(POLL_MAX_S[kind], delay * 1.5)
        if active:
            time.sleep(delay)


def collect_rows(plan: InferencePlan) -> list[dict]:
    """One row per grid candidate: its result, or its planning verdict when it was not run."""
    rows = []
    for c in plan.candidates:
        row: dict[str, Any] = {"config_id": c.config_id, "tp": c.tp, "pp": c.pp, "batch_size": c.batch_size,
                               "num_gpus": c.gpus, "predicted_memory_gb": c.memory_gb}
        result = report.read_result(plan.root / c.config_id) if c.status == "valid" else None
        if result is None:
            status = c.status if c.status != "valid" else "failed"
            row.update(status=status, reason=c.reason or "no result")
        else:
            row.update({k: v for k, v in result.items() if k in report.SUMMARY_COLUMNS})
        rows.append(row)
    return rows


def write_summary(app: AppConfig, plan: InferencePlan, results_dir: Path):
    """final_output.csv and the latency-throughput plot; returns the ranked frame."""
    inf = app.search_config.inference_settings
    frame = report.summary_frame(collect_rows(plan), inf.max_latency_ms)
    out = Path(results_dir) / report.SUMMARY_DIR
    report.write_summary_csv(frame, out / report.SUMMARY_CSV)
    report.plot_latency_vs_throughput(frame, inf.max_latency_ms, out / report.PLOT_FILE)
    log.info("inference summary written to %s", out)
    return frame


def write_configs(plan: InferencePlan) -> None:
    for cid, cfg in plan.configs.items():
        dump_job_config(cfg, plan.config_path(cid))


def run_inference_search(app: AppConfig, search_name: str, results_dir: Path,
                         kind: Optional[str] = None) -> int:
    """Plan, launch, collect and rank the inference search; 0 when a config met the latency bound (or
    at least one ran), else 1. ConfigError (before anything is written) when nothing valid is left."""
    plan = plan_inference(app, results_dir)
    kind = kind or resolve_kind(app, [(1, c.tp * c.pp) for c in plan.configs.values()])
    write_configs(plan)
    log.info("inference search %s: %d configs to measure (%s)", search_name, len(plan.configs), kind)
    run_jobs(app, plan, kind)
    frame = write_summary(app, plan, results_dir)
    inf = app.search_config.inference_settings
    print(f"Inference search {search_name}: best layouts (latency bound {inf.max_latency_ms:g} ms)")
    print(report.render_top(frame, inf.top_n), flush=True)
    return 0 if (frame["status"] == "ok").any() else 1
