"""What planning a shipped preset decides, in a form two versions of the planner can be compared by: the
candidate count and statuses, the selected trials in rank order with their predictions and fingerprints,
digests of every candidate's (trial id, status) and of the invalid ones' reasons, and the over-limit trials'
predicted step times. Each preset is planned as the CLI plans it (``memory_check=analytic``), nothing written,
by tests/plan_cache.py (which this script imports from its own folder).

    python3 tests/preset_snapshot.py --write   # regenerate tests/data/preset_equivalence.json

The golden file is generated from a pristine checkout of the planner being compared against, e.g.
``git worktree add /tmp/base <commit> && cd /tmp/base && PYTHONPATH=/tmp/base python3
<this checkout>/tests/preset_snapshot.py --write``: the ``hp_tool`` it plans with is the one imported.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import lzma
import time
from collections import Counter
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent / "data" / "preset_equivalence.json"
PRESETS = ("gpt3/5b", "gpt3/175b", "llama/llama3_8b_128k", "t5/11b", "moe/mixtral_8x7b", "finetune/llama2_7b",
           "finetune/llama3_8b_32k", "finetune/mixtral_8x7b", "finetune/tiny")
# plan.csv columns recorded for each selected trial, in rank order
SELECTED_COLUMNS = ("trial_id", "predicted_rank", "predicted_memory_gib", "predicted_full_memory_gib",
                    "predicted_host_memory_gib", "predicted_step_time_s", "predicted_tokens_per_s_per_gpu",
                    "fingerprint", "trial_num_nodes", "trial_dp", "trial_global_batch_size")


def sig6(x: Any) -> Any:
    """A float to 6 significant digits (anything else as it is)."""
    return float(f"{x:.6g}") if isinstance(x, float) else x


def digest(pairs: list) -> str:
    """SHA-256 of the sorted (name, value) pairs, one tab-separated pair a line."""
    return hashlib.sha256("\n".join(f"{a}\t{b}" for a, b in sorted(pairs)).encode()).hexdigest()


def pack(pairs: list) -> str:
    """(trial id, value) pairs, sorted, as lzma-compressed base64 text; ``unpack`` reads them back."""
    text = "\n".join(f"{a}\t{b}" for a, b in sorted(pairs))
    return base64.b64encode(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME)).decode()


def unpack(packed: str, value=str) -> list:
    """``pack``'s pairs as [trial id, value(text)] lists."""
    text = lzma.decompress(base64.b64decode(packed)).decode()
    return [[a, value(b)] for a, b in (line.split("\t") for line in text.splitlines())]


def plan_preset_rows(name: str) -> list[dict[str, Any]]:
    """plan.csv's rows of the preset, planned as the CLI plans it with the analytic memory check (the plan of
    tests/plan_cache.py: in a test session, the one the other preset sweeps read too)."""
    from hp_tool.plan_output import plan_rows
    from plan_cache import plan

    return list(plan_rows(plan(name, "memory_check=analytic")))


def snapshot(name: str) -> dict[str, Any]:
    """What the planner decides for the preset (see the module docstring)."""
    rows = plan_preset_rows(name)
    statuses = [(r["trial_id"], r["plan_status"]) for r in rows]
    selected = sorted((r for r in rows if r["plan_status"] == "selected"), key=lambda r: r["predicted_rank"])
    return {
        "candidates": len(rows),
        "status_counts": dict(sorted(Counter(s for _, s in statuses).items())),
        "selected": [{k: sig6(r[k]) for k in SELECTED_COLUMNS} for r in selected],
        "status_digest": digest(statuses),
        "invalid_reason_digest": digest([(r["trial_id"], r["reason"]) for r in rows
                                         if r["plan_status"] == "invalid"]),
        "over_limit": sorted([r["trial_id"], sig6(r["predicted_step_time_s"])] for r in rows
                             if r["plan_status"] == "over_limit"),
        "trial_statuses": sorted([trial_id, status] for trial_id, status in statuses),
    }


# the long lists, kept compressed in the golden file: key -> the type of their values
PACKED = {"over_limit": float, "trial_statuses": str}


def packed(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot as the golden file keeps it: its long lists ``pack``ed."""
    return {k: pack(v) if k in PACKED else v for k, v in snap.items()}


def unpacked(golden: dict[str, Any]) -> dict[str, Any]:
    """A golden file's snapshot as ``snapshot`` returns it."""
    return {k: unpack(v, PACKED[k]) if k in PACKED else v for k, v in golden.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the snapshots to {GOLDEN}")
    parser.add_argument("--out", type=Path, default=GOLDEN, help="where --write writes them")
    args = parser.parse_args()
    import hp_tool

    print(f"planning with {Path(hp_tool.__file__).parent}")
    out = {}
    for name in PRESETS:
        t0 = time.perf_counter()
        out[name] = packed(snapshot(name))
        print(f"{name}: {out[name]['candidates']} candidates {out[name]['status_counts']} "
              f"in {time.perf_counter() - t0:.2f} s")
    if args.write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out} ({args.out.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
