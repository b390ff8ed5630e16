"""Per-rank peak memory three ways: traced under fake tensors, analytic, and measured in a real run.

    python benchmarks/memory_trace.py [--layouts all|quick|none] [--workers N]

For a Llama-shaped and a GPT-3-shaped model (4 layers, hidden 128, seq 128, vocab 2048, global batch 8,
micro-batch 2, fp32) and each layout (single process, FSDP2 DP2 with and without checkpointing, TP2,
TP2 x DP2, PP2 with and without checkpointing), prints the measured peak tensor GiB per rank of a real
trial on CPU processes (gloo; the trial's ``peak_tensor_memory_gib``), the traced peak
(``hp_tool.trial.trace.extrapolate.traced_peak_bytes``: the busiest rank, one process, fake process group) and the
analytic estimate's tensor part (``hp_tool.estimate.memory.estimate_memory`` less its overhead), each with
its ratio to the measured figure; then the traced memory check of the gpt3/175b plan (1024 GPUs): time
per candidate and in all, and the analytic and traced figure of each candidate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hp_tool.estimate.layout import GIB, Hardware
from hp_tool.estimate.memory import estimate_memory
from hp_tool.trial.trace.extrapolate import traced_peak_bytes
from hp_tool.contracts.spec import (ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec, TrialSpec,
                                dump_spec)

LAYOUTS = [{}, {"dp": 2}, {"dp": 2, "act_ckpt": 4}, {"tp": 2}, {"tp": 2, "dp": 2}, {"pp": 2},
           {"pp": 2, "act_ckpt": 1}]
CPU = Hardware(gpus_per_node=2, gpu_memory_gib=4, peak_tflops=1, intra_node_bandwidth_gbps=5,
               inter_node_bandwidth_gbps=5, memory_overhead_gib=0.0, flash_attention=True)


def spec_for(family: str, layout: dict) -> TrialSpec:
    tp, pp, dp = layout.get("tp", 1), layout.get("pp", 1), layout.get("dp", 1)
    model = ModelSpec(family=family, num_layers=4, hidden_size=128, num_attention_heads=4,
                      num_kv_heads=2 if family == "llama" else 4, ffn_hidden_size=352 if family == "llama" else 512,
                      vocab_size=2048, seq_length=128)
    return TrialSpec(
        trial_id=f"bench_{family}_tp{tp}_pp{pp}_dp{dp}_ac{layout.get('act_ckpt', 0)}", model=model,
        parallel=ParallelSpec(tp=tp, pp=pp, dp=dp, mbs=2, act_ckpt_layers=layout.get("act_ckpt", 0), zero_stage=3),
        training=TrainingSpec(global_batch_size=8, precision="fp32", max_steps=100),
        resources=ResourcesSpec(num_nodes=1, gpus_per_node=tp * pp * dp),
        run=RunSpec(max_steps=3, warmup_steps=2, stable_cv=0.0, max_minutes=10),
    )


def measure(spec: TrialSpec) -> float:
    with tempfile.TemporaryDirectory() as folder:
        path = dump_spec(spec, Path(folder) / "spec.yaml")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        world = spec.resources.gpus_per_node
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                        f"--master-port={port}", "-m", "hp_tool.trial.train", str(path), "--output-dir",
                        str(Path(folder) / "out")], env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, check=True, timeout=600)
        return json.loads((Path(folder) / "out" / "result.json").read_text())["peak_tensor_memory_gib"]


def analytic(spec: TrialSpec) -> float:
    return estimate_memory(spec.model.shape(), spec.layout(), CPU).total_gib  # the spec trains in fp32, as on CPU


def trace_175b_grid(workers: int) -> None:
    """Plan gpt3/175b (128 nodes x 8 GPUs) with memory_check=traced, as a launch would: every candidate the
    planner would launch is traced; prints the time per candidate (one core each; a worker process traces candidates in turn)
    and for the whole check."""
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.memory_check import Tracer, trace_device
    from hp_tool.planner import make_plan

    cfg, name = compose(["search_config=gpt3/175b"])
    app = to_app_config(cfg)
    tracer = Tracer(trace_device(app.gpu.name), workers=workers)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        plan = make_plan(app, name, Path(folder), tracer)
    wall = time.monotonic() - start
    traced = [c for c in plan.candidates if c.memory_check == "traced"]
    pruned = [c for c in traced if c.status == "pruned"]
    seconds = sorted(tracer.seconds)
    print(f"GPT-3 175B on {plan.cluster.gpus} GPUs: {tracer.traced} candidates traced ({len(pruned)} pruned by the "
          f"trace) in {wall:.0f} s on {tracer.workers} processes; per candidate on one core: median "
          f"{seconds[len(seconds) // 2]:.1f} s, max {seconds[-1]:.1f} s")
    for c in traced:
        print(f"  tp{c.tp} pp{c.pp} mbs{c.mbs} ac{c.act_ckpt_layers} z{c.zero_stage}: analytic "
              f"{c.memory_gib:6.1f} GiB, traced {c.traced_memory_gib:6.1f} GiB, {c.status}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", choices=("all", "quick", "none"), default="all")
    parser.add_argument("--workers", type=int, default=None, help="trace processes for the 175B grid (default: all cores)")
    args = parser.parse_args()
    layouts = {"all": LAYOUTS, "quick": LAYOUTS[:3], "none": []}[args.layouts]
    print(f"{'model':6} {'layout':18} {'measured GiB':>12} {'traced GiB':>10} {'ratio':>6} {'analytic GiB':>12} {'ratio':>6}")
    for family in ("gpt3", "llama"):
        for layout in layouts:
            spec = spec_for(family, layout)
            measured = measure(spec)
            traced = traced_peak_bytes(spec) / GIB
            estimate = analytic(spec)
            name = "-".join(f"{k}{v}" for k, v in layout.items()) or "single"
            print(f"{family:6} {name:18} {measured:12.5f} {traced:10.5f} {traced / measured:6.3f} {estimate:12.5f} "
                  f"{estimate / measured:6.3f}", flush=True)
    trace_175b_grid(args.workers)


if __name__ == "__main__":
    main()
