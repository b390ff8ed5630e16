"""The analytic memory model's terms against the trace, per layer: where the formula and the engine disagree.

    python benchmarks/memory_terms.py [--device cpu|cuda|both]

For each family (GPT-3, Llama, T5) and layout (one rank; DP2 at ZeRO 0-3; TP2; TP2 with every layer
checkpointed), traces one stage (``hp_tool.trial.memtrace``) with one and with two units of layers and
prints, per unit (a layer; T5: an encoder and a decoder layer), the traced increments of the parameters,
gradients and optimizer states (``state``) and of the peak of the forwards and backwards less the states
(``activation``: what one micro-batch keeps per layer, plus what a layer's compute copies add), each
beside the analytic model's term (``hp_tool.estimate.memory``) and their ratio; then the whole stage at
its own depth, traced and analytic. ``cuda`` traces the GPU's bf16 autocast and FSDP2 parameter dtype on
fake tensors (no GPU needed); ``cpu`` the CPU trials' fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings

from hp_tool.architectures import layer_parameters
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.memory import estimate_memory, layer_activation_bytes, model_state_bytes
from hp_tool.trial.memtrace import _trace_stage, _with_units, stage_units
from hp_tool.trial.spec import ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec, TrialSpec

LAYOUTS = [{}, {"dp": 2, "zero_stage": 0}, {"dp": 2, "zero_stage": 1}, {"dp": 2, "zero_stage": 2},
           {"dp": 2, "zero_stage": 3}, {"tp": 2}, {"tp": 2, "act_ckpt": 1}]


def spec_for(family: str, layout: dict, precision: str) -> TrialSpec:
    tp, dp = layout.get("tp", 1), layout.get("dp", 1)
    encdec = family == "t5"
    model = ModelSpec(family=family, num_layers=4 if encdec else 8, hidden_size=256, num_attention_heads=8,
                      num_kv_heads=4 if family == "llama" else 8,
                      ffn_hidden_size={"llama": 688, "t5": 640}.get(family, 1024), vocab_size=1024,
                      seq_length=256, kv_channels=32 if encdec else None,
                      decoder_seq_length=128 if encdec else None)
    return TrialSpec(
        trial_id=f"terms_{family}", model=model,
        parallel=ParallelSpec(tp=tp, pp=1, dp=dp, mbs=2, act_ckpt_layers=0,
                              zero_stage=layout.get("zero_stage", 3)),
        training=TrainingSpec(global_batch_size=2 * dp, precision=precision, max_steps=100),
        resources=ResourcesSpec(num_nodes=1, gpus_per_node=tp * dp),
        run=RunSpec(max_steps=3, warmup_steps=1, stable_cv=0.0, max_minutes=10))


def hardware(precision: str) -> Hardware:
    return Hardware(gpus_per_node=8, gpu_memory_gb=80, peak_tflops=1, intra_node_bandwidth_gbps=5,
                    inter_node_bandwidth_gbps=5, memory_overhead_gb=0.0, precision=precision)


def row(family: str, layout: dict, device: str) -> None:
    precision = "bf16" if device == "cuda" else "fp32"
    spec = spec_for(family, layout, precision)
    p, shape, hw = spec.parallel, spec.model.shape(), hardware(precision)
    _, per_unit, _ = stage_units(spec)
    ckpt = layout.get("act_ckpt", 0)
    one, two = (_trace_stage(_with_units(spec, n, ckpt * n * per_unit), 0, device, (1,))[0] for n in (1, 2))
    state = two.state_bytes - one.state_bytes
    activation = (two.train_bytes - one.train_bytes) - state
    params = (layer_parameters(shape) + (layer_parameters(shape, encoder=True) if shape.encoder_decoder else 0)) / p.tp
    # the analytic model's states per parameter follow its precision's mixed-precision Adam
    a_state = model_state_bytes(params, p.dp, p.zero_stage)
    if ckpt:
        a_activation = sum(shape.seq_length if enc else shape.target_length for enc in (
            [True, False] if shape.encoder_decoder else [False])) * p.mbs * shape.hidden_size * hw.bytes_per_value
    else:
        a_activation = layer_activation_bytes(shape, p.mbs, p.tp, False, hw)
        if shape.encoder_decoder:
            a_activation += layer_activation_bytes(shape, p.mbs, p.tp, False, hw, encoder=True)
    deep = dataclasses.replace(spec, parallel=dataclasses.replace(p, act_ckpt_layers=ckpt * shape.num_layers * per_unit))
    whole = _trace_stage(deep, 0, device, (1,))[0].peak_bytes
    layout_ = Layout(p.tp, 1, p.dp, p.mbs, deep.parallel.act_ckpt_layers, spec.training.global_batch_size,
                     p.zero_stage)
    analytic = estimate_memory(shape, layout_, hw).total_gb * 1e9
    name = "-".join(f"{k}{v}" for k, v in layout.items()) or "single"
    print(f"{device:4} {family:5} {name:16} state/unit {state / 1e6:8.3f} MB vs {a_state / 1e6:8.3f} "
          f"({state / a_state:5.2f})  activation/unit {activation / 1e6:8.3f} MB vs {a_activation / 1e6:8.3f} "
          f"({activation / a_activation:5.2f})  stage {whole / 1e6:8.2f} MB vs {analytic / 1e6:8.2f} "
          f"({analytic / whole:5.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda", "both"), default="both")
    parser.add_argument("--family", choices=("gpt3", "llama", "t5", "all"), default="all")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    devices = ("cpu", "cuda") if args.device == "both" else (args.device,)
    families = ("gpt3", "llama", "t5") if args.family == "all" else (args.family,)
    for device in devices:
        for family in families:
            for layout in LAYOUTS:
                row(family, layout, device)


if __name__ == "__main__":
    main()
