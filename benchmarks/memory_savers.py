"""Step time of each engine x ZeRO stage x offload on CPU, relative to the torch engine's stage 0 (DDP).

    python benchmarks/memory_savers.py [--steps 12] [--rounds 1]

Each combination the engines run (hp_tool.sharding) trains the same Llama-shaped model (8 layers, hidden
256, 8 heads, 4 kv heads, vocab 4096, seq 256, global batch 16, micro-batch 4) as a real trial on 2 CPU
processes (gloo, data parallel 2) with torchrun; prints the median of the timed steps (best of the rounds)
and the ratio to torch ZeRO-0, one line per combination.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from hp_tool.sharding import combination_problem, layout_suffix
from hp_tool.vocab import ENGINES, OFFLOADS, ZERO_STAGES
from hp_tool.contracts.spec import (ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec, TrialSpec,
                                dump_spec)


def spec_for(engine: str, stage: int, offload: str, steps: int) -> TrialSpec:
    return TrialSpec(
        trial_id=f"bench_{layout_suffix(engine, stage, offload)}",
        model=ModelSpec(family="llama", num_layers=8, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                        ffn_hidden_size=688, vocab_size=4096, seq_length=256),
        parallel=ParallelSpec(dp=2, mbs=4, engine=engine, zero_stage=stage, offload=offload),
        training=TrainingSpec(global_batch_size=16, precision="fp32", lr=1e-4, min_lr=1e-5, max_steps=1000),
        resources=ResourcesSpec(num_nodes=1, gpus_per_node=2),
        run=RunSpec(max_steps=steps, warmup_steps=3, stable_cv=0.0, max_minutes=10),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(spec: TrialSpec, folder: Path) -> float:
    path = dump_spec(spec, folder / f"{spec.trial_id}.yaml")
    out = folder / spec.trial_id
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(free_port()), "-m", "hp_tool.trial.train", str(path), "--output-dir",
                    str(out)], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads((out / "result.json").read_text())
    return result["step_time_s_median"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    combos = [(e, z, o) for e in ENGINES for z in ZERO_STAGES for o in OFFLOADS
              if combination_problem(e, z, o, 1, 1) is None]
    with tempfile.TemporaryDirectory() as tmp:
        times = {}
        for combo in combos:
            times[combo] = min(run(spec_for(*combo, args.steps), Path(tmp) / f"r{i}") for i in range(args.rounds))
        base = times[("torch", 0, "none")]
        for (engine, stage, offload), t in times.items():
            print(f"{engine:9s} ZeRO-{stage} offload={offload:21s} median step {t * 1000:8.1f} ms  "
                  f"x{t / base:.2f} of torch ZeRO-0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
