"""What a Ray job of hp_tool runs on the cluster (hp_tool/launch/backends/ray_jobs.py submits it): the job's entry as
a Ray Train run, one ``TorchTrainer`` worker per trial process, the workers packed onto as few nodes as hold them
(Ray Train's placement group), the process group set up by Ray Train (gloo on CPU workers, nccl on GPU ones; it
exports RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT, which the trial engine reads as torchrun's).

    python3 -m hp_tool.launch.backends.ray_driver --entry hp_tool.launch.job:trial_job --workers 2 \\
        [--cpus-per-worker 1] [--gpus-per-worker 1] [--accelerator-type A100] CONFIG.yaml

Before it asks for the workers it compares what they need with what the cluster has in all (not what is free
now): a run that can never be placed prints ``UNSCHEDULABLE_MARK`` and the reason, and exits with
``UNSCHEDULABLE_EXIT`` (the backend reports the trial as ``unschedulable``), instead of waiting forever.
``--probe DIR`` instead writes a file into DIR and prints the cluster's resources as JSON after ``PROBE_MARK``: the
backend's preflight (the cluster answers and runs a job, the results folder is the same folder there; the resources
are for a user reading the probe's log).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Optional

UNSCHEDULABLE_MARK = "hp_tool-unschedulable:"
UNSCHEDULABLE_EXIT = 3
PROBE_MARK = "hp_tool-cluster-resources:"
PROBE_FILE = ".hp_tool_ray_probe"


def entry_of(name: str):
    """``module:function`` -> the function (a job's entry is a module-level function)."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def entry_name(entry) -> str:
    """The ``module:function`` that ``entry_of`` finds ``entry`` by."""
    return f"{entry.__module__}:{entry.__qualname__}"


def driver_command(entry: str, workers: int, need: dict[str, float], config: str, accelerator: Optional[str] = None,
                   name: Optional[str] = None, storage: Optional[str] = None) -> list[str]:
    """The command line of this driver: ``entry`` on ``config`` in ``workers`` workers of ``need`` each
    (``worker_resources``); the backend's jobs and the optimal config's Ray line both use it."""
    args = ["python3", "-m", "hp_tool.launch.backends.ray_driver", "--entry", entry, "--workers", str(workers),
            "--cpus-per-worker", f"{need.get('CPU', 1):g}", "--gpus-per-worker", f"{need.get('GPU', 0):g}"]
    for flag, value in (("--accelerator-type", accelerator), ("--name", name), ("--storage", storage)):
        if value:
            args += [flag, value]
    return args + [config]


def worker_resources(cpus: float, gpus: float, accelerator: Optional[str]) -> dict[str, float]:
    """What one worker asks of a node, as Ray names resources (an accelerator type is Ray's label resource)."""
    need = {"CPU": cpus, "GPU": gpus}
    if accelerator:
        need[f"accelerator_type:{accelerator}"] = 0.001
    return {k: v for k, v in need.items() if v}


def never_placed(workers: int, need: dict[str, float], total: dict[str, float]) -> Optional[str]:
    """Why ``workers`` workers of ``need`` each can never be placed on a cluster of ``total`` resources (summed over
    its nodes), or None when the cluster holds them."""
    for name, each in need.items():
        if name.startswith("accelerator_type:"):
            if name not in total:
                return (f"the trial's workers need {name.split(':', 1)[1]} GPUs (cluster.ray.accelerator_type) and no node "
                        "of the Ray cluster carries that label")
        elif total.get(name, 0.0) < workers * each:
            return (f"the trial's {workers} worker(s) need {workers * each:g} {name} and the Ray cluster has "
                    f"{total.get(name, 0.0):g} in all")
    return None


def _worker(config: dict) -> None:
    """One Ray Train worker: the job's entry on the config, the process group already joined."""
    entry_of(config["entry"])(config["config"])


def train(config: str, entry: str, workers: int, need: dict[str, float], name: str, storage: str) -> None:
    """Run ``entry`` on ``config`` in ``workers`` Ray Train workers."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    gpus = need.get("GPU", 0.0)
    scaling = ScalingConfig(num_workers=workers, use_gpu=gpus > 0, resources_per_worker=need,
                            placement_strategy="PACK")
    trainer = TorchTrainer(_worker, train_loop_config={"entry": entry, "config": config}, scaling_config=scaling,
                           torch_config=TorchConfig(backend="nccl" if gpus else "gloo"),
                           run_config=RunConfig(name=name, storage_path=storage,
                                                failure_config=FailureConfig(max_failures=0)))
    trainer.fit()


def probe(folder: str) -> None:
    """A probe file written into ``folder`` (where it exists); the cluster's resources printed after ``PROBE_MARK``
    (for a user reading the probe job's log)."""
    import ray

    ray.init()
    path = Path(folder)
    if path.is_dir():
        (path / PROBE_FILE).write_text(json.dumps({"from": "ray job"}))
    print(PROBE_MARK, json.dumps(ray.cluster_resources()), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?")
    p.add_argument("--entry", default="hp_tool.launch.job:trial_job")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    p.add_argument("--accelerator-type")
    p.add_argument("--name", default="hp_tool")
    p.add_argument("--storage", help="Ray Train's storage path (default: beside the config)")
    p.add_argument("--probe", metavar="DIR")
    args = p.parse_args(argv)
    if args.probe is not None:
        probe(args.probe)
        return 0
    if not args.config:
        p.error("give the config the entry reads")
    import ray

    ray.init()
    need = worker_resources(args.cpus_per_worker, args.gpus_per_worker, args.accelerator_type)
    why = never_placed(args.workers, need, ray.cluster_resources())
    if why is not None:
        print(UNSCHEDULABLE_MARK, why, flush=True)
        return UNSCHEDULABLE_EXIT
    storage = args.storage or str(Path(args.config).resolve().parent / "ray")
    train(args.config, args.entry, args.workers, need, args.name, storage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
