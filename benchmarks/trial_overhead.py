"""Step time of the trial engine against a plain PyTorch training loop of the same model and batch (CPU).

    python benchmarks/trial_overhead.py [--steps 12] [--rounds 2]

Both run one process, fp32, the same transformers GPT model (OPT class), global batch, micro-batch
(gradient accumulation), AdamW and gradient clipping. The plain loop is the textbook one; the engine adds
its stage wrapper, mesh-aware clipping, the data pipeline, synchronisation and per-step metrics. Prints
the median step time of each (best of the rounds, which rejects interference from other
load on the machine) and their ratio; the target is <= 1.05.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hp_tool.trial.models import hf_config
from hp_tool.contracts.spec import (ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec,
                                TrialSpec, dump_spec)
from hp_tool.trial.train import run_trial


def bench_spec(steps: int) -> TrialSpec:
    model = ModelSpec(family="gpt3", num_layers=4, hidden_size=256, num_attention_heads=8,
                      num_kv_heads=8, ffn_hidden_size=1024, vocab_size=8192, seq_length=256)
    return TrialSpec(trial_id="gpt3_bench_tp1_pp1_mbs2_ac0", model=model,
                     parallel=ParallelSpec(mbs=2), training=TrainingSpec(global_batch_size=8),
                     resources=ResourcesSpec(), run=RunSpec(max_steps=steps, warmup_steps=2,
                                                            stable_cv=0.0, max_minutes=30))


def plain_loop(spec: TrialSpec) -> float:
    """Median step time (s) of a textbook loop: HF model, accumulation, clipping, AdamW."""
    from transformers import OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(hf_config(spec.model))
    t = spec.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas),
                                  weight_decay=t.weight_decay, foreach=True)
    accum = spec.grad_accum_steps
    data = torch.randint(0, spec.model.vocab_size, (t.global_batch_size, spec.model.seq_length + 1))
    times = []
    for _ in range(spec.run.max_steps):
        begin = time.perf_counter()
        for micro in data.split(spec.parallel.mbs):
            logits = model(micro[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten())
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[spec.run.warmup_steps:])


def engine_loop(spec: TrialSpec) -> float:
    """Median timed step (s) of the trial engine on the same spec."""
    with tempfile.TemporaryDirectory() as folder:
        path = dump_spec(spec, Path(folder) / "spec.yaml")
        result = run_trial(path, str(Path(folder) / "out"))
    assert result["status"] == "ok", result["reason"]
    return result["step_time_s_median"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = bench_spec(args.steps)
    plain, engine = [], []
    for _ in range(args.rounds):  # interleaved, so drifting machine load hits both alike
        plain.append(plain_loop(spec))
        engine.append(engine_loop(spec))
    p, e = min(plain), min(engine)
    print(f"threads={torch.get_num_threads()} plain loop {p * 1e3:.1f} ms/step, "
          f"engine {e * 1e3:.1f} ms/step, ratio engine/plain = {e / p:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
