"""The fine-tuning tables: Llama-2 7B fully fine-tuned on 8 x A100 80 GiB at context 512..4096, predicted by the
dry run beside the measured row of a Ray/DeepSpeed fine-tuning cookbook (REFERENCE §13), then the verdicts
for the small GPUs people fine-tune on (6 x A10G 24 GiB nodes, 4 x V100 32 GiB), each method on small GPUs, and
Mixtral-8x7B (a mixture of experts) on 8 x A100 80 GiB.

    python3 benchmarks/finetune_table.py

For each context the cookbook's own layout (DeepSpeed ZeRO-3, activation checkpointing on every layer, its
batch per device, one micro-batch per step) is planned alone, so its prediction compares with the
measurement; "best" is the plan's fastest layout at that context when every layout of the finetune preset is
searched. MFU is printed in both conventions: the cookbook's (6 x parameters x tokens / s / 312 TFLOPS) and
hp_tool's (matmul FLOPs incl. attention, recomputation not counted). $/M tokens = the node's $40.77/h over
tokens per hour (the cookbook's own $ column follows another convention; REFERENCE §13).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hp_tool.cli import compose  # noqa: E402
from hp_tool.config import to_app_config  # noqa: E402
from hp_tool.planner import make_plan  # noqa: E402
from hp_tool.vocab import SELECTED  # noqa: E402

N_7B = 6_738_415_616
NODE_PRICE = 40.77  # USD per hour for 8 x A100 80 GiB (the cookbook's on-demand figure)
# context, batch per device, measured tokens/hour (millions), measured MFU (REFERENCE §13)
MEASURED = [(512, 64, 101.47, 0.47), (1024, 32, 103.7, 0.48), (2048, 8, 99.75, 0.47), (4096, 4, 102.58, 0.48)]


def plan(*overrides: str):
    cfg, name = compose(["search_config=finetune/llama2_7b", *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        return make_plan(to_app_config(cfg), name, Path(tmp))


def fastest(p):
    return min((c for c in p.candidates if c.status == SELECTED), key=lambda c: c.rank)


def layout(c) -> str:
    return (f"TP{c.tp} PP{c.pp} DP{c.dp} MBS{c.mbs} ckpt{c.act_ckpt_layers} {c.engine} Z{c.zero_stage} "
            f"{c.offload}")


def cookbook_layout(ctx: int, bs: int):
    """The cookbook's own layout at context ``ctx`` (``bs`` sequences per device), planned alone: its candidate."""
    ts = "search_config.train_settings"
    p = plan(f"{ts}.seq_lengths=[{ctx}]", f"{ts}.global_batch_tokens={8 * bs * ctx}", f"{ts}.engines=[deepspeed]",
             f"{ts}.zero_stages=[3]", f"{ts}.offload=[none]", f"{ts}.tensor_parallel_sizes=[1]",
             f"{ts}.pipeline_parallel_sizes=[1]", f"{ts}.micro_batch_sizes=[{bs}]", f"{ts}.act_ckpt_layers=[32]")
    return next(c for c in p.candidates if c.step_time_s is not None)


def predicted_tokens_per_hour_m(c) -> float:
    """Millions of tokens per hour of a candidate on the 8 GPUs of the cookbook's node."""
    return c.tokens_per_s_per_gpu * 8 * 3600 / 1e6


def tokens_per_hour_errors() -> list[float]:
    """Predicted / measured tokens per hour - 1 at each context of ``MEASURED`` (README's fine-tuning figure is
    their median)."""
    return [predicted_tokens_per_hour_m(cookbook_layout(ctx, bs)) / tok_h - 1 for ctx, bs, tok_h, _ in MEASURED]


def main() -> None:
    ts = "search_config.train_settings"
    print("Llama-2 7B full fine-tuning, 8 x A100 80 GiB (gpu=a100_80gb), bf16")
    print(f"{'ctx':>5} {'bs/dev':>6} | {'measured M tok/h':>16} {'MFU':>5} {'$/M':>6} | {'predicted M tok/h':>17} "
          f"{'err':>6} {'MFU 6N':>6} {'MFU hp':>6} {'$/M':>6} {'GB':>5} | best layout at this context (M tok/h)")
    errors = []
    for ctx, bs, tok_h, mfu in MEASURED:
        c = cookbook_layout(ctx, bs)
        per_gpu = c.tokens_per_s_per_gpu
        pred = predicted_tokens_per_hour_m(c)
        errors.append(pred / tok_h - 1)
        best = fastest(plan(f"{ts}.seq_lengths=[{ctx}]"))
        fits = "fits" if c.status in (SELECTED, "over_limit") else f"{c.status}: {c.reason[:40]}"
        print(f"{ctx:>5} {bs:>6} | {tok_h:>16.2f} {mfu:>5.2f} {NODE_PRICE / tok_h:>6.3f} | {pred:>17.1f} "
              f"{100 * errors[-1]:>+5.0f}% {6 * N_7B * per_gpu / 312e12:>6.2f} "
              f"{c.model_tflops_per_gpu / 312:>6.2f} {NODE_PRICE / pred:>6.3f} {c.full_memory_gib:>5.1f} | "
              f"{layout(best)} ({best.tokens_per_s_per_gpu * 8 * 3600 / 1e6:.1f}) [{fits}]")
    print(f"tokens/hour error over the four contexts: median {100 * sorted(errors)[1]:+.0f}% .. "
          f"{100 * sorted(errors)[2]:+.0f}% ({100 * statistics.median(errors):+.1f}%), "
          f"max |{100 * max(map(abs, errors)):.0f}%|")
    print()
    print("Verdicts on small GPUs (every layout of the preset; full fine-tuning, AdamW):")
    for gpu, extra in (("a10g_g5_4xlarge", [f"{ts}.num_nodes=6", f"{ts}.gpus_per_node=1", f"{ts}.global_batch_tokens=393216"]),
                       ("v100_32gb", [f"{ts}.gpus_per_node=4"])):
        try:
            p = plan(f"gpu={gpu}", *extra)
        except Exception as exc:  # nothing fits: the plan's error names the smallest layout
            print(f"  {gpu}: nothing fits ({exc})")
            continue
        best = fastest(p)
        print(f"  {gpu} x {p.cluster.gpus}: fastest {layout(best)} at seq {best.shape.seq_length}, "
              f"{best.tokens_per_s_per_gpu * p.cluster.gpus * 3600 / 1e6:.1f} M tok/h, "
              f"{max(best.memory_gib, best.full_memory_gib):.1f} GiB per GPU, {best.host_memory_gib:.0f} GiB host RAM per node; "
              f"{sum(c.status == SELECTED for c in p.candidates)} layouts selected, "
              f"{sum(c.status == 'pruned' for c in p.candidates)} pruned")




def methods_table() -> None:
    """Full fine-tuning, LoRA (r=16 on every linear) and QLoRA of Llama-2 7B and 13B on one A10G, one L4
    and 4 x V100 32 GiB: each method's verdict, predicted peak memory per GPU, step time and $/M tokens at
    context 2048."""
    ts = "search_config.train_settings"
    print()
    print("Methods (context 2048, 64K tokens per step): fit, GiB per GPU, step s, $/M tokens of each method's fastest layout")
    targets = [("a10g", ["search_config.train_settings.gpus_per_node=1"]), ("l4", [f"{ts}.gpus_per_node=1"]),
               ("v100_32gb", [f"{ts}.gpus_per_node=4"])]
    for model in ("llama2_7b", "llama2_13b"):
        for gpu, extra in targets:
            cells = []
            for method in ("full", "lora", "qlora"):
                try:
                    cfg, name = compose([f"search_config=finetune/{model}", f"gpu={gpu}", "dry_run=true", *extra,
                                         f"{ts}.methods=[{method}]", f"{ts}.seq_lengths=[2048]",
                                         f"{ts}.global_batch_tokens=65536", f"{ts}.precision=null"])
                    with tempfile.TemporaryDirectory() as tmp:
                        p = make_plan(to_app_config(cfg), name, Path(tmp))
                    best = fastest(p)
                    gpus = p.cluster.gpus
                    per_m = (p.cluster.gpu_hour_price * gpus / (best.tokens_per_s_per_gpu * gpus * 3600 / 1e6)
                             if p.cluster.gpu_hour_price else float("nan"))
                    cells.append(f"{method}: fits {max(best.memory_gib, best.full_memory_gib):.1f} GiB "
                                 f"{best.step_time_s:.2f} s ${per_m:.2f}")
                except Exception as exc:  # nothing fits
                    cells.append(f"{method}: no fit ({str(exc).split(':')[0]})")
            print(f"  {model:>10} on {gpu:>9}: " + " | ".join(cells))


def mixtral_table() -> None:
    """Mixtral-8x7B (46.7B parameters, 12.9B active) on 8 x A100 80 GiB at context 512..4096: per method the
    fastest fitting layout (its EP), predicted memory, tokens/hour, MFU (active FLOPs) and $/M tokens."""
    ts = "search_config.train_settings"
    print()
    print("Mixtral-8x7B on 8 x A100 80 GiB (gpu=a100_80gb), bf16, 262K tokens per step: fastest layout per method")
    print(f"{'ctx':>5} {'method':>6} | {'fit':>4} {'layout':<44} {'GB':>5} {'M tok/h':>8} {'MFU':>5} {'$/M':>6}")
    for ctx in (512, 1024, 2048, 4096):
        for method in ("full", "lora"):
            cfg, name = compose(["search_config=finetune/mixtral_8x7b", "dry_run=true", f"{ts}.seq_lengths=[{ctx}]",
                                 f"{ts}.methods=[{method}]"])
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    p = make_plan(to_app_config(cfg), name, Path(tmp))
            except Exception as exc:  # nothing fits: the plan's error names the smallest layout
                print(f"{ctx:>5} {method:>6} | {'no':>4} {str(exc)[:110]}")
                continue
            best = fastest(p)
            gpus = p.cluster.gpus
            tok_h = best.tokens_per_s_per_gpu * gpus * 3600 / 1e6
            per_m = p.cluster.gpu_hour_price * gpus / tok_h if p.cluster.gpu_hour_price else float("nan")
            print(f"{ctx:>5} {method:>6} | {'yes':>4} {layout(best) + f' EP{best.ep}':<44} "
                  f"{max(best.memory_gib, best.full_memory_gib):>5.1f} {tok_h:>8.1f} "
                  f"{best.model_tflops_per_gpu / p.cluster.hw.peak_tflops:>5.2f} {per_m:>6.3f}")


if __name__ == "__main__":
    main()
    methods_table()
    mixtral_table()
