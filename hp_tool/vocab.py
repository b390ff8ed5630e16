"""The vocabulary every layer shares: each enumeration, status and file name hp_tool writes or reads,
defined once. Pure constants; everything else imports them from here."""

from __future__ import annotations

# ---- training and layout choices (config keys, the trial spec, trial ids) ----
PRECISIONS = ("bf16", "fp16", "fp32")
SCHEDULES = ("1F1B", "GPipe")
LOSSES = ("full", "chunked")  # the language-model loss: whole logits, or over chunks of tokens (hp_tool/trial/loss.py)
# how a checkpointed layer is recomputed: whole (only its input kept), or under torchtitan's per-op policy, which
# keeps the outputs of every second matmul and of the attention kernel (hp_tool/trial/selective_checkpoint.py)
ACT_CKPT_MODES = ("full", "selective")
RUN_MODES = ("benchmark", "full")
DATA_SOURCES = ("synthetic", "file")
ENGINES = ("torch", "deepspeed")
ZERO_STAGES = (0, 1, 2, 3)
# adamw; sgd (momentum 0); sgd_momentum (0.9); adamw_8bit (bitsandbytes' 8-bit states, CUDA only)
OPTIMIZERS = ("adamw", "sgd", "sgd_momentum", "adamw_8bit")
# full: every weight trains; lora: frozen base, trainable low-rank adapters (peft); qlora: the same over a 4-bit base
METHODS = ("full", "lora", "qlora")
# what holds the trained weights: fp32 master weights (mixed precision: fp32 parameters, gradients and optimizer
# states, 16-bit compute), or bf16 (weights, gradients and optimizer moments all bf16, no fp32 master: torchtune's
# dtype=bf16, Lightning's bf16-true)
MASTER_WEIGHTS = ("fp32", "bf16")
OPTIMIZER_CODES = {"adamw": "", "sgd": "_sgd", "sgd_momentum": "_sgdm", "adamw_8bit": "_adam8"}  # in a trial id
OFFLOADS = ("none", "optimizer", "optimizer_and_params")
ENGINE_CODES = {"torch": "torch", "deepspeed": "ds"}  # how a trial id spells an engine
OFFLOAD_CODES = {"none": "noff", "optimizer": "offopt", "optimizer_and_params": "offall"}

# ---- the search ----
FINETUNE = "finetune"  # search_config.model_family of a fine-tuning search: the model comes from model.hf_config
STRATEGIES = ("adaptive", "exhaustive")  # adaptive: most promising first, hopeless skipped; exhaustive: all
MEMORY_CHECKS = ("traced", "analytic")  # how the plan prunes on memory
CLUSTER_TYPES = ("local", "bcm", "auto", "in_process", "ray")

# ---- trial outcomes ----
SKIPPED, PRUNED_AFTER_OOM = "skipped", "pruned_after_oom"  # the adaptive search's verdicts (hp_tool/adaptive.py)
NOT_LAUNCHED = (SKIPPED, PRUNED_AFTER_OOM)  # a result of these ran nothing: a verdict, replayed on resume under the same gate inputs
# unschedulable and the verdicts are set by the launcher
STATUSES = ("ok", "oom", "timeout", "failed", "cancelled", "unschedulable", SKIPPED, PRUNED_AFTER_OOM)
LOSING = "losing"  # stopped early by the adaptive search: slower than the best measured trial by a clear margin
STOP_REASONS = ("max_steps", "time_budget", "stable", "signal", LOSING)
REQUESTED_STOPS = (LOSING,)  # stop reasons a stop request may carry
SELECTED, PRUNED, INVALID, OVER_LIMIT = "selected", "pruned", "invalid", "over_limit"
PLAN_STATUSES = (SELECTED, PRUNED, INVALID, OVER_LIMIT)  # plan.csv's plan_status
NOT_RUN = "not_run"  # a selected trial or inference config with no output yet

# ---- file names ----
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
# training_logs/<trial_id>/confirm/ and candidate_configs/confirm/<trial_id>.yaml: the confirmation round's
# second timing of a top trial (hp_tool/search.py confirmation_jobs)
CONFIRM_DIR = "confirm"
FAILURE_DIR = "rank_failures"  # per-rank failure notes, read by rank 0 to name the root cause
STOP_REQUEST_FILE = "stop_request.json"  # the search asks a running trial to stop after its current step
LEDGER_FILE = "jobs.jsonl"
SEARCH_ID_FILE = "search_id"
LOCK_FILE = ".hp_tool.lock"
TRACE_CACHE_FILE = "memory_traces.json"  # in candidate_configs/
COMPARISON_FILE = "comparison.csv"
# the inference search's table and plot in its final_results/ (hp_tool/inference/report.py)
INFERENCE_CSV, INFERENCE_PLOT = "final_output.csv", "latency_vs_throughput.png"


def trial_device(gpu_name: str) -> str:
    """What the trials run on: the ``cpu`` gpu preset's processes compute in fp32 on CPU (the host is their
    device); every other preset is a GPU."""
    return "cpu" if gpu_name == "cpu" else "cuda"
