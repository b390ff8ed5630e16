"""Counts and ratios in words, for the sentences hp_tool prints and writes. Pure string building."""

from __future__ import annotations

from typing import Optional


def plural(n: float, noun: str, many: Optional[str] = None) -> str:
    """``n`` and the noun in the number it takes: "1 trial", "3 trials", "1 process", "2 processes"."""
    word = noun if n == 1 else (many or (noun + "es" if noun.endswith(("s", "sh", "x")) else noun + "s"))
    return f"{n:g} {word}" if isinstance(n, float) else f"{n} {word}"


def processes(n: int, on_host: bool, gpu: str = "GPU") -> str:
    """A run's ``n`` processes by what they run on: "2 CPU processes" where the device is the host (gpu=cpu),
    else "8 GPUs" (``gpu``: the noun, e.g. "a100_80gb GPU")."""
    return plural(n, "CPU process" if on_host else gpu)


def how_much(ratio: float, word: str) -> str:
    """A lead of ``ratio`` (>= 1: the better figure over the worse) in words: "12.0% faster" under 2x,
    "7.2x faster" from there (a percentage of several hundred reads as a typo)."""
    if ratio >= 2:
        return f"{ratio:.2g}x {word}" if ratio < 10 else f"{ratio:.0f}x {word}"
    return f"{100 * (ratio - 1):.1f}% {word}"
