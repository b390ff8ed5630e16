"""How fast is planning? Every shipped preset as a dry run plans it, then GPT-3 175B on 1024 GPUs with TP, PP,
MBS and checkpointing widened, then the largest presets with every searched dimension given as an explicit list.

Shipped presets: each of hp_tool/conf/search_config planned with the analytic memory check through
``make_plan``, its candidate count and wall time against the target (under 2 s each); a preset that needs the
user's input (finetune/custom: its model's Hugging Face config) is listed as skipped. The fine-tuning presets
read their Hugging Face config with transformers, whose import a process pays once: it is timed on its own
line, before the presets. Widened grid: TP 1-8, every PP dividing the 96 layers, MBS 1-16 and every
checkpointed-layer count of each stage (0..96/PP): the whole grid goes through validity, memory and step-time
estimates, pruning and ranking. Every dimension listed: TP, PP, virtual stages, MBS, engines, ZeRO stages and
offloads given on the command line as a user would, through ``make_plan``. Each line prints the grid size,
what each stage of planning removed (``plan_output.funnel_line``), how many candidates the models estimated,
and the wall time. Targets: every shipped preset under 2 s; the shipped gpt3/175b plan under 1 s; a plan with
every list given under 5 s. Exits 1 when a shipped preset misses its target.

``--process``: every shipped preset's dry run as a user runs it, ``python3 main.py search_config=<preset>
dry_run=true`` as a whole process (imports, Hydra, planning, plan.csv and the YAMLs written, the table printed),
with Python's bytecode cache as an installed package has it; first with an empty hp_tool cache (a fine-tuning
config read for the first time imports transformers' config classes, and torch with them), then every preset
again with the facts kept (hp_tool/hf_config.py ``cache_dir``). Target: every preset under 5 s. Exits 1 on a miss.

    python3 benchmarks/plan_speed.py
    python3 benchmarks/plan_speed.py --process
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from hp_tool.base_config import base_spec, choose_model, resolve_cluster
from hp_tool.candidates import Grid, plan_candidates
from hp_tool.cli import available_search_configs, compose
from hp_tool.config import to_app_config, training_precision
from hp_tool.errors import ConfigError
from hp_tool.plan_output import funnel_line, plan_csv_text, write_plan
from hp_tool.planner import make_plan, name_candidates, no_cycle_collection

TS = "search_config.train_settings"
EVERY_LIST = [f"{TS}.tensor_parallel_sizes=[1,2,4,8]", f"{TS}.pipeline_parallel_sizes=[1,2,4,8,16,32]",
              f"{TS}.virtual_pipeline_sizes=[1,2,3,4,6]", f"{TS}.micro_batch_sizes=[1,2,4,8]",
              f"{TS}.engines=[torch,deepspeed]", f"{TS}.zero_stages=[0,1,2,3]",
              f"{TS}.offload=[none,optimizer,optimizer_and_params]"]
LARGEST = ("gpt3/175b", "llama/llama3_70b", "t5/41b", "mt5/23b")
PRESET_TARGET_S = 2.0  # every shipped preset plans in under this
NEEDS_INPUT = ("custom", "unknown_size")  # presets that may need the user's input (a model, a size) to plan


def shipped_plans() -> bool:
    """Plan every shipped preset (analytic memory check); print its candidates and make_plan wall time against
    PRESET_TARGET_S. True when every preset that plans makes the target."""
    t0 = time.perf_counter()
    from transformers import AutoConfig  # what reading a Hugging Face config imports, once a process

    AutoConfig.for_model("llama")
    print(f"importing transformers' config classes (once per process, where a fine-tuning preset's Hugging Face "
          f"config is read for the first time): {time.perf_counter() - t0:.2f} s")
    ok = True
    for search in available_search_configs():
        cfg, name = compose([f"search_config={search}", "memory_check=analytic"])
        try:
            app = to_app_config(cfg)
            with tempfile.TemporaryDirectory() as tmp:
                t1 = time.perf_counter()
                plan = make_plan(app, name, Path(tmp) / name)
                seconds = time.perf_counter() - t1
        except ConfigError as exc:
            if search.rsplit("/", 1)[-1] not in NEEDS_INPUT:
                raise
            print(f"{search:28s} skipped: needs input ({str(exc).splitlines()[0][:100]})")
            continue
        miss = seconds >= PRESET_TARGET_S
        ok = ok and not miss
        print(f"{search:28s} {len(plan.candidates):6d} candidates {seconds:6.3f} s "
              f"(target < {PRESET_TARGET_S:g} s){'  MISSED' if miss else ''}")
    return ok


def every_list_plans() -> None:
    """The largest presets with every searched dimension listed explicitly."""
    for search in LARGEST:
        cfg, name = compose([f"search_config={search}", "memory_check=analytic", *EVERY_LIST])
        app = to_app_config(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            plan = make_plan(app, name, Path(tmp) / name)
            seconds = time.perf_counter() - t0
        print(f"{search}, every list given: {seconds:.3f} s (target < 5 s); {funnel_line(plan.candidates)}")


PROCESS_TARGET_S = 5.0  # every shipped preset's dry run as a whole process
MAIN = Path(__file__).resolve().parent.parent / "main.py"


def dry_run_seconds(search: str, tmp: Path, cache: Path) -> tuple[float, int]:
    """Wall time and exit code of ``python3 main.py search_config=<search> dry_run=true`` in a fresh process."""
    env = {**os.environ, "HP_TOOL_CACHE": str(cache)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package's modules are compiled once, not every run
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(MAIN), f"search_config={search}", "dry_run=true",
                           f"base_results_dir={tmp / 'results'}"], cwd=tmp, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, proc.returncode


def process_plans() -> int:
    """Every shipped preset's dry run as a whole process (see the module docstring)."""
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dry_run_seconds("gpt3/tiny", tmp, tmp / "warmup")  # compiles the modules' bytecode, as an install does
        cold, _ = dry_run_seconds("finetune/llama2_7b", tmp, tmp / "cold")
        print(f"finetune/llama2_7b, its config read for the first time (transformers and torch imported): "
              f"{cold:.2f} s")
        for search in available_search_configs():
            if search.rsplit("/", 1)[-1] in NEEDS_INPUT:
                continue
            dry_run_seconds(search, tmp, tmp / "cache")  # the facts of its config kept
            seconds, code = dry_run_seconds(search, tmp, tmp / "cache")
            miss = code != 0 or seconds >= PROCESS_TARGET_S
            ok = ok and not miss
            print(f"{search:28s} dry run {seconds:6.2f} s (target < {PROCESS_TARGET_S:g} s)"
                  f"{'' if code == 0 else f'  exit {code}'}{'  MISSED' if miss else ''}")
    return 0 if ok else 1


def main() -> int:
    if "--process" in sys.argv[1:]:
        return process_plans()
    presets_ok = shipped_plans()
    cfg, name = compose(["search_config=gpt3/175b"])
    app = to_app_config(cfg)
    ts = app.search_config.train_settings
    cluster = resolve_cluster(app)
    model = choose_model(app, cluster)
    layers = model.shape.num_layers
    gbs = base_spec(app, model, cluster).training.global_batch_size
    grid = Grid(lists=dict(tp=list(range(1, 9)), pp=[p for p in range(1, layers + 1) if layers % p == 0],
                           mbs=list(range(1, 17))), mp_range=(1, 1024), act_ckpt_step=1)

    t0 = time.perf_counter()
    with no_cycle_collection():  # as make_plan plans
        candidates = plan_candidates(model.shape, model.size_b, ts, cluster, gbs,
                                     model.recipe("full", training_precision(app)), grid)
        name_candidates(model, candidates)
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
    every_list_plans()
    if not presets_ok:
        print(f"a shipped preset planned in {PRESET_TARGET_S:g} s or more (see MISSED above)")
    return 0 if presets_ok else 1


if __name__ == "__main__":
    sys.exit(main())
