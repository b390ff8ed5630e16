"""The inference search: plan the TP x PP x batch grid, run each valid layout as a job, rank what ran.

    run_inference_search(app, search_name, results_dir)

Jobs go through the launch session the training search uses too (hp_tool/session.py): one job of TP*PP
tasks per config, with the same ledger (``inference/jobs.jsonl``), re-attach, resume, detach, cancel,
Ctrl-C, SLURM checks and time limits from the job's start; each ended config and the summary go to W&B. ``inference/candidate_configs/plan.csv`` lists every
layout with its verdict and fingerprint; a result of another configuration is shown ``stale``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import logging
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hp_tool import tracking  # wandb itself is imported only when enabled (tracking._import_wandb)
from hp_tool.base_config import choose_model, model_spec, resolve_cluster
from hp_tool.config import AppConfig, training_precision
from hp_tool.contracts.vllm import serve_command
from hp_tool.errors import ConfigError
from hp_tool.families import family, family_names
from hp_tool.hf_config import checkpoint_of
from hp_tool.fingerprint import STALE, stale_reason
from hp_tool.fsutil import atomic_write_text
from hp_tool.inference import report
from hp_tool.inference.grid import (FP32_BYTES, HALF_BYTES, IS, SERVING_ENGINES, InferenceCandidate,
                                    InferenceJobConfig, dump_job_config, plan_grid)
from hp_tool.launch.job import JobSpec
from hp_tool.results.report_inputs import write_inference_report
from hp_tool.session import Hook, LaunchSession, prepare_backend
from hp_tool.vocab import NOT_RUN

log = logging.getLogger(__name__)

REPEATS, WARMUP = 10, 2  # timed and untimed generations per config


def inference_job(config_path: str) -> dict:
    """An inference config's entry; imports torch only inside the job, never in the orchestrator's planning."""
    from hp_tool.trial.inference_worker import run_inference  # here: the worker imports torch

    return run_inference(config_path)


@dataclass
class InferencePlan:
    candidates: list[InferenceCandidate]
    configs: dict[str, InferenceJobConfig]  # config_id -> job config, valid candidates only
    root: Path  # <results_dir>/inference
    model_path: Optional[str] = None  # what vLLM loads (the serve line's model), where known
    precision: str = "bf16"
    max_model_len: int = 0  # a request's prompt and output tokens
    gpu_hour_price: Optional[float] = None  # dollars per GPU-hour (the gpu preset's), for $ per million tokens

    def serve_line(self, frame) -> Optional[str]:
        """The ``vllm serve`` line of the ranked frame's top config that ran, at its batch as max-num-seqs; None
        where nothing ran or the checkpoint is unknown."""
        ok = frame[frame["status"] == "ok"]
        if ok.empty or self.model_path is None:
            return None
        top = self.configs[ok.iloc[0]["config_id"]]
        return serve_command(self.model_path, top.tp, top.pp, top.batch_size, self.precision, self.max_model_len,
                             top.weights, top.kv_cache, top.expert_parallel)

    def config_path(self, config_id: str) -> Path:
        return self.root / "candidate_configs" / f"{config_id}.yaml"


def plan_inference(app: AppConfig, results_dir: Path) -> InferencePlan:
    """The checked grid and one job config per valid layout. Pure: raises ConfigError, writes nothing."""
    cluster = resolve_cluster(app)
    model = choose_model(app, cluster)
    inf, ts = app.search_config.inference_settings, app.search_config.train_settings
    serving = SERVING_ENGINES[inf.engine]
    if not serving.any_family and not model.shape.facts.trial.inference:  # vLLM serves what it loads
        covered = [n for n in family_names() if family(n).trial.inference]
        raise ConfigError("run_inference_hp_search", True, f"hp_tool's own decode loop serves {covered}, not "
                          f"{model.shape.family}", "use search_config.inference_settings.engine=vllm (on GPU nodes "
                          "with vLLM), or set run_inference_hp_search=false")
    precision = training_precision(app)
    bytes_per_value = FP32_BYTES if precision == "fp32" else HALF_BYTES
    grid = plan_grid(model.shape, model.label, inf, cluster.hw, bytes_per_value, precision)
    spec = dataclasses.replace(model_spec(model.shape, model.num_parameters), vocab_size=inf.vocab_size)
    root = Path(results_dir) / "inference"
    path = checkpoint(app, model)
    configs = {
        c.config_id: InferenceJobConfig(
            c.config_id, spec, c.tp, c.pp, c.batch_size, inf.input_seq_len, inf.output_seq_len,
            inf.start_id, inf.end_id, str(root / c.config_id), warmup=WARMUP, repeats=REPEATS,
            precision=precision, max_minutes=ts.max_minutes_per_run, engine=inf.engine,
            model_path=path if serving.loads_checkpoint else None,
            weights=None if c.weights == precision else c.weights, kv_cache=None if c.kv_cache == precision else c.kv_cache,
            expert_parallel=c.expert_parallel)
        for c in grid if c.status == "valid"}
    return InferencePlan(grid, configs, root, path, precision, inf.input_seq_len + inf.output_seq_len,
                         cluster.gpu_hour_price)


def checkpoint(app: AppConfig, model) -> Optional[str]:
    """What vLLM loads to serve the model: inference_settings.model_path, else the checkpoint of a fine-tuning
    preset's Hugging Face config (hf_config.checkpoint_of); None for a model known only by its shape. A vLLM search
    without one is a ConfigError naming the key."""
    inf = app.search_config.inference_settings
    path = inf.model_path or (checkpoint_of(model.hf) if model.hf is not None else None)
    if SERVING_ENGINES[inf.engine].loads_checkpoint and path is None:
        raise ConfigError(f"{IS}.model_path", None, "vLLM serves a Hugging Face checkpoint, and this model "
                          f"({model.shape.family}, {model.label}) has none", f"set {IS}.model_path to a hub id or a "
                          "local checkpoint directory of the model, or use inference_settings.engine=hp_tool")
    return path


def inference_job_spec(cfg: InferenceJobConfig, config_path: Path) -> JobSpec:
    """The launcher's view of an inference config: one node, TP*PP tasks."""
    blank = report.empty_result(cfg)
    return JobSpec(cfg.config_id, str(config_path), cfg.output_dir, 1, cfg.tp * cfg.pp, cfg.max_minutes,
                   blank["fingerprint"], inference_job, blank=blank)


def collect_rows(plan: InferencePlan) -> list[dict]:
    """One row per grid candidate: its result, or its planning verdict when it was not run. A result
    whose fingerprint differs from the config's is shown as ``stale``, never ranked."""
    rows = []
    for c in plan.candidates:
        row = candidate_row(c, plan.gpu_hour_price)
        result = report.read_result(plan.root / c.config_id) if c.status == "valid" else None
        expected = plan.configs[c.config_id].fingerprint() if c.status == "valid" else None
        if result is None:
            status = c.status if c.status != "valid" else NOT_RUN
            row.update(status=status, reason=c.reason or "no result (never ran, or still pending)")
        elif result.get("fingerprint") != expected:
            row.update(status=STALE, reason=stale_reason(result.get("fingerprint"), expected))
        else:
            row.update({k: v for k, v in result.items() if k in report.SUMMARY_COLUMNS})
            row["usd_per_million_tokens"] = usd_per_million(plan.gpu_hour_price, result.get("tokens_per_s_per_gpu"))
        rows.append(row)
    return rows


def write_summary(app: AppConfig, plan: InferencePlan, results_dir: Path):
    """final_output.csv, the latency-throughput plot and report.md; returns the ranked frame."""
    inf = app.search_config.inference_settings
    frame = report.summary_frame(collect_rows(plan), inf.max_latency_ms)
    out = Path(results_dir) / report.SUMMARY_DIR
    report.write_summary_csv(frame, out / report.SUMMARY_CSV)
    try:
        report.plot_latency_vs_throughput(frame, inf.max_latency_ms, out / report.PLOT_FILE)
    except Exception as exc:  # noqa: BLE001 - a picture must not cost the user the results
        log.error("Plot %s failed (%s: %s); %s is complete", report.PLOT_FILE, type(exc).__name__, exc,
                  report.SUMMARY_CSV)
    write_inference_report(out, frame, inf.max_latency_ms, plan.serve_line(frame))
    log.info("inference summary written to %s", out)
    return frame


PREDICTED_COLUMNS = ("predicted_ttft_ms", "predicted_tpot_ms", "predicted_latency_ms", "predicted_tokens_per_s_per_gpu",
                     "predicted_usd_per_million_tokens")
PLAN_COLUMNS = ("config_id", "tp", "pp", "batch_size", "weights", "kv_cache", "num_gpus", "predicted_memory_gib",
                *PREDICTED_COLUMNS, "plan_status", "fingerprint", "reason")


def plan_columns(candidates: list[InferenceCandidate]) -> tuple[str, ...]:
    """plan.csv's columns: ``PLAN_COLUMNS``, and ``expert_parallel`` after PP where the grid has a layout with it (a
    mixture of experts; a dense model's plan.csv is as it was before the dimension)."""
    return report.with_expert_parallel(PLAN_COLUMNS, any(c.expert_parallel for c in candidates))


def candidate_row(c: InferenceCandidate, gpu_hour_price: Optional[float]) -> dict[str, Any]:
    """What the planner knows of a candidate, by column: its layout and formats, its predicted memory and the
    serving-time model's figures (``predicted_columns``); plan.csv's and the summary's rows start from it."""
    return {"config_id": c.config_id, "tp": c.tp, "pp": c.pp, "expert_parallel": c.expert_parallel,
            "batch_size": c.batch_size, "weights": c.weights, "kv_cache": c.kv_cache, "num_gpus": c.gpus,
            "predicted_memory_gib": c.memory_gib,
            **predicted_columns(c, gpu_hour_price)}


def usd_per_million(gpu_hour_price: Optional[float], tokens_per_s_per_gpu: Optional[float]) -> Optional[float]:
    """Dollars per million generated tokens of a GPU at ``gpu_hour_price`` generating ``tokens_per_s_per_gpu``."""
    if gpu_hour_price is None or not tokens_per_s_per_gpu:
        return None
    return round(gpu_hour_price / (3600 * tokens_per_s_per_gpu) * 1e6, 6)


def predicted_columns(c: InferenceCandidate, gpu_hour_price: Optional[float] = None) -> dict[str, Optional[float]]:
    """The serving-time model's TTFT, TPOT and batch latency (ms), output tokens/s per GPU and dollars per million
    of them of a candidate (None where the layout cannot be built, or the price is unknown)."""
    t = c.predicted
    if t is None:
        return dict.fromkeys(PREDICTED_COLUMNS)
    return {"predicted_ttft_ms": round(1e3 * t.ttft_s, 4), "predicted_tpot_ms": round(1e3 * t.tpot_s, 4),
            "predicted_latency_ms": round(1e3 * t.latency_s, 4),
            "predicted_tokens_per_s_per_gpu": round(t.tokens_per_s_per_gpu, 3),
            "predicted_usd_per_million_tokens": usd_per_million(gpu_hour_price, t.tokens_per_s_per_gpu)}


def plan_csv_text(plan: InferencePlan) -> str:
    """Every grid candidate with the planner's verdict; valid ones with the fingerprint of their config."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=plan_columns(plan.candidates), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for c in plan.candidates:
        cfg = plan.configs.get(c.config_id)
        row = {**candidate_row(c, plan.gpu_hour_price), "plan_status": c.status,
               "fingerprint": cfg.fingerprint() if cfg else "", "reason": c.reason or ""}
        if c.memory_gib is not None:
            row["predicted_memory_gib"] = round(c.memory_gib, 4)
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buf.getvalue()


def write_configs(plan: InferencePlan) -> None:
    """candidate_configs/<config_id>.yaml for every valid layout, and candidate_configs/plan.csv."""
    for cid, cfg in plan.configs.items():
        dump_job_config(cfg, plan.config_path(cid))
    atomic_write_text(plan.root / "candidate_configs" / "plan.csv", plan_csv_text(plan))


def _logger(app: AppConfig, plan: InferencePlan) -> Optional[Hook]:
    """After-job hook logging each ended config as a W&B run; None when W&B is off."""
    if not app.wandb.enable:
        return None
    return lambda job, result: tracking.log_run(job.name, f"{job.name.rsplit('_tp', 1)[0]}_inference",
                                                plan.configs[job.name].to_dict(), job.out, result, app.wandb,
                                                job_type="inference")


def _summary_to_wandb(app: AppConfig, frame, root: Path, search_name: str) -> None:
    """One W&B run holding the ranked frame; a failure is logged, the files stand."""
    try:
        tracking.log_summary(frame, app.wandb, root, f"{search_name.replace('/', '_')}_inference_summary")
    except Exception as exc:  # noqa: BLE001 - the files are the result; W&B is a copy of them
        log.error("Logging the inference summary to W&B failed (%s: %s); %s is complete",
                  type(exc).__name__, exc, report.SUMMARY_CSV)


def plan_summary(plan: InferencePlan) -> str:
    """The inference plan in a few lines: its layouts by verdict, and the fastest predicted that will run."""
    counts = Counter(c.status for c in plan.candidates)
    valid = sorted((c for c in plan.candidates if c.status == "valid"),
                   key=lambda c: -c.predicted.tokens_per_s_per_gpu)
    lines = [f"Inference plan: {len(plan.candidates)} layouts ({', '.join(f'{n} {k}' for k, n in counts.items())}); "
             f"{plan.root / 'candidate_configs' / 'plan.csv'}"]
    for c in valid[:3]:
        t = c.predicted
        lines.append(f"  {c.config_id}: predicted {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, TTFT "
                     f"{1e3 * t.ttft_s:.4g} ms, TPOT {1e3 * t.tpot_s:.4g} ms, {c.memory_gib:.1f} GiB per GPU")
    return "\n".join(lines)


def run_inference_search(app: AppConfig, search_name: str, results_dir: Path,
                         plan: Optional[InferencePlan] = None) -> int:
    """Plan (unless ``plan`` is given), launch (or resume, detach, cancel), collect and rank the inference search; 0
    when a config ran (or the command only detached or cancelled), INTERRUPTED after Ctrl-C, else 1. ConfigError
    (before anything is written) when nothing valid is left."""
    plan = plan or plan_inference(app, results_dir)
    inf = app.search_config.inference_settings
    exe = SERVING_ENGINES[inf.engine].executable
    if exe and app.cluster.type in ("local", "in_process") and shutil.which(exe) is None:
        raise ConfigError(f"{IS}.engine", inf.engine, f"the configs run on this machine (cluster={app.cluster.type}), "
                          f"which has no `{exe}` on PATH", f"install {inf.engine} here (vLLM needs a GPU), run on a "
                          "cluster whose nodes have it, or use inference_settings.engine=hp_tool")
    jobs = [inference_job_spec(cfg, plan.config_path(cid)) for cid, cfg in plan.configs.items()]
    backend = prepare_backend(app, jobs)  # before any file: a config the cluster's backend can never run
    write_configs(plan)
    session = LaunchSession(app.cluster, backend, Path(results_dir), plan.root, app.detach, app.cancel,
                            what="inference configs", on_end=_logger(app, plan))
    code = session.launch(jobs)
    if code is not None:
        return code
    frame = write_summary(app, plan, results_dir)
    if app.wandb.enable:
        _summary_to_wandb(app, frame, plan.root, search_name)
    print(f"Inference search {search_name}: best layouts (latency bound {inf.max_latency_ms:g} ms)")
    print(report.render_top(frame, inf.top_n), flush=True)
    serve = plan.serve_line(frame)
    if serve:
        print(f"Serve the pick with vLLM: {serve}", flush=True)
    return 0 if (frame["status"] == "ok").any() else 1
