"""Process-group set-up for a trial: ranks from torchrun, submitit or srun; device; the (pp, dp, tp) mesh
(with expert parallelism (pp, edp, ep, tp), dp their flattening; with context parallelism (pp, dp, cp, tp),
dp_cp the flattening of dp and cp).

Ranks come from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun, and submitit after
``TorchDistributedEnvironment().export()``), else from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun).
With neither, the trial runs as a single process without a process group.

Collectives time out after ``HP_TOOL_TRIAL_COLLECTIVE_TIMEOUT_S`` seconds (default 300), so a rank that
died cannot leave the others waiting forever.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import subprocess
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from hp_tool.errors import require
from hp_tool.contracts.rendezvous import rendezvous_port
from hp_tool.contracts.spec import ParallelSpec

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_ENV = "HP_TOOL_TRIAL_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


@dataclass
class DistEnv:
    """Where this process sits: global rank, world size, local rank."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def read_env(environ: Optional[dict] = None) -> DistEnv:
    """This process's ranks from the torchrun variables, else SLURM's, else a single process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                       int(env.get("SLURM_LOCALID", 0)))
    return DistEnv()


def _export_slurm_rendezvous() -> None:
    """Under plain srun, point MASTER_ADDR/PORT at the job's first node (the port from the job id)."""
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, check=True).stdout.split()
        os.environ["MASTER_ADDR"] = hosts[0]
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(rendezvous_port(os.environ.get("SLURM_JOB_ID", "0")))


def select_device(env: DistEnv) -> torch.device:
    """cuda:<local rank> when a GPU is visible, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def collective_timeout_s() -> float:
    return float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S))


def init_distributed(env: DistEnv, device: torch.device, solo_group: bool = False) -> None:
    """Join the default process group (nccl on GPU, gloo on CPU). One process has none, unless ``solo_group``
    (the engine needs one to run this layout: FSDP2's CPU offload, DeepSpeed): then a group of one rank
    over an in-memory store, no rendezvous."""
    if dist.is_initialized() or (env.world_size == 1 and not solo_group):
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if env.world_size == 1:
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it as launchers set it
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        log.info("one process: joined a one-rank %s process group", backend)
        return
    if "RANK" not in os.environ:  # srun without torchrun: export what init_process_group reads
        _export_slurm_rendezvous()
        os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size),
                          LOCAL_RANK=str(env.local_rank))
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    log.info("rank %d/%d joined the %s process group", env.rank, env.world_size, backend)


def build_mesh(par: ParallelSpec, env: DistEnv, device: torch.device) -> Optional[DeviceMesh]:
    """The (pp, dp, tp) device mesh, TP innermost so a TP group shares a node; None for one process without
    a process group (one with a one-rank group gets a mesh of ones, e.g. for FSDP2's CPU offload).

    With expert parallelism the data-parallel ranks are a grid (edp, ep): an EP group (adjacent DP ranks)
    splits the experts between its members, and the ``edp`` ranks at the same EP position hold the same
    experts. ``dp`` is the grid flattened, so the data loader and the dense weights' data parallelism see
    the same DP ranks as without EP.

    With context parallelism the mesh is (pp, dp, cp, tp): the CP ranks of a replica (adjacent after TP) split
    its sequences, and hold the same weights, so the data-parallel wrappers shard and reduce over ``dp_cp``,
    dp and cp flattened (torchtitan's ``dp_shard_cp``; ``weight_dp_dim``), while the data loader splits the
    batch over ``dp`` only."""
    if env.world_size == 1 and not dist.is_initialized():
        return None
    world = par.pp * par.dp * par.cp * par.tp
    require(world == env.world_size, "parallel", f"pp={par.pp} dp={par.dp} cp={par.cp} tp={par.tp}",
            f"the degrees multiply to {world} but {env.world_size} processes were started",
            "launch pp*dp*cp*tp processes (e.g. torchrun --nproc-per-node)")
    if par.cp > 1:
        mesh = init_device_mesh(device.type, (par.pp, par.dp, par.cp, par.tp),
                                mesh_dim_names=("pp", "dp", "cp", "tp"))
        mesh["dp", "cp"]._flatten(DP_CP)
    elif par.ep == 1:
        return init_device_mesh(device.type, (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh(device.type, (par.pp, par.dp // par.ep, par.ep, par.tp),
                                mesh_dim_names=("pp", "edp", "ep", "tp"))
        mesh["edp", "ep"]._flatten("dp")
    # torch asks callers to keep a flattened mesh themselves (a future release may stop slicing it from the
    # root); every mesh user here slices mesh["dp"] or mesh["dp_cp"], which torch 2.13 still serves
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh


DP_CP = "dp_cp"  # the mesh dimension of dp and cp flattened (context parallelism)


def weight_dp_dim(par: ParallelSpec) -> str:
    """The mesh dimension whose ranks hold the same weights and average their gradients: ``dp``, or with
    context parallelism ``dp_cp`` (a CP rank is a data-parallel rank for everything but attention: its
    gradient is that of its own part of the sequences, and the mean over dp x cp ranks is the whole batch's)."""
    return DP_CP if par.cp > 1 else "dp"


def weight_dp_size(par: ParallelSpec) -> int:
    """How many ranks ``weight_dp_dim`` spans: dp x cp."""
    return par.dp * par.cp


def backend_name(env: DistEnv, device: torch.device) -> str:
    """The collective backend in use ("nccl", "gloo"), or "none" for a single process."""
    if env.world_size == 1:
        return "none"
    return "nccl" if device.type == "cuda" else "gloo"


def shutdown() -> None:
    """Leave the process group together: a rank tearing down gloo while a peer still uses it aborts."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def fake_group(world: int) -> None:
    """A fresh fake process group of ``world`` ranks (this process is rank 0), after forgetting what DTensor
    cached under the last one: its sharding propagation remembers output specs by mesh shape, and a
    remembered mesh names groups that died with the last layout's process group. So one process can trace
    any number of layouts in turn (memory_check's workers do)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's copy
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


@contextlib.contextmanager
def solo_or_fake_group(world: int, solo_group: bool):
    """For checking a build without running it: a fake process group of ``world`` ranks (this process rank 0),
    or none for one process that would run without one (``init_distributed``'s ``solo_group``)."""
    if world == 1 and not solo_group:
        yield
        return
    fake_group(world)
    try:
        yield
    finally:
        dist.destroy_process_group()
