"""Builders for the results tests: a real gpt3/tiny plan on disk, and trial outputs written the way the
trial engine writes them (result.json with every contract field, metrics.jsonl one step per line).
No tests here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from hp_tool.cli import compose, results_dir
from hp_tool.config import AppConfig, to_app_config
from hp_tool.fsutil import atomic_write_json
from hp_tool.plan_output import write_plan
from hp_tool.planner import Plan, make_plan
from hp_tool.contracts.result import RESULT_FIELDS, throughput
from hp_tool.contracts.spec import load_spec


def planned(tmp_path: Path, *overrides: str) -> tuple[AppConfig, Path, Plan]:
    """Plan gpt3/tiny (plus overrides) with the real planner and write it under tmp_path."""
    cfg, name = compose(["search_config=gpt3/tiny", "cluster=local", f"base_results_dir={tmp_path / 'res'}",
                         *overrides])
    app = to_app_config(cfg)
    plan = make_plan(app, name, results_dir(app, name))
    write_plan(plan)
    return app, plan.results_dir, plan


def selected_ids(plan: Plan) -> list[str]:
    """Selected trial ids, predicted fastest first."""
    return [spec.trial_id for spec in plan.specs]


def trial_dir(out: Path, trial_id: str) -> Path:
    path = out / "training_logs" / trial_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_ok(out: Path, trial_id: str, step_time_s: float, peak_memory_gib: float = 1.0,
             steps: int = 8, peak_tensor_memory_gib: Optional[float] = None) -> dict:
    """An ok result.json as the engine writes it: throughput from the spec and the median step time.
    The mean is 15% above the median (one slow step), so a table built from the wrong statistic shows.
    ``peak_tensor_memory_gib``: the live tensors' peak the trial measured (None: not measured)."""
    spec = load_spec(out / "candidate_configs" / f"{trial_id}.yaml")
    world = spec.resources.num_nodes * spec.resources.gpus_per_node
    result = dict.fromkeys(RESULT_FIELDS)
    result.update(trial_id=trial_id, fingerprint=spec.fingerprint(), status="ok", reason=None,
                  stop_reason="max_steps", steps_run=steps, steps_measured=steps - 1,
                  step_time_s_median=step_time_s, step_time_s_mean=1.15 * step_time_s,
                  step_time_s_std=0.3 * step_time_s, peak_memory_gib=peak_memory_gib,
                  peak_tensor_memory_gib=peak_tensor_memory_gib, world_size=world,
                  device="cpu", backend="gloo", first_losses=[6.3, 6.2], final_loss=6.0,
                  versions={"python": "3"}, start_time="2025-01-01T00:00:00+00:00",
                  end_time="2025-01-01T00:01:00+00:00")
    result.update(throughput(spec, step_time_s, world))
    atomic_write_json(trial_dir(out, trial_id) / "result.json", result)
    return result


def write_failed(out: Path, trial_id: str, status: str = "oom", reason: str = "rank 0: OutOfMemoryError: x"):
    spec = load_spec(out / "candidate_configs" / f"{trial_id}.yaml")
    result = dict.fromkeys(RESULT_FIELDS)
    result.update(trial_id=trial_id, fingerprint=spec.fingerprint(), status=status, reason=reason, steps_run=0, steps_measured=0,
                  first_losses=[])
    atomic_write_json(trial_dir(out, trial_id) / "result.json", result)


def write_metrics(out: Path, trial_id: str, step_times: list[float], warmup: int = 1,
                  memory_gib: float = 0.5, start: float = 1000.0, torn_tail: bool = False,
                  interval_s: Optional[float] = None) -> Path:
    """metrics.jsonl as the engine appends it; ``torn_tail`` adds the half line a hard kill leaves."""
    lines, now = [], start
    for i, t in enumerate(step_times, start=1):
        now += interval_s if interval_s is not None else t
        lines.append(json.dumps({"step": i, "step_time_s": t, "loss": 6.0 - 0.01 * i, "lr": 1e-3,
                                 "tokens": 1024, "memory_gib": memory_gib + 0.01 * i, "timed": i > warmup,
                                 "time": now}))
    text = "\n".join(lines) + "\n" + ('{"step": 99, "step_ti' if torn_tail else "")
    path = trial_dir(out, trial_id) / "metrics.jsonl"
    path.write_text(text)
    return path


def test_a_specs_resources_carry_every_hardware_fact_the_collector_prices():
    """The planner's Hardware of a gpu preset, written into a spec's resources (ResourcesSpec.of) and read back
    by the collector (hardware()), is the same Hardware: all but the framework's memory overhead (memory estimates
    only) and whether the device is the host (the trial's own business), so a fact added to one is carried or fails
    here."""
    import dataclasses

    from hp_tool.base_config import resolve_cluster
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.contracts.spec import ResourcesSpec

    # presets whose optional facts differ: CPU processes (no fp8, host RAM as the device's), an H100 node (fp8, 614
    # GB/s of host memory), a g5.4xlarge's share of a host (16 threads)
    for gpu in ("cpu", "h100_80gb", "a10g_g5_4xlarge"):
        cfg, _ = compose(["search_config=gpt3/tiny", f"gpu={gpu}", "search_config.train_settings.precision=null"])
        hw = resolve_cluster(to_app_config(cfg)).hw
        back = ResourcesSpec.of(hw, 2, 1.5, gpu).hardware()
        assert back == dataclasses.replace(hw, memory_overhead_gib=0.0, device_is_host=False), gpu
