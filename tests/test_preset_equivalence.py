"""Shipped presets plan as the golden data says (tests/data/preset_equivalence.json, written by
tests/preset_snapshot.py from the planner it was generated with).

What this protects: a results folder written by an earlier version resumes, because every candidate keeps
its trial id and status and every selected trial its fingerprint (a changed fingerprint re-runs the trial);
and the pick stays: the same selected trials in the same rank order, with the same predicted memory, host
RAM, step time and throughput, the same trial sizes, the same over-limit trials and step times, and the same
reasons for the invalid ones. A planner change that means to change any of these regenerates the golden data
(``python3 tests/preset_snapshot.py --write``) and says why.

The presets are planned by tests/plan_cache.py: in a whole run, the plans the preset sweeps of
tests/test_config_surface.py and tests/test_engine_agreement.py made already.
"""

from __future__ import annotations

import json

import pytest

from preset_snapshot import GOLDEN, PRESETS, digest, snapshot, unpacked

pytestmark = pytest.mark.e2e  # plans every shipped preset

SHOWN = 8  # trial ids named per kind of difference


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _first(ids) -> str:
    ids = sorted(ids)
    return ", ".join(ids[:SHOWN]) + (f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else "")


def status_changes(now: list, then: list) -> list[str]:
    """Which trial ids appeared, disappeared or changed status between two [trial id, status] lists."""
    a, b = dict(now), dict(then)
    out = []
    if b.keys() - a.keys():
        out.append(f"no longer planned: {_first(b.keys() - a.keys())}")
    if a.keys() - b.keys():
        out.append(f"newly planned: {_first(a.keys() - b.keys())}")
    changed = [t for t in a.keys() & b.keys() if a[t] != b[t]]
    if changed:
        shown = sorted(changed)[:SHOWN]
        out.append(f"{len(changed)} changed status: " + ", ".join(f"{t} {b[t]} -> {a[t]}" for t in shown))
    return out or ["the same ids and statuses, but a trial id now appears a different number of times"]


def selected_changes(now: list, then: list) -> list[str]:
    """Field by field, how the selected trials (in rank order) differ."""
    out = [f"{len(now)} selected, golden {len(then)}"] if len(now) != len(then) else []
    for i, (a, b) in enumerate(zip(now, then), start=1):
        out += [f"rank {i} ({b['trial_id']}): {k} = {a.get(k)!r}, golden {b[k]!r}" for k in b if a.get(k) != b[k]]
    return out


def over_limit_changes(now: list, then: list) -> list[str]:
    a, b = dict(now), dict(then)
    out = [f"{k}: {_first(ids)}" for k, ids in (("no longer over the limit", b.keys() - a.keys()),
                                                  ("newly over the limit", a.keys() - b.keys())) if ids]
    out += [f"{t}: predicted_step_time_s = {a[t]!r}, golden {b[t]!r}" for t in sorted(a.keys() & b.keys())
            if a[t] != b[t]][:SHOWN]
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_plans_as_golden(preset: str, golden: dict) -> None:
    assert preset in golden, f"no golden data for {preset}: run python3 tests/preset_snapshot.py --write"
    then, now = unpacked(golden[preset]), snapshot(preset)
    problems = []
    if (now["candidates"], now["status_counts"]) != (then["candidates"], then["status_counts"]):
        problems.append(f"{now['candidates']} candidates {now['status_counts']}, golden {then['candidates']} "
                        f"{then['status_counts']}")
    if now["status_digest"] != then["status_digest"]:
        problems += ["(trial id, status) digest differs"] + status_changes(now["trial_statuses"],
                                                                           then["trial_statuses"])
    elif digest(then["trial_statuses"]) != then["status_digest"]:
        problems.append("the golden file's trial statuses do not match its digest: regenerate it")
    problems += selected_changes(now["selected"], then["selected"])
    if now["invalid_reason_digest"] != then["invalid_reason_digest"]:
        problems.append("the reasons given for invalid candidates changed (digest of (trial id, reason) differs)")
    problems += over_limit_changes(now["over_limit"], then["over_limit"])
    assert not problems, f"{preset} plans differently from the golden data:\n  " + "\n  ".join(problems[:40])
