"""Step time of the trial engine against a plain PyTorch training loop of the same model and batch (CPU).

    python benchmarks/trial_overhead.py [--cases gpt,llama_full,llama_lora,llama_qlora] [--steps N]
                                        [--rounds 2] [--no-tensor-peak]

Both loops run in this one process, fp32, from the same transformers config (``hp_tool.trial.models.hf_config``,
dropout off), with the same global batch, micro-batch (gradient accumulation), AdamW and gradient clipping.
The plain loop is the textbook one: the transformers model class, for LoRA peft's ``get_peft_model`` with the
``LoraConfig`` the engine builds (``hp_tool.trial.converters.convert_stage``; its adapter dropout stays on in
both), for QLoRA first the target ``nn.Linear`` layers swapped for bitsandbytes' NF4 ``Linear4bit`` with
double quantisation, quantised from fp16 as ``hp_tool.trial.methods.quantise_base`` does (transformers'
``BitsAndBytesConfig`` loading does the same swap); AdamW over the trainable parameters. The engine adds its
stage wrapper, mesh-aware clipping, the data pipeline, synchronisation, per-step metrics and, over its first
min(2, warmup) untimed steps, the ``TensorPeak`` memory tracker (``--no-tensor-peak`` turns it off, to check
that the timed steps do not feel it).

Cases: ``gpt``, a small GPT-3 (transformers' OPT class; target <= 1.05), and a Llama-shaped model at a realistic
width (hidden 1024, 2 layers, grouped-query attention, SwiGLU 2816, vocabulary 32000; target <= 1.10) trained
``llama_full``, ``llama_lora`` or ``llama_qlora`` (LoRA rank 16 on every linear of a layer). Prints, per case,
the median step time of each loop (best of the rounds, which rejects interference from other load on the
machine), their ratio and whether it is within the case's target. A QLoRA case whose 4-bit layer cannot run
on this machine is skipped with the reason printed.

On a machine other work shares, run it with ``OMP_WAIT_POLICY=PASSIVE``: OpenMP's threads otherwise spin at
every barrier, and a step of 2 threads that must share their cores with other processes slows three- to
tenfold, unevenly, which buries a 10% difference (both loops run under the same setting either way).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hp_tool.contracts.spec import (LoraSpec, ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec,
                                    TrialSpec, dump_spec)
from hp_tool.trial.engines.torch_engine import TorchEngine
from hp_tool.trial.models import hf_config
from hp_tool.trial.train import run_trial

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Case:
    """One comparison: the trial's model and batch, the steps each loop runs, and the ratio it must stay under."""

    name: str
    model: ModelSpec
    mbs: int
    global_batch_size: int
    steps: int  # optimizer steps per loop and round (the first WARMUP_STEPS are not timed)
    target: float  # engine / plain step time at most


WARMUP_STEPS = 2


def llama_model(method: str) -> ModelSpec:
    """A Llama-shaped model at a realistic width, kept to 2 layers so a step takes seconds on 2 cores."""
    lora = LoraSpec(rank=16, alpha=32.0, dropout=0.05, target_modules=list(LLAMA_TARGETS)) if method != "full" else None
    return ModelSpec(family="llama", num_layers=2, hidden_size=1024, num_attention_heads=16, num_kv_heads=8,
                     ffn_hidden_size=2816, vocab_size=32000, seq_length=256, method=method, lora=lora)


CASES = {case.name: case for case in (
    Case("gpt", ModelSpec(family="gpt3", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=8,
                          ffn_hidden_size=1024, vocab_size=8192, seq_length=256),
         mbs=2, global_batch_size=8, steps=12, target=1.05),
    Case("llama_full", llama_model("full"), mbs=1, global_batch_size=2, steps=8, target=1.10),
    Case("llama_lora", llama_model("lora"), mbs=1, global_batch_size=2, steps=8, target=1.10),
    Case("llama_qlora", llama_model("qlora"), mbs=1, global_batch_size=2, steps=8, target=1.10),
)}


def bench_spec(case: Case, steps: int) -> TrialSpec:
    """The trial the engine runs: one process, fp32 on CPU, no early stop, warm-up steps untimed."""
    return TrialSpec(trial_id=f"{case.name}_bench_tp1_pp1_mbs{case.mbs}_ac0", model=case.model,
                     # ZeRO 0: one process has nothing to shard, and QLoRA refuses ZeRO 2-3
                     parallel=ParallelSpec(mbs=case.mbs, zero_stage=0),
                     training=TrainingSpec(global_batch_size=case.global_batch_size, precision="fp32"),
                     resources=ResourcesSpec(), run=RunSpec(max_steps=steps, warmup_steps=WARMUP_STEPS,
                                                            stable_cv=0.0, max_minutes=60))


def four_bit(model: nn.Module, targets: set[str]) -> nn.Module:
    """Swap every target ``nn.Linear`` of ``model`` for an NF4 ``Linear4bit`` (double quantisation, computing in
    its input's dtype) holding the linear's weight, quantised from fp16 on the CPU."""
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and type(child) is nn.Linear:
                four = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                         quant_type="nf4", compress_statistics=True)
                four.weight = bnb.nn.Params4bit(child.weight.detach().to(torch.float16).clone(), requires_grad=False,
                                                quant_type="nf4", compress_statistics=True).to("cpu")
                setattr(module, name, four)
    return model


def plain_model(spec: TrialSpec) -> nn.Module:
    """The textbook model of ``spec``: the family's transformers class on the engine's config, with peft's
    adapters (on NF4 layers for QLoRA)."""
    from transformers import LlamaForCausalLM, OPTForCausalLM

    m = spec.model
    model_class = {"gpt3": OPTForCausalLM, "llama": LlamaForCausalLM}[m.family]
    model = model_class(hf_config(m))
    if m.method == "full":
        return model
    from peft import LoraConfig, get_peft_model

    if m.method == "qlora":
        four_bit(model, set(m.lora.target_modules))
    return get_peft_model(model, LoraConfig(r=m.lora.rank, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
                                            target_modules=list(m.lora.target_modules), bias="none"))


def plain_loop(spec: TrialSpec) -> float:
    """Median step time (s) of a textbook loop: HF model, accumulation, clipping, AdamW."""
    torch.manual_seed(0)
    model = plain_model(spec).train()
    params = [p for p in model.parameters() if p.requires_grad]
    t = spec.training
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, foreach=True)
    accum = spec.grad_accum_steps
    data = torch.randint(0, spec.model.vocab_size, (t.global_batch_size, spec.model.seq_length + 1))
    times = []
    for _ in range(spec.run.max_steps):
        begin = time.perf_counter()
        for micro in data.split(spec.parallel.mbs):
            logits = model(micro[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten())
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
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


def qlora_problem() -> Optional[str]:
    """Why bitsandbytes' NF4 layer cannot train here (forward and backward of one layer on the CPU), or None."""
    try:
        layer = four_bit(nn.Sequential(nn.Linear(64, 64)), {"0"})
        x = torch.randn(2, 64, requires_grad=True)
        layer(x).sum().backward()
    except Exception as exc:  # any failure means the case cannot run: say which
        return f"{type(exc).__name__}: {exc}"
    return None


def run_case(case: Case, steps: int, rounds: int) -> tuple[float, float]:
    """(plain, engine) best-of-rounds median step times of ``case``; the loops alternate, so drifting machine
    load hits both alike."""
    spec = bench_spec(case, steps)
    plain, engine = [], []
    for _ in range(rounds):
        plain.append(plain_loop(spec))
        engine.append(engine_loop(spec))
    return min(plain), min(engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from {', '.join(CASES)} (default: all)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps per loop and round, the first {WARMUP_STEPS} untimed "
                             "(default: the case's, 12 for gpt, 8 for the llama cases)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-tensor-peak", action="store_true",
                        help="turn off the engine's TensorPeak tracker over its first untimed steps")
    args = parser.parse_args()
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {list(CASES)}")
    if args.steps is not None and args.steps <= WARMUP_STEPS:
        parser.error(f"--steps {args.steps} leaves no timed step: use more than {WARMUP_STEPS}")
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, met by peft
    if args.no_tensor_peak:
        TorchEngine.measures_tensor_peak = False  # run_loop then skips TensorPeak altogether
    print(f"threads={torch.get_num_threads()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} "
          f"rounds={args.rounds} tensor_peak={'off' if args.no_tensor_peak else 'on'} load={os.getloadavg()[0]:.1f}")
    print(f"{'case':<12} {'steps':>5} {'plain ms/step':>14} {'engine ms/step':>15} {'engine/plain':>13} "
          f"{'target':>7}  within  load")
    for name in names:
        case = CASES[name]
        if case.model.method == "qlora" and (problem := qlora_problem()) is not None:
            print(f"{name:<12} skipped: bitsandbytes' NF4 Linear4bit does not train on this machine ({problem})")
            continue
        steps = args.steps or case.steps
        p, e = run_case(case, steps, args.rounds)
        ratio = e / p
        print(f"{name:<12} {steps:>5} {p * 1e3:>14.1f} {e * 1e3:>15.1f} {ratio:>13.3f} {case.target:>7.2f}  "
              f"{'yes' if ratio <= case.target else 'NO ':<6}  {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
