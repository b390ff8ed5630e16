"""Long context: Llama-3 8B fully fine-tuned at 32K tokens per sequence on 1 and on 2 x A100 80 GiB (REFERENCE
§15's case), planned by the dry run, then the memory each long-context saver removes on one layout, predicted
and traced.

    python3 benchmarks/long_context.py            # both tables (the traces take a few minutes on 2 cores)
    python3 benchmarks/long_context.py --no-trace # the plan table and the predicted savings only

Table 1: every layout of ``finetune/llama3_8b_32k`` that fits (selected or beyond the run limit), fastest first,
with the savers it uses: TP / CP, sequence parallel (sp), the loss (chunked: output projection and
cross-entropy over 4096-token chunks), checkpointed layers, activation offload (aoff), engine, ZeRO stage and
state offload; predicted GPU and host memory, step time and tokens per hour.

Table 2: one layout (torch engine, ZeRO-3 without state offload so that the trace models it, MBS 1, the GPU's
memory raised so that nothing is pruned), each saver added alone to a base without it; the predicted peak
split into states, activations and logits, the traced peak of the engine's own rank build (tensors plus the
preset's overhead), and what the saver removes from each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hp_tool.cli import compose  # noqa: E402
from hp_tool.config import to_app_config  # noqa: E402
from hp_tool.estimate.memory import estimate_memory  # noqa: E402
from hp_tool.memory_check import Tracer, trace_device  # noqa: E402
from hp_tool.planner import make_plan  # noqa: E402
from hp_tool.vocab import OVER_LIMIT, SELECTED  # noqa: E402

TS = "search_config.train_settings"
SEQ = 32768


def plan(gpus: int, *overrides: str, traced: bool = False):
    cfg, name = compose(["search_config=finetune/llama3_8b_32k", f"{TS}.gpus_per_node={gpus}",
                         f"memory_check={'traced' if traced else 'analytic'}", *overrides])
    app = to_app_config(cfg)
    tracer = Tracer(trace_device(app.gpu.name)) if traced else None  # a bf16 A100 rank under fake tensors
    with tempfile.TemporaryDirectory() as tmp:
        return make_plan(app, name, Path(tmp), tracer)


def savers(c) -> str:
    f = c.full
    return (f"TP{f.tp}{'+sp' if f.sequence_parallel else ''} CP{f.cp} MBS{f.mbs} loss {f.loss:<7} "
            f"ckpt{f.act_ckpt_layers:<2} {'aoff' if f.activation_offload else '    '} {f.engine:<9} "
            f"Z{f.zero_stage} {f.offload}")


def fitting_table(gpus: int) -> None:
    p = plan(gpus, f"{TS}.limit_search_runs=1000")
    fits = sorted((c for c in p.candidates if c.status in (SELECTED, OVER_LIMIT)), key=lambda c: c.rank)
    print(f"Llama-3 8B full fine-tuning at {SEQ} tokens, {gpus} x A100 80 GiB: {len(fits)} fitting layouts of "
          f"{len(p.candidates)} candidates, fastest first")
    print(f"{'rank':>4}  {'savers':<74} {'GPU GiB':>7} {'host GiB':>8} {'step s':>7} {'M tok/h':>8}")
    for c in fits:
        tokens_h = c.tokens_per_s_per_gpu * gpus * 3600 / 1e6
        print(f"{c.rank:>4}  {savers(c):<74} {max(c.memory_gib, c.full_memory_gib):>7.2f} {c.host_memory_gib:>8.1f} "
              f"{c.step_time_s:>7.2f} {tokens_h:>8.3f}")
    print()


# (label, GPUs, the base's overrides, the saver's overrides): each saver added alone to its base
BASE = (f"{TS}.engines=[torch]", f"{TS}.zero_stages=[3]", f"{TS}.offload=[none]", f"{TS}.pipeline_parallel_sizes=[1]",
        f"{TS}.micro_batch_sizes=[1]", f"{TS}.global_batch_tokens={2 * SEQ}", "gpu.memory_gib=2000",
        f"{TS}.activation_offload=[false]", f"{TS}.act_ckpt_modes=[full]")
ONE = (f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.context_parallel_sizes=[1]", f"{TS}.sequence_parallel=[false]")
CASES = [
    ("chunked loss", 1, (*ONE, f"{TS}.losses=[full]", f"{TS}.act_ckpt_layers=[0]"), (f"{TS}.losses=[chunked]",)),
    ("checkpointing (32 layers)", 1, (*ONE, f"{TS}.losses=[chunked]", f"{TS}.act_ckpt_layers=[0]"),
     (f"{TS}.act_ckpt_layers=[32]",)),
    ("activation offload", 1, (*ONE, f"{TS}.losses=[chunked]", f"{TS}.act_ckpt_layers=[0]", "gpu.host_ram_gib=4096"),
     (f"{TS}.activation_offload=[true]",)),
    ("context parallel (CP2 vs DP2)", 2, (*ONE, f"{TS}.losses=[chunked]", f"{TS}.act_ckpt_layers=[0]"),
     (f"{TS}.context_parallel_sizes=[2]",)),
    ("sequence parallel (TP2)", 2, (f"{TS}.tensor_parallel_sizes=[2]", f"{TS}.context_parallel_sizes=[1]",
                                    f"{TS}.sequence_parallel=[false]", f"{TS}.losses=[full]",
                                    f"{TS}.act_ckpt_layers=[0]"), (f"{TS}.sequence_parallel=[true]",)),
]


def one(gpus: int, overrides: tuple, traced: bool):
    p = plan(gpus, *BASE, *overrides, traced=traced)
    (c,) = [c for c in p.candidates if c.status in (SELECTED, OVER_LIMIT)]
    return p, c


def savings_table(traced: bool) -> None:
    print("Memory each saver removes at 32K (one layout; torch, ZeRO-3, MBS 1; GiB per GPU)")
    print(f"{'saver':<30} {'layout':<44} {'states':>7} {'activ.':>7} {'logits':>7} {'predicted':>9} "
          f"{'traced':>7}")
    for label, gpus, base, saver in CASES:
        rows = []
        for overrides in (base, (*base, *saver)):
            p, c = one(gpus, overrides, traced)
            m = estimate_memory(c.shape, c.trial_layout(), p.cluster.hw)
            rows.append((c.trial_id.split("_s32768_")[1], m, c.memory_gib, c.traced_memory_gib))
        for (lay, m, pred, tr), name in zip(rows, ("  without", "  with")):
            print(f"{label if name == '  without' else '':<30} {name[2:] + ': ' + lay:<44} {m.model_states_gib:>7.2f} "
                  f"{m.activations_gib:>7.2f} {m.logits_gib:>7.2f} {pred:>9.2f} "
                  f"{'-' if tr is None else f'{tr:.2f}':>7}")
        (_, m0, p0, t0), (_, m1, p1, t1) = rows
        traced_delta = "-" if t0 is None or t1 is None else f"{t0 - t1:.2f}"
        print(f"{'':<30} {'  removes':<44} {m0.model_states_gib - m1.model_states_gib:>7.2f} "
              f"{m0.activations_gib - m1.activations_gib:>7.2f} {m0.logits_gib - m1.logits_gib:>7.2f} {p0 - p1:>9.2f} "
              f"{traced_delta:>7}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-trace", action="store_true", help="predicted figures only (no traces)")
    parser.add_argument("--tables-only-traced", action="store_true", help="only the savers table (with traces)")
    args = parser.parse_args()
    if not args.tables_only_traced:
        for gpus in (1, 2):
            fitting_table(gpus)
    savings_table(traced=not args.no_trace)


if __name__ == "__main__":
    main()
