"""What the published-run benchmarks share (published_finetune_runs.py, published_serving_runs.py): reading a
data file's rows and their values, and the exception a row hp_tool cannot ask raises."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any


class Unexpressible(Exception):
    """A row hp_tool cannot ask: ``kind`` groups the rows in the summary, ``detail`` says what of this one."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.detail = kind, detail


def value(x: Any) -> Any:
    """A field's value: the rows write inferred values as {"value": ..., "inferred": true, "from": ...}."""
    return x.get("value") if isinstance(x, dict) and "value" in x else x


def rows_of(path: Path) -> list[dict]:
    """The ``rows`` of a published-runs data file."""
    return json.loads(Path(path).read_text())["rows"]


def print_unexpressible(unexpressible: list[tuple[str, str, str, str]], shown: int = 6) -> None:
    """The rows hp_tool cannot ask, (id, source, kind, detail) each, grouped by kind with their commonest details."""
    print(f"\nNot expressible: {len(unexpressible)} rows\n")
    by_kind = Counter(kind for _, _, kind, _ in unexpressible)
    for kind, n in sorted(by_kind.items(), key=lambda kv: (-kv[1], kv[0])):
        details = Counter(d for _, _, k, d in unexpressible if k == kind and d)
        text = "; ".join(f"{d} x{c}" for d, c in details.most_common(shown))
        more = "; ..." if len(details) > shown else ""
        print(f"- {kind}: {n} rows" + (f" ({text}{more})" if details else ""))
