"""How fast is collecting? 1,000 trial directories of a GPT-3 5B search into one ranked table.

The base config and the candidate layouts come from the real planner (gpt3/5b); plan.csv is widened to
1,000 candidates by repeating the selected layouts under new trial ids. The trials' outputs are those
the engine leaves: 90% ok result.json files, 5% killed trials with only metrics.jsonl (50 steps),
5% corrupt result.json files. Target: under 2 s for collect_trials (reading, merging, extrapolating,
ranking), the CSVs and optimal config included.

    python3 benchmarks/collect_speed.py
"""

from __future__ import annotations

import csv
import json
import random
import tempfile
import time
from pathlib import Path

from hp_tool.cli import compose, results_dir
from hp_tool.config import to_app_config
from hp_tool.plan_output import PLAN_COLUMNS, write_plan
from hp_tool.planner import make_plan
from hp_tool.results.collect import collect_trials, full_run_for, successful
from hp_tool.results.report import ALL_TRIALS_COLUMNS, csv_text, write_reports
from hp_tool.contracts.result import RESULT_FIELDS

N_TRIALS = 1000
TARGET_S = 2.0


def widen_plan(out: Path, n: int) -> list[tuple[str, str]]:
    """Rewrite plan.csv with ``n`` selected rows cycling through the planner's selected layouts (and a
    candidate config per new id, for the optimal config); returns (trial id, fingerprint) pairs."""
    folder = out / "candidate_configs"
    path = folder / "plan.csv"
    with open(path, newline="") as fh:
        selected = [r for r in csv.DictReader(fh) if r["plan_status"] == "selected"]
    rows = []
    for i in range(n):
        row = dict(selected[i % len(selected)])
        source = row["trial_id"]
        row["trial_id"] = f"{source}_r{i:04d}"
        text = (folder / f"{source}.yaml").read_text()
        (folder / f"{row['trial_id']}.yaml").write_text(text.replace(source, row["trial_id"]))
        rows.append(row)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=PLAN_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return [(r["trial_id"], r["fingerprint"]) for r in rows]


def write_trials(out: Path, ids: list[tuple[str, str]]) -> None:
    rng = random.Random(0)
    for i, (tid, fingerprint) in enumerate(ids):
        folder = out / "training_logs" / tid
        folder.mkdir(parents=True)
        step_s = rng.uniform(5.0, 20.0)
        if i % 20 == 0:  # killed: metrics only
            lines = [json.dumps({"step": k, "step_time_s": step_s, "loss": 7.0, "lr": 1e-4, "tokens": 4194304,
                                 "memory_gib": 40.0, "timed": k > 3, "time": 1e9 + k * step_s})
                     for k in range(1, 51)]
            (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        elif i % 20 == 1:  # corrupt
            (folder / "result.json").write_text('{"status": "ok", "step_ti')
        else:
            result = dict.fromkeys(RESULT_FIELDS)
            result.update(trial_id=tid, fingerprint=fingerprint, status="ok", steps_run=50, steps_measured=47, step_time_s_median=step_s,
                          step_time_s_mean=step_s, step_time_s_std=0.01, tokens_per_s_per_gpu=4e6 / step_s,
                          model_tflops_per_gpu=150.0, mfu=0.48, peak_memory_gib=rng.uniform(20, 79),
                          world_size=8, first_losses=[7.0] * 5, final_loss=6.5)
            (folder / "result.json").write_text(json.dumps(result, indent=2))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg, name = compose(["search_config=gpt3/5b", f"base_results_dir={tmp}", "gpu.price_per_gpu_hour=2.5"])
        app = to_app_config(cfg)
        plan = make_plan(app, name, results_dir(app, name))
        write_plan(plan)
        out = plan.results_dir
        ids = widen_plan(out, N_TRIALS)
        write_trials(out, ids)

        t0 = time.perf_counter()
        full = full_run_for(out)
        df = collect_trials(out, time_box_s=1200.0, full=full)
        t1 = time.perf_counter()
        csv_text(df, ALL_TRIALS_COLUMNS)
        t2 = time.perf_counter()
        ok = successful(df)
        print(f"trials: {len(df)} ({df['status'].value_counts().to_dict()}), ranked: {len(ok)}")
        print(f"collect_trials: {t1 - t0:.3f} s for {N_TRIALS} trial directories "
              f"({N_TRIALS / (t1 - t0):,.0f} trials/s; target < {TARGET_S:g} s)")
        print(f"collect + all-trials CSV text: {t2 - t0:.3f} s")
        print("best:", ok.iloc[0]["trial_id"], f"{ok.iloc[0]['full_run_step_time_s']:.3f} s per step")
        t3 = time.perf_counter()
        write_reports(out, df, full, top_n=10)
        print(f"all final_results files incl. plots of {N_TRIALS} bars: {time.perf_counter() - t3:.3f} s")


if __name__ == "__main__":
    main()
