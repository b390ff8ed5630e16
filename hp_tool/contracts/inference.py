"""The inference job's contract: what one inference job runs (``InferenceJobConfig``, its YAML in
``inference/candidate_configs/<config_id>.yaml``) and what it writes (``result.json``: ``RESULT_FIELDS``, its latency
statistics). The planner writes the config, the worker (hp_tool/trial/inference_worker.py) reads it and fills the
result, the search reads the result back. No torch here. Times in result.json are in milliseconds, throughput in
samples or tokens per second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hp_tool.contracts.result import blank_result
from hp_tool.contracts.spec import ModelSpec
from hp_tool.fingerprint import fingerprint_of
from hp_tool.fsutil import atomic_write_json, atomic_write_text
from hp_tool.vocab import RESULT_FILE

RESULT_FIELDS = (
    "config_id", "fingerprint", "status", "reason", "tp", "pp", "batch_size", "latency_ms_p50", "latency_ms_p95",
    "latency_ms_p99", "time_to_first_token_ms", "samples_per_s", "tokens_per_s", "tokens_per_s_per_gpu",
    "world_size", "device", "generated_tokens", "versions", "start_time", "end_time",
)


@dataclass
class InferenceJobConfig:
    """What one inference job runs (``inference/candidate_configs/<config_id>.yaml``)."""

    config_id: str
    model: ModelSpec
    tp: int
    pp: int
    batch_size: int
    input_seq_len: int
    output_seq_len: int
    start_id: int
    end_id: int
    output_dir: str
    warmup: int = 1  # untimed generations before the timed ones
    repeats: int = 5  # timed generations (latency percentiles are over these)
    seed: int = 1234  # weights and prompt
    precision: str = "bf16"  # bf16 | fp16 | fp32 on GPU; the CPU always runs fp32
    max_minutes: float = 10.0  # the job's time limit
    engine: str = "hp_tool"  # what serves it (INFERENCE_ENGINES): hp_tool's own decode loop, or vLLM's benchmark
    model_path: Optional[str] = None  # vLLM: the checkpoint it loads (a hub id or a local directory)
    weights: Optional[str] = None  # the weights' format when not the precision's (vLLM: fp8, int8, int4, fp4)
    kv_cache: Optional[str] = None  # the KV cache's when not the precision's (vLLM: fp8)
    expert_parallel: bool = False  # a mixture of experts' experts whole on the TP ranks (vLLM: --enable-expert-parallel)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that changes what this config measures (not its id or output folder; the fields added
        since configs were first written only where they differ from what those ran)."""
        return fingerprint_of({k: v for k, v in self.to_dict().items() if k not in ("config_id", "output_dir")
                               and (k not in ADDED_DEFAULTS or v != ADDED_DEFAULTS[k])})


@dataclass(frozen=True)
class ServingEngine:
    """What an inference search's engine serves (inference_settings.engine)."""

    name: str
    executable: Optional[str]  # the command its jobs run (looked for on PATH before a search on this machine)
    loads_checkpoint: bool  # serves the model's Hugging Face checkpoint (inference_settings.model_path)
    any_family: bool  # serves whatever it loads; else the families whose record says ``inference``
    formats: bool  # serves weights and KV cache formats other than the served precision's
    expert_parallel: bool  # runs a mixture of experts' experts whole on the TP ranks (expert parallelism)


SERVING_ENGINES = {
    "hp_tool": ServingEngine("hp_tool", None, loads_checkpoint=False, any_family=False, formats=False,
                             expert_parallel=False),
    "vllm": ServingEngine("vllm", "vllm", loads_checkpoint=True, any_family=True, formats=True, expert_parallel=True),
}
INFERENCE_ENGINES = tuple(SERVING_ENGINES)
# a config without them keeps its fingerprint
ADDED_DEFAULTS = {"engine": "hp_tool", "model_path": None, "weights": None, "kv_cache": None, "expert_parallel": False}


def dump_job_config(cfg: InferenceJobConfig, path: str | Path) -> Path:
    import yaml

    return atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load_job_config(path: str | Path) -> InferenceJobConfig:
    """Read a per-config YAML; unknown keys fail (TypeError names them)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    data["model"] = ModelSpec(**data["model"])
    return InferenceJobConfig(**data)


def empty_result(cfg: Any) -> dict:
    """Every contract field, unmeasured (null), for an InferenceJobConfig."""
    return blank_result(RESULT_FIELDS, config_id=cfg.config_id, fingerprint=cfg.fingerprint(), tp=cfg.tp,
                        pp=cfg.pp, batch_size=cfg.batch_size)


def write_result(out_dir: Path, result: dict) -> Path:
    """``result.json`` atomically, fields in contract order."""
    return atomic_write_json(Path(out_dir) / RESULT_FILE, {k: result.get(k) for k in RESULT_FIELDS})


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latency_stats(latencies_s: Sequence[float], ttfts_s: Sequence[float], batch: int, new_tokens: int,
                  gpus: int) -> dict:
    """Percentiles of the batch latency (ms), median time to first token (ms; None where the first token was not
    timed apart), and throughput from the median latency: samples/s, generated tokens/s, and tokens/s per GPU."""
    p50 = percentile(latencies_s, 50)
    tokens_per_s = batch * new_tokens / p50
    return {"latency_ms_p50": 1e3 * p50, "latency_ms_p95": 1e3 * percentile(latencies_s, 95),
            "latency_ms_p99": 1e3 * percentile(latencies_s, 99),
            "time_to_first_token_ms": 1e3 * percentile(ttfts_s, 50) if ttfts_s else None,
            "samples_per_s": batch / p50, "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / gpus}
