"""The analytic memory model's terms against the trace, per layer: where the formula and the engine disagree.

    python benchmarks/memory_terms.py [--device cpu|cuda|both] [--family gpt3|llama|t5|all]

For each family (GPT-3, Llama, T5) and layout (one rank; DP2 at ZeRO 0-3; TP2; TP2 and DP2 at ZeRO-2 with
every layer checkpointed), traces one stage with one and with two units of layers
(``hp_tool.trial.memterms``) and prints, per unit (a layer; T5: an encoder and a decoder layer), the traced
increments of the parameters, gradients and optimizer states (``state``) and of what one micro-batch's
forward keeps until its backward (``kept``: activations and the weights' compute copy), each beside the
analytic model's term (``hp_tool.estimate.memory``) and their ratio; then the whole stage at its own depth,
traced peak and analytic total. ``cuda`` traces the GPU's bf16 autocast and FSDP2 parameter dtype on fake
tensors (no GPU needed); ``cpu`` the CPU trials' fp32.

    python benchmarks/memory_terms.py --lora [--device cpu|cuda|both]

LoRA instead: Llama-2 7B (its shipped config, 32 layers) at 2048 tokens, r16 on all 7 linears of a layer, on one
rank and on FSDP2 over 2 ranks, adapter dropout 0 and 0.05, micro-batches 1, 2, 4 and 8: the whole peak per
rank, analytic and traced (extrapolated from 3- and 4-layer builds, as the memory check traces), and the
analytic figure's error against the trace. About 2-5 s a trace on a CPU core.
"""

from __future__ import annotations

import argparse
import warnings

from hp_tool.architectures import count_parameters
from hp_tool.base_config import model_spec
from hp_tool.estimate.layout import GIB
from hp_tool.estimate.memory import estimate_memory
from hp_tool.families.methods import linear_shapes
from hp_tool.hf_config import load_hf_model
from hp_tool.trial.memterms import target_hardware, target_layout, unit_terms, with_layout
from hp_tool.trial.trace.extrapolate import traced_peak_bytes
from hp_tool.trial.trace.replay import trace_stage
from hp_tool.contracts.spec import LoraSpec, ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec, TrialSpec

LAYOUTS = [{}, {"dp": 2, "zero_stage": 0}, {"dp": 2, "zero_stage": 1}, {"dp": 2, "zero_stage": 2},
           {"dp": 2, "zero_stage": 3}, {"tp": 2}, {"tp": 2, "act_ckpt_layers": 8},
           {"dp": 2, "zero_stage": 2, "act_ckpt_layers": 8}]


def spec_for(family: str, layout: dict, precision: str) -> TrialSpec:
    encdec = family == "t5"
    model = ModelSpec(family=family, num_layers=4 if encdec else 8, hidden_size=256, num_attention_heads=8,
                      num_kv_heads=4 if family == "llama" else 8,
                      ffn_hidden_size={"llama": 688, "t5": 640}.get(family, 1024), vocab_size=1024,
                      seq_length=256, kv_channels=32 if encdec else None,
                      decoder_seq_length=128 if encdec else None)
    spec = TrialSpec(
        trial_id=f"terms_{family}", model=model,
        parallel=ParallelSpec(tp=1, pp=1, dp=1, mbs=2, act_ckpt_layers=0, zero_stage=3),
        training=TrainingSpec(global_batch_size=2, precision=precision, max_steps=100),
        resources=ResourcesSpec(num_nodes=1, gpus_per_node=1),
        run=RunSpec(max_steps=3, warmup_steps=1, stable_cv=0.0, max_minutes=10))
    return with_layout(spec, **layout)


def row(family: str, layout: dict, device: str) -> None:
    spec = spec_for(family, layout, "bf16" if device == "cuda" else "fp32")
    t = unit_terms(spec, device)
    whole = trace_stage(spec, 0, device).peak_bytes
    analytic = estimate_memory(spec.model.shape(), target_layout(spec, device), target_hardware(device)).total_gib * 1e9
    name = "-".join(f"{k.replace('_layers', '')}{v}" for k, v in layout.items()) or "single"
    print(f"{device:4} {family:5} {name:26} state/unit {t.state / 1e6:7.3f} MB vs {t.analytic_state / 1e6:7.3f} "
          f"({t.state_ratio:4.2f})  kept/unit {t.kept / 1e6:7.3f} MB vs {t.analytic_kept / 1e6:7.3f} "
          f"({t.kept_ratio:4.2f})  stage {whole / 1e6:7.2f} MB vs {analytic / 1e6:7.2f} ({analytic / whole:4.2f})",
          flush=True)


LORA_LAYOUTS = [{}, {"dp": 2, "zero_stage": 3}]


def lora_spec(mbs: int, dropout: float, precision: str, layout: dict) -> TrialSpec:
    """Llama-2 7B at 2048 tokens with LoRA r16 on every linear of a layer, ``dropout`` on the adapters' input."""
    hf = load_hf_model("llama2_7b")
    base = hf.shape(2048)
    adapters = LoraSpec(16, 32.0, dropout, list(linear_shapes(base)))
    spec = TrialSpec(
        trial_id="terms_lora", model=model_spec(base, count_parameters(base), hf, "lora", adapters),
        parallel=ParallelSpec(tp=1, pp=1, dp=1, mbs=mbs, act_ckpt_layers=0, zero_stage=0),
        training=TrainingSpec(global_batch_size=mbs, precision=precision, max_steps=100),
        resources=ResourcesSpec(num_nodes=1, gpus_per_node=1),
        run=RunSpec(max_steps=3, warmup_steps=1, stable_cv=0.0, max_minutes=10))
    return with_layout(spec, **layout)


def lora_rows(device: str) -> None:
    """The LoRA table (module docstring) on ``device``: GiB per rank and the analytic figure's error."""
    print(f"{'device':6} {'layout':10} {'dropout':>7} {'mbs':>3} {'analytic GiB':>12} {'traced GiB':>10} {'error':>7}")
    for layout in LORA_LAYOUTS:
        name = "-".join(f"{k.replace('_stage', '')}{v}" for k, v in layout.items()) or "single"
        for dropout in (0.0, 0.05):
            for mbs in (1, 2, 4, 8):
                spec = lora_spec(mbs, dropout, "bf16" if device == "cuda" else "fp32", layout)
                traced = traced_peak_bytes(spec, device) / GIB
                e = estimate_memory(spec.model.shape(), target_layout(spec, device), target_hardware(device))
                analytic = e.total_gib - e.overhead_gib
                print(f"{device:6} {name:10} {dropout:7.2f} {mbs:3} {analytic:12.1f} {traced:10.1f} "
                      f"{100 * (analytic / traced - 1):+6.1f}%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda", "both"), default="both")
    parser.add_argument("--family", choices=("gpt3", "llama", "t5", "all"), default="all")
    parser.add_argument("--lora", action="store_true", help="the Llama-2 7B LoRA table instead of the per-layer terms")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    devices = ("cpu", "cuda") if args.device == "both" else (args.device,)
    if args.lora:
        for device in devices:
            lora_rows(device)
        return
    families = ("gpt3", "llama", "t5") if args.family == "all" else (args.family,)
    for device in devices:
        for family in families:
            for layout in LAYOUTS:
                row(family, layout, device)


if __name__ == "__main__":
    main()
