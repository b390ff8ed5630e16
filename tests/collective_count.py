"""A trial's ranks with their gradient reduce-scatters counted: ``main(argv)`` runs ``hp_tool.trial.train.main``
on ``argv[1:]`` with torch.distributed's reduce-scatter entry points (those FSDP2 reduces gradients through)
wrapped, and writes how many calls the rank made to ``<argv[0]>.<rank>``."""

from __future__ import annotations

import os
from pathlib import Path

NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from hp_tool.trial import train

    calls = [0]
    for name in NAMES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, **kwargs):
            calls[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        return train.main(argv[1:])
    finally:
        Path(f"{argv[0]}.{os.environ.get('RANK', '0')}").write_text(str(calls[0]))
