"""Build DeepSpeed's C++ ops ahead of the trials: CPU Adam (offloaded optimizer steps) and, on a machine
without a GPU, the shared-memory communication op DeepSpeed builds in its first ``initialize``.

    python3 -m hp_tool.trial.ds_ops

DeepSpeed compiles the op with the machine's C++ compiler on first use (minutes) and caches it under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions); a trial that had to build it would spend its
time box compiling. Run this once per environment (or install DeepSpeed with DS_BUILD_CPU_ADAM=1).
"""

from __future__ import annotations

import sys
import time


def build_cpu_adam() -> float:
    """Build (or load the cached) CPU Adam op; returns the seconds it took."""
    from deepspeed.ops.op_builder import CPUAdamBuilder  # DeepSpeed is optional: imported only to build its ops

    start = time.monotonic()
    CPUAdamBuilder().load()
    return time.monotonic() - start


def build_shm_comm() -> float:
    """Build (or load) the op DeepSpeed's CPU accelerator loads when it sets up communication."""
    from deepspeed.accelerator import get_accelerator  # DeepSpeed is optional: imported only to build its ops

    start = time.monotonic()
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and get_accelerator().device_name() == "cpu":
        builder.load()
    return time.monotonic() - start


def main() -> int:
    print(f"DeepSpeed CPU Adam ready in {build_cpu_adam():.1f} s", flush=True)
    print(f"DeepSpeed shared-memory comm op ready in {build_shm_comm():.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
