"""GPU-hours a search spends and how good its pick is, by strategy: on simulated landscapes at scale, and
on a real CPU landscape.

    python benchmarks/search_cost.py [--search gpt3/175b] [--mixed finetune/llama2_7b] [--seeds 20]
                                     [--margins 0.1,0.25,0.5] [--real] [--real-mixed]

The candidates and their predictions come from the real planner (``make_plan``, analytic memory) for the
search config on its cluster, every fitting candidate selected. For each seed a hidden truth is drawn from
a perturbed model: the cluster's compute and communication run ``U(0.8, 1.6)`` and ``U(0.5, 3)`` times the
model's, each candidate's step time has 8% log-normal noise on top, and memory runs ``U(0.95, 1.15)`` times
the prediction with 3% per-candidate noise, so layouts near the limit run out of memory unpredicted.
A trial costs its GPUs for 3 minutes of start-up plus its steps (an OOM: start-up plus one minute). The
mixed-method landscape (``--mixed``, a fine-tuning search with full, LoRA and QLoRA) adds a factor per value of the
recipe's regime dimensions, drawn once per seed: each method ``U(1, 4)``, each engine, offload, compile and fp8
value ``U(0.8, 1.5)``; so the model's ranking across methods is wrong by up to 4x.

Strategies:
- ``nemo``: every candidate, 50 fixed steps (NeMo's auto-configurator);
- ``exhaustive``: hp_tool without adaptation, the candidates the planner keeps under ``limit_search_runs`` (the
  search config's own, or ``--limit``; the best of each regime value within 2x first), 20 steps;
- ``adaptive(m)``: hp_tool's adaptive search (``hp_tool.adaptive``) in waves of ``--parallel`` trials over
  the same candidates: launch order spread over the regimes, skipping what the calibrated model puts
  more than ``m`` behind the best measured, pruning a regime's larger candidates after an OOM, and
  stopping a trial whose step is more than ``m`` behind the best of the earlier waves after its warm-up
  and ``LOSING_MIN_STEPS`` timed steps (``LOSING_FAST_STEPS`` when far behind on every step).

The mixed-method landscape also prints the fewest of its kept candidates that run every regime value they hold
(``value_cover``, greedy): each value's factor is known only once some trial runs it, so no search that calibrates
every value it may pick costs less than that share of the exhaustive search's trials.

Prints one line per strategy: median and worst GPU-hours as a fraction of ``nemo``'s, the median as a fraction
of ``exhaustive``'s, and the pick's true step time over the true best (median, worst). Targets: median pick
<= 1.03x best at <= 25% of nemo; on the mixed-method landscape at <= 25% of exhaustive.

``--real`` also searches the real CPU landscape of ``gpt3/tiny`` (12 candidates, TP, PP and micro-batch
on two CPU processes; ``--real-mixed``: ``finetune/tiny`` with full and LoRA fine-tuning) with ``main.py`` once per strategy, trials of at most ``--real-steps`` steps:
``nemo`` (exhaustive, the stable-time stop off: every trial runs all its steps), ``exhaustive`` (every
candidate, the stable-time stop on) and ``adaptive`` (the default), each with the analytic memory check,
and README's command as it is (adaptive, the traced memory check before launch). Its truth is the landscape measured
twice, by ``nemo`` and ``exhaustive``: each strategy's pick is scored by the mean of the two passes'
full-run step times of the same candidate over the best such mean. The
GPU-hours are process-hours of the trials (start to end), as the search's summary counts them, against nemo's
and the exhaustive search's; each line also gives the search's wall time and the share of it its trials spent
in their steps (the rest: process start-up, the gaps between trials, planning and collecting).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hp_tool.adaptive import LOSING_FAST_STEPS, LOSING_MIN_STEPS, Option, Outcome, launch_order, losing, verdicts
from hp_tool.calibration import values_of
from hp_tool.dimensions import regime_recipe

STARTUP_H = 3 / 60
OOM_H = 1 / 60
STEPS, WARMUP = 20, 3  # hp_tool's trial steps, of which untimed
STEP_JITTER = 0.03  # step-to-step noise of a running trial's timed steps (log-normal sigma)
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Candidate:
    option: Option
    gpus: int  # GPUs of its trial
    selected: bool  # within limit_search_runs as the planner keeps it (the best of each competing regime first)


@dataclass(frozen=True)
class Truth:
    step_s: dict[str, float]
    oom: set[str]


def candidates(search: str, limit: Optional[int], *overrides: str) -> tuple[list[Candidate], float]:
    """Every fitting candidate of the plan (predicted fastest first; ``selected``: kept under ``limit``), and the
    usable GB per GPU. ``limit`` None: the search config's own."""
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.planner import make_plan
    from hp_tool.vocab import OVER_LIMIT, SELECTED

    cfg, name = compose([f"search_config={search}", "memory_check=analytic", *overrides,
                         *([] if limit is None else [f"search_config.train_settings.limit_search_runs={limit}"])])
    app = to_app_config(cfg)
    with tempfile.TemporaryDirectory() as folder:
        plan = make_plan(app, name, Path(folder))
    gpn = plan.cluster.hw.gpus_per_node
    fitting = sorted((c for c in plan.candidates if c.status in (SELECTED, OVER_LIMIT)), key=lambda c: c.rank)
    out = [Candidate(Option(f"c{c.rank}_tp{c.tp}_pp{c.pp}_mbs{c.mbs}_ac{c.act_ckpt_layers}_z{c.zero_stage}", c.tp,
                            c.pp, c.compute_time_s, c.comm_time_s, c.memory_gib, regime_recipe(c.full.values())),
                     c.trial_nodes * gpn, c.status == SELECTED) for c in fitting]
    ts = app.search_config.train_settings
    return out, plan.cluster.hw.gpu_memory_gib * (1 - ts.memory_margin)


def draw_truth(cands: list[Candidate], usable_gib: float, rng: random.Random, per_value: bool = False) -> Truth:
    """The hidden landscape (module docstring); ``per_value``: each value of a recipe's regime dimension runs its
    own factor times the model on top, drawn once per value, each method ``U(1, 4)``, each engine, offload,
    compile and fp8 value ``U(0.8, 1.5)``: the mixed-method landscape, where one method may run 4x its prediction
    and another 1x."""
    fc, fm, mem = rng.uniform(0.8, 1.6), rng.uniform(0.5, 3.0), rng.uniform(0.95, 1.15)
    factor: dict = {}
    if per_value:  # each method its own U(1, 4) (LoRA 1.8x, QLoRA 2.1x on one H100; 7.5x on CPU processes), the
        # other recipe values U(0.8, 1.5)
        for value in sorted({v for c in cands for v in c.option.recipe}, key=str):
            factor[value] = rng.uniform(1.0, 4.0) if value[0] == "method" else rng.uniform(0.8, 1.5)
    step = {c.option.name: (fc * c.option.compute_s + fm * c.option.comm_s) * math.exp(rng.gauss(0, 0.08))
            * math.prod(factor.get(v, 1.0) for v in c.option.recipe) for c in cands}
    oom = {c.option.name for c in cands if c.option.memory_gib * mem * (1 + rng.uniform(-0.03, 0.03)) > usable_gib}
    return Truth(step, oom)


def trial_hours(c: Candidate, truth: Truth, steps: float) -> float:
    if c.option.name in truth.oom:
        return c.gpus * (STARTUP_H + OOM_H)
    return c.gpus * (STARTUP_H + steps * truth.step_s[c.option.name] / 3600)


def run(cands: list[Candidate], truth: Truth, steps: int) -> tuple[float, dict[str, float]]:
    """GPU-hours of running ``cands`` and the measured step time of each that did not OOM."""
    hours = sum(trial_hours(c, truth, steps) for c in cands)
    return hours, {c.option.name: truth.step_s[c.option.name] for c in cands if c.option.name not in truth.oom}


def adaptive(cands: list[Candidate], truth: Truth, margin: float, parallel: int,
             rng: random.Random) -> tuple[float, dict[str, float]]:
    by_name = {c.option.name: c for c in cands}
    options = [c.option for c in cands]
    queue = launch_order(options)
    outcomes: list[Outcome] = []
    hours, measured = 0.0, {}
    while queue:
        decided = verdicts(options, outcomes, margin)
        queue = [n for n in queue if n not in decided]
        wave, queue = queue[:parallel], queue[parallel:]
        earlier = list(outcomes)  # a trial is judged against the waves before its own
        for name in wave:
            c = by_name[name]
            timed = [truth.step_s[name] * math.exp(rng.gauss(0, STEP_JITTER)) for _ in range(LOSING_MIN_STEPS)]
            stopped_at = next((n for n in (LOSING_FAST_STEPS, LOSING_MIN_STEPS) if name not in truth.oom
                               and losing(name, timed[:n], truth.step_s[name], earlier, margin) is not None), None)
            hours += trial_hours(c, truth, STEPS if stopped_at is None else WARMUP + stopped_at)
            if name in truth.oom:
                outcomes.append(Outcome(name, "oom"))
            else:
                measured[name] = truth.step_s[name]
                outcomes.append(Outcome(name, "ok", truth.step_s[name]))
    return hours, measured


def value_cover(cands: list[Candidate]) -> list[Candidate]:
    """Candidates that together run every regime value of ``cands`` (TP 2, LoRA, the DeepSpeed engine, ...), few
    (greedy set cover: the one adding the most values first): the trials a search needs at least to calibrate
    every value it may pick."""
    missing = {v for c in cands for v in values_of(c.option.regime)}
    out = []
    while missing:
        best = max(cands, key=lambda c: len(missing & set(values_of(c.option.regime))))
        out.append(best)
        missing -= set(values_of(best.option.regime))
    return out


def folder(strategy: str) -> str:
    """A results folder name for ``strategy`` that a Hydra override takes as is."""
    return "".join(ch if ch.isalnum() else "_" for ch in strategy)


def real_landscape(steps: int, search: str = "gpt3/tiny", overrides: tuple = ()) -> None:
    """Part (b): ``search`` (gpt3/tiny; or finetune/tiny with full and LoRA, the mixed-method landscape) searched
    for real once per strategy (see the module docstring)."""
    from hp_tool.results.collect import RANK_COLUMN, collect_trials
    from hp_tool.vocab import SELECTED
    from hp_tool.results.report import trial_gpu_hours

    ts = "search_config.train_settings"
    strategies = {
        "nemo": ["memory_check=analytic", f"{ts}.search_strategy=exhaustive", f"{ts}.stable_cv=0"],
        "exhaustive": ["memory_check=analytic", f"{ts}.search_strategy=exhaustive"],
        "adaptive(0.25)": ["memory_check=analytic", f"{ts}.search_strategy=adaptive", f"{ts}.skip_margin=0.25"],
        "README default": None,  # README's command as it is: adaptive, traced memory check, the preset's steps
    }
    tables, walls, training = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, settings in strategies.items():
            cmd = [sys.executable, str(REPO / "main.py"), f"search_config={search}", "cluster=local",
                   f"base_results_dir={tmp}/{folder(name)}", *overrides,
                   *([] if settings is None else [f"{ts}.max_steps_per_run={steps}", *settings])]
            start = time.monotonic()
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            walls[name] = time.monotonic() - start
            if proc.returncode != 0:
                raise SystemExit(f"{name}: main.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            results = Path(tmp) / folder(name) / search
            df = collect_trials(results)
            tables[name] = df[df["plan_status"] == SELECTED]
            training[name] = steps_seconds(results)
    nemo = tables["nemo"]
    passes = [t[t["rank"].notna()].set_index("trial_id")[RANK_COLUMN] for t in (nemo, tables["exhaustive"])]
    truth = ((passes[0] + passes[1]) / 2).dropna()  # both full passes: one pass's noise is not the truth
    nemo_h = float(trial_gpu_hours(nemo).sum())
    exhaustive_h = float(trial_gpu_hours(tables["exhaustive"]).sum())
    print(f"{search} {' '.join(overrides)} on CPU processes (real): {len(nemo)} candidates, {len(truth)} measured by nemo and "
          f"exhaustive (the truth: the mean of their two measurements; they differ by a median "
          f"{float(((passes[0] - passes[1]).abs() / truth).median()):.0%}), best {truth.idxmin()} at "
          f"{truth.min():.4g} s per step")
    for name, table in tables.items():
        ranked = table[table["rank"].notna()].sort_values("rank")
        pick = ranked["trial_id"].iloc[0]
        ran = int(trial_gpu_hours(table).notna().sum())
        stopped = int((table["stop_reason"] == "losing").sum())
        hours = float(trial_gpu_hours(table).sum())
        print(f"  {name:16} GPU-hours vs nemo: {hours / nemo_h:6.1%}, vs exhaustive: {hours / exhaustive_h:6.1%} "
              f"({ran} trials ran, {stopped} stopped early);  pick {pick} / true best: "
              f"{truth.get(pick, math.nan) / truth.min():.3f}x;  wall {walls[name]:.0f} s, "
              f"{training[name] / walls[name]:.0%} of it in trial steps")


def steps_seconds(results: Path) -> float:
    """Seconds a search's trials spent in their steps (rank 0's metrics.jsonl, warm-up steps included): the
    part of its wall time spent training, the rest being start-up, gaps between trials, planning and
    collecting."""
    from hp_tool.results.trial_files import read_metrics
    from hp_tool.vocab import METRICS_FILE

    total = 0.0
    for path in (results / "training_logs").glob(f"*/{METRICS_FILE}"):
        steps, _ = read_metrics(path)
        total += sum(float(s["step_time_s"]) for s in steps)
    return total


def simulate(search: str, overrides: tuple, per_value: bool, seeds: int, limit: Optional[int], parallel: int,
             margins: list[float]) -> None:
    """One simulated landscape (module docstring), ``seeds`` draws of its truth: a line per strategy."""
    cands, usable = candidates(search, limit, *overrides)
    chosen = [c for c in cands if c.selected]
    stats: dict[str, list[tuple[float, float, float]]] = {}
    for seed in range(seeds):
        truth = draw_truth(cands, usable, random.Random(seed), per_value)
        fits = [truth.step_s[c.option.name] for c in cands if c.option.name not in truth.oom]
        if not fits:
            continue
        best = min(fits)
        nemo_h, _ = run(cands, truth, 50)
        exhaustive = run(chosen, truth, STEPS)
        results = {"exhaustive": exhaustive}
        for m in margins:
            results[f"adaptive({m:g})"] = adaptive(chosen, truth, m, parallel, random.Random(10_000 + seed))
        results["nemo"] = (nemo_h, {n: s for n, s in truth.step_s.items() if n not in truth.oom})
        for name, (hours, measured) in results.items():
            pick = min(measured.values()) if measured else float("inf")
            stats.setdefault(name, []).append((hours / nemo_h, hours / exhaustive[0], pick / best))
    regimes = len({c.option.regime for c in chosen})
    cover = value_cover(chosen)
    print(f"{search}{' ' + ' '.join(overrides) if overrides else ''}: {len(cands)} fitting candidates, {seeds} seeds"
          f"{', each method its own U(1, 4) factor, each other recipe value U(0.8, 1.5)' if per_value else ''}; "
          f"exhaustive/adaptive over the "
          f"{len(chosen)} kept under limit_search_runs ({regimes} regimes), waves of {parallel}")
    if per_value:  # how far the regime values alone bound the cost: each must run once for its factor to be known
        print(f"  every regime value the kept candidates hold ({len({v for c in chosen for v in values_of(c.option.regime)})}"
              f" values) runs in {len(cover)} of them at the fewest (greedy cover): {len(cover) / len(chosen):.0%} of the "
              f"exhaustive search's trials before any is confirmed")
    for name, rows in stats.items():
        cost, vs_exhaustive, pick = ([r[i] for r in rows] for i in range(3))
        print(f"  {name:16} GPU-hours vs nemo: median {statistics.median(cost):6.1%}, worst {max(cost):6.1%}; vs "
              f"exhaustive: median {statistics.median(vs_exhaustive):6.1%};  pick / true best: median "
              f"{statistics.median(pick):.3f}x, worst {max(pick):.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--search", default="gpt3/175b")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--skip-simulation", action="store_true", help="with --real: only the real landscape")
    parser.add_argument("--limit", type=int, default=None,
                        help="limit_search_runs of the searches (default: each search config's own)")
    parser.add_argument("--parallel", type=int, default=8, help="trials per wave (cluster.max_parallel_runs)")
    parser.add_argument("--margins", default="0.1,0.25,0.5")
    parser.add_argument("--real", action="store_true", help="also search gpt3/tiny's real CPU landscape")
    parser.add_argument("--real-mixed", action="store_true",
                        help="also search finetune/tiny's real CPU landscape with full and LoRA fine-tuning")
    parser.add_argument("--real-steps", type=int, default=30, help="steps per trial of the real searches")
    parser.add_argument("--mixed", default="finetune/llama2_7b",
                        help="the mixed-method fine-tuning landscape's search (full, LoRA and QLoRA); '' for none")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    mixed = ("search_config.train_settings.methods=[full,lora]",)
    if (args.real or args.real_mixed) and args.skip_simulation:
        if args.real:
            real_landscape(args.real_steps)
        if args.real_mixed:
            real_landscape(args.real_steps, "finetune/tiny", mixed)
        return
    margins = [float(m) for m in args.margins.split(",")]
    landscapes = [(args.search, (), False)]
    if args.mixed:  # the mixed-method fine-tuning landscape: every method, each running its own factor
        landscapes.append((args.mixed, ("search_config.train_settings.methods=[full,lora,qlora]",), True))
    for search, overrides, per_value in landscapes:
        simulate(search, overrides, per_value, args.seeds, args.limit, args.parallel, margins)
    if args.real:
        real_landscape(args.real_steps)
    if args.real_mixed:
        real_landscape(args.real_steps, "finetune/tiny", mixed)


if __name__ == "__main__":
    main()
