"""An inference job served by vLLM: rank 0 runs ``vllm bench latency`` with the layout's flags over the job's GPUs
(vLLM starts its own TP x PP workers) and turns its JSON into result.json (hp_tool/contracts/vllm.py); the job's other
tasks only hold their GPUs' places and return. A failure leaves status ``oom`` or ``failed`` with the tail of what
vLLM printed; a run past the job's time limit, ``failed`` naming it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from hp_tool.contracts import result as res
from hp_tool.contracts.inference import InferenceJobConfig, empty_result, write_result
from hp_tool.contracts.vllm import bench_command, failure_status, latency_result

TAIL_CHARS = 2000  # of vLLM's output kept in a failed result's reason


def run_vllm(cfg: InferenceJobConfig, rank: int = 0) -> dict:
    """Run the job's vLLM benchmark (rank 0) and write result.json; returns its content."""
    out = Path(cfg.output_dir)
    result = empty_result(cfg)
    if rank != 0:
        return result
    out.mkdir(parents=True, exist_ok=True)
    result.update(world_size=cfg.tp * cfg.pp, device="cuda", versions=res.versions(),
                  start_time=res.iso_utc(time.time()))
    if shutil.which("vllm") is None:
        result.update(status="failed", reason="vllm is not installed where this job ran (no `vllm` on PATH): "
                      "install vLLM on the nodes, or use inference_settings.engine=hp_tool")
        write_result(out, result)
        return result
    json_path = out / "vllm_latency.json"
    argv = bench_command(cfg.model_path, cfg.tp, cfg.pp, cfg.batch_size, cfg.input_seq_len, cfg.output_seq_len,
                         cfg.warmup, cfg.repeats, cfg.precision, str(json_path), cfg.weights, cfg.kv_cache,
                         cfg.expert_parallel)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60 * cfg.max_minutes)
        output = proc.stdout + proc.stderr
        (out / "vllm.log").write_text(output)
        if proc.returncode != 0 or not json_path.is_file():
            result.update(status=failure_status(output),
                          reason=f"{' '.join(argv[:3])} exited {proc.returncode}: {output[-TAIL_CHARS:].strip()}")
        else:
            result.update(latency_result(json.loads(json_path.read_text()), cfg.batch_size, cfg.output_seq_len,
                                         cfg.tp * cfg.pp), status="ok")
    except subprocess.TimeoutExpired:
        result.update(status="failed", reason=f"vllm bench latency ran past the job's {cfg.max_minutes:g} minutes")
    result.update(end_time=res.iso_utc(time.time()))
    write_result(out, result)
    return result
