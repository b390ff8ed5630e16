"""How fast is planning? GPT-3 175B on 1024 GPUs with every dimension widened.

TP 1-8, every PP dividing the 96 layers, MBS 1-16 and every checkpointed-layer count of each stage
(0..96/PP): the whole grid goes through validity, memory and step-time estimates, pruning and ranking.
Target: under 1 s for the whole plan.

    python3 benchmarks/plan_speed.py
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections import Counter
from pathlib import Path

from hp_tool.base_config import base_spec, choose_model, resolve_cluster
from hp_tool.candidates import Grid, plan_candidates
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.plan_output import funnel_line, plan_csv_text, write_plan
from hp_tool.planner import make_plan


def main() -> None:
    cfg, name = compose(["search_config=gpt3/175b"])
    app = to_app_config(cfg)
    ts = app.search_config.train_settings
    cluster = resolve_cluster(app)
    model = choose_model(app, cluster)
    layers = model.shape.num_layers
    gbs = base_spec(app, model, cluster).training.global_batch_size
    grid = Grid(tp=list(range(1, 9)), pp=[p for p in range(1, layers + 1) if layers % p == 0],
                mbs=list(range(1, 17)), act_ckpt=None, mp_range=(1, 1024), act_ckpt_step=1)

    t0 = time.perf_counter()
    candidates = plan_candidates(model.shape, model.size_b, ts, cluster, gbs, grid)
    t1 = time.perf_counter()
    n = len(candidates)
    print(f"candidates: {n} ({dict(Counter(c.status for c in candidates))})")
    print(funnel_line(candidates))
    print(f"grid + validity + memory/step-time estimates + pruning + ranking: {t1 - t0:.3f} s "
          f"({n / (t1 - t0):,.0f} candidates/s; target < 1 s)")

    # the whole dry run as a user runs it, with its plan.csv and YAMLs (shipped 175b grid)
    with tempfile.TemporaryDirectory() as tmp:
        t2 = time.perf_counter()
        plan = make_plan(app, name, Path(tmp) / name)
        write_plan(plan)
        t3 = time.perf_counter()
    print(f"shipped gpt3/175b plan, {len(plan.candidates)} candidates, written to disk: {t3 - t2:.3f} s")
    t4 = time.perf_counter()
    text = plan_csv_text(dataclasses.replace(plan, candidates=candidates))
    t5 = time.perf_counter()
    print(f"plan.csv of the widened grid ({len(text) / 1e6:.1f} MB): {t5 - t4:.3f} s")


if __name__ == "__main__":
    main()
