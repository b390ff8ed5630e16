"""vLLM as an inference job's engine: the command a job runs (``vllm bench latency``, with the layout's flags and
``--output-json``), how its JSON becomes the job's result.json fields (hp_tool/contracts/inference.py
``RESULT_FIELDS``), and the ``vllm serve`` line that serves a chosen layout. Pure: no vLLM, no torch.

vLLM's latency benchmark (vllm/benchmarks/latency.py) generates ``--output-len`` tokens for a batch of
``--batch-size`` prompts of ``--input-len`` random tokens, ``--num-iters`` times after ``--num-iters-warmup``, and
writes ``{"avg_latency": s, "std_latency": s, "latencies": [s, ...], "percentiles": {"10": s, "25": s, "50": s,
"75": s, "90": s, "99": s}}``: the batch's end-to-end latency, as hp_tool's own decode loop measures it. It does
not time the first token apart, so ``time_to_first_token_ms`` stays null for a vLLM job.
"""

from __future__ import annotations

import shlex
from typing import Any, Optional

from hp_tool.contracts.inference import latency_stats
from hp_tool.contracts.result import oom_text

# a served precision -> vLLM's --dtype
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# what vLLM prints beyond an out-of-memory error's text: torch's exception by name, no room for one batch's KV cache
VLLM_OOM_WORDS = ("OutOfMemoryError", "No available memory for the cache blocks", "not enough KV cache")


# weight formats vLLM quantises to as it loads a 16-bit checkpoint (--quantization); the others it reads from a
# checkpoint quantised so (its config names the method)
ONLINE_QUANTIZATION = {"fp8": "fp8"}


def layout_flags(tp: int, pp: int, precision: str, weights: Optional[str] = None,
                 kv_cache: Optional[str] = None, expert_parallel: bool = False) -> list[str]:
    """The engine flags of a layout, the same for the benchmark and the server: TP, PP, a mixture of experts' experts
    whole on the TP ranks (``--enable-expert-parallel``: EP = TP x DP, here TP), the compute precision, the weights
    quantised as vLLM loads them (fp8) and the KV cache's format (fp8)."""
    flags = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    if expert_parallel:
        flags.append("--enable-expert-parallel")
    flags += ["--dtype", DTYPES[precision]]
    if weights in ONLINE_QUANTIZATION:
        flags += ["--quantization", ONLINE_QUANTIZATION[weights]]
    if kv_cache == "fp8":
        flags += ["--kv-cache-dtype", "fp8"]
    return flags


def bench_command(model: str, tp: int, pp: int, batch_size: int, input_len: int, output_len: int,
                  warmup: int, repeats: int, precision: str, output_json: str, weights: Optional[str] = None,
                  kv_cache: Optional[str] = None, expert_parallel: bool = False) -> list[str]:
    """``vllm bench latency`` of one layout: the batch's latency over ``repeats`` generations after ``warmup``,
    written to ``output_json``."""
    return ["vllm", "bench", "latency", "--model", model,
            *layout_flags(tp, pp, precision, weights, kv_cache, expert_parallel),
            "--batch-size", str(batch_size), "--input-len", str(input_len), "--output-len", str(output_len),
            "--num-iters-warmup", str(warmup), "--num-iters", str(repeats), "--max-model-len",
            str(input_len + output_len), "--output-json", output_json]


def latency_result(data: dict[str, Any], batch_size: int, output_len: int, gpus: int) -> dict[str, Any]:
    """result.json's fields from ``vllm bench latency``'s JSON: its latencies' statistics as hp_tool's own decode
    loop reports them (``latency_stats``: the percentiles numpy's way, as vLLM prints them, and p95, which it does
    not), without a time to first token."""
    return {**latency_stats([float(x) for x in data["latencies"]], (), batch_size, output_len, gpus),
            "generated_tokens": batch_size * output_len}


def failure_status(output: str) -> str:
    """A failed vLLM run's status from what it printed: ``oom`` where it ran out of memory (``oom_text``, or
    ``VLLM_OOM_WORDS``: for the weights, or for the KV cache of one batch), else ``failed``."""
    return "oom" if oom_text(output) or any(word in output for word in VLLM_OOM_WORDS) else "failed"


def serve_command(model: str, tp: int, pp: int, max_num_seqs: int, precision: str, max_model_len: int,
                  weights: Optional[str] = None, kv_cache: Optional[str] = None, expert_parallel: bool = False) -> str:
    """The ``vllm serve`` line that serves a layout: its TP and PP, expert parallelism, formats, at most
    ``max_num_seqs`` requests in flight (the concurrency it was chosen at), the requests' length."""
    argv = ["vllm", "serve", model, *layout_flags(tp, pp, precision, weights, kv_cache, expert_parallel),
            "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
    return shlex.join(argv)
