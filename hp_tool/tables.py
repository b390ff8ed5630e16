"""Heuristic tables are data: rows of (upper bound on model size in billions, values).

One lookup serves every table. Each family's own tables live in its file (hp_tool/families/); the
family-neutral ones are here. Sources: NeMo's auto-configurator tables.
"""

from __future__ import annotations

from typing import Sequence, Tuple, TypeVar

V = TypeVar("V")
Table = Sequence[Tuple[float, V]]


def lookup(table: Table[V], size_b: float, inclusive: bool = False) -> V:
    """Values of the first row whose bound exceeds ``size_b`` (or equals it when ``inclusive``).

    Sizes above the last bound take the last row: the tables end at the largest sizes anyone trains.
    """
    for bound, values in table:
        if size_b < bound or (inclusive and size_b == bound):
            return values
    return table[-1][1]


def span(lo: int, hi: int) -> list[int]:
    """lo, lo + 1, ..., hi: a table's run of pipeline sizes."""
    return list(range(lo, hi + 1))


# Activation-checkpointing step (before dividing by PP), size < bound -> step
ACT_CKPT_STEP: Table[int] = [(1, 4), (11.3, 8), (60, 16), (float("inf"), 32)]
