"""The benchmark scripts as modules for the tests that check them (``benchmarks/`` is no package)."""

import functools
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@functools.lru_cache(maxsize=None)
def benchmark(name: str):
    """benchmarks/<name>.py as a module, loaded once."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module
