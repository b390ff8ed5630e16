"""DeepSpeed's C++ ops built once by the orchestrator, before the first trial that runs DeepSpeed.

DeepSpeed compiles CPU Adam (offloaded optimizer steps) and, without a GPU, its shared-memory
communication op on first use: minutes on a small machine. A trial that had to compile them would spend
its time box compiling, so the search builds them first (``python3 -m hp_tool.trial.ds_ops`` in a child
process: the orchestrator never imports torch), into DeepSpeed's cache (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions) that the trials load from. On a cluster the cache must be on a file system the
compute nodes share, with the same software as the login node (or build it inside the container image).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import Iterable

from hp_tool.contracts.spec import TrialSpec
from hp_tool.engine_facts import engine_facts
from hp_tool.errors import ConfigError

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 1800
ENGINES_KEY = "search_config.train_settings.engines"


def needs_deepspeed_ops(specs: Iterable[TrialSpec]) -> bool:
    """True when any trial runs an engine whose C++ ops are built before its first trial (DeepSpeed's)."""
    return any(engine_facts(s.parallel.engine).builds_ops for s in specs)


def build_deepspeed_ops(python: str = sys.executable, timeout_s: float = BUILD_TIMEOUT_S) -> float:
    """Build (or load the cached) DeepSpeed ops in a child process; returns the seconds it took.
    A failed build is a ConfigError naming the engines key, before any trial is submitted."""
    log.info("Building DeepSpeed's C++ ops before the first DeepSpeed trial (minutes the first time, "
             "seconds once cached)")
    start = time.monotonic()
    try:
        out = subprocess.run([python, "-m", "hp_tool.trial.ds_ops"], capture_output=True, text=True,
                             timeout=timeout_s)
        ok, tail = out.returncode == 0, " | ".join((out.stdout + out.stderr).strip().splitlines()[-2:])[-400:]
    except subprocess.TimeoutExpired:
        ok, tail = False, f"the build did not finish within {timeout_s:.0f} s"
    if not ok:
        raise ConfigError(ENGINES_KEY, ["deepspeed"], f"DeepSpeed's C++ ops did not build on this machine "
                          f"(python3 -m hp_tool.trial.ds_ops): {tail.strip()}",
                          "install a C++ compiler and the Python headers (g++, python3-dev) and run "
                          "`python3 -m hp_tool.trial.ds_ops`, or search without DeepSpeed: "
                          f"{ENGINES_KEY}=[torch]")
    seconds = time.monotonic() - start
    log.info("DeepSpeed's ops are ready (%.0f s)", seconds)
    return seconds
