"""Optimizer, learning-rate schedule and gradient clipping that hold under TP, FSDP and PP.

Parameters may be plain tensors (replicated), DTensors on the ``tp`` mesh, the ``dp`` mesh, or both.
Fused/foreach kernels need every tensor of one call on the same mesh, so AdamW gets one parameter group
per (mesh, weight decay) pair. The gradient norm is the norm of the whole model's gradient: DTensor norms
are reduced over their own mesh (``full_tensor``), replicated ones are counted once, and the squared
norms of the pipeline stages are summed over the ``pp`` group.

fp16 has too little range for small gradients, so an fp16 trial scales its loss (dynamic loss scaling,
torch's ``GradScaler`` rule): gradients are unscaled before clipping, a step whose gradients hold an inf
or NaN on any rank is skipped everywhere and the scale halved; after 2000 clean steps it doubles. bf16
keeps fp32's range and fp32 is fp32: neither scales.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from hp_tool.contracts.spec import TrainingSpec, TrialSpec


def lr_at(step: int, t: TrainingSpec) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, constant, cosine to min_lr."""
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if step < t.warmup_steps + t.constant_steps:
        return t.lr
    decay_steps = max(1, t.max_steps - t.warmup_steps - t.constant_steps)
    progress = min(1.0, (step - t.warmup_steps - t.constant_steps) / decay_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def _mesh_key(param: torch.Tensor) -> tuple:
    """Tensors on equal meshes share a key (DeviceMesh compares its ranks and dimension names without
    tensor ops, so this also works under fake tensors)."""
    if isinstance(param, DTensor):
        return (param.device_mesh,)
    return ()


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """One group per (mesh, decay); matrices decay, biases and norm weights do not."""
    groups: dict[tuple, list] = {}
    for param in module.parameters():
        if param.requires_grad:
            groups.setdefault((_mesh_key(param), param.ndim >= 2), []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0}
            for (_, decay), params in groups.items()]


def _kernel(device: torch.device, fused_ok: bool = True, host_offload: bool = False) -> dict:
    """The optimizer's implementation for tensors on ``device``: torch's fused kernel on the GPU and on the host of
    an offloaded GPU trial (``host_offload``), foreach elsewhere (a CPU trial's own optimizer). On the host the fused
    kernel is one vectorised pass per tensor, as DeepSpeed's CPU Adam: foreach AdamW there makes a parameter-sized
    temporary (a 7B model's 27 GB beside its 100 GiB of offloaded state) and steps 6x slower. A CPU trial keeps
    foreach: under its tensor tracker (a dispatch mode) the fused kernel with a loss scale fails on a shape."""
    fused = fused_ok and (device.type == "cuda" or host_offload)
    return {"fused": fused, "foreach": None if fused else True}


def host_step_threads(host_cpu_cores: Optional[float], gpus_per_node: int, visible: int) -> int:
    """Threads an offloaded GPU rank steps its optimizer on: its share of the node's host threads
    (``gpu.host_cpu_cores`` over its GPUs, as the step-time model's ``cpu_adam_params_per_s`` shares them), or of
    the ``visible`` cores where the preset names none; never more than the cores the process may run on (a
    scheduler's CPU binding), at least 1. torchrun and ``hp_tool.train`` start ranks with OMP_NUM_THREADS=1, which
    would step billions of offloaded parameters on one thread."""
    total = host_cpu_cores if host_cpu_cores else visible
    return max(1, min(visible, int(total // max(1, gpus_per_node))))


def use_host_threads(spec: TrialSpec, device: torch.device) -> None:
    """Give an offloaded GPU trial's host step its threads (``host_step_threads``); nothing elsewhere (a CPU
    trial's ranks share the machine's cores as launched)."""
    if spec.parallel.offload == "none" or device.type != "cuda":
        return
    visible = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(host_step_threads(spec.resources.host_cpu_cores, spec.resources.gpus_per_node, visible))


SGD_MOMENTUM = {"sgd": 0.0, "sgd_momentum": 0.9}


def _optimizer_class(t: TrainingSpec, device: torch.device, host_offload: bool = False) -> tuple[type, dict]:
    """The spec's optimizer: (class, keyword arguments besides the parameters, lr and weight decay)."""
    if t.optimizer in SGD_MOMENTUM:
        return torch.optim.SGD, {"momentum": SGD_MOMENTUM[t.optimizer], **_kernel(device, fused_ok=False)}
    if t.optimizer == "adamw_8bit":
        import bitsandbytes  # optional, CUDA only: the planner allows adamw_8bit only on a GPU preset

        return bitsandbytes.optim.AdamW8bit, {"betas": tuple(t.betas)}
    return torch.optim.AdamW, {"betas": tuple(t.betas), **_kernel(device, host_offload=host_offload)}


def _make_optimizer(groups: list[dict], t: TrainingSpec, device: torch.device,
                    host_offload: bool = False) -> torch.optim.Optimizer:
    """The spec's optimizer (AdamW unless it names another) over ``groups``."""
    cls, kwargs = _optimizer_class(t, device, host_offload)
    return cls(groups, lr=lr_at(0, t), weight_decay=t.weight_decay, **kwargs)


def build_optimizer(module: nn.Module, t: TrainingSpec, device: torch.device, zero_stage: int = 0,
                    dp_group: Optional[dist.ProcessGroup] = None, offload: str = "none") -> torch.optim.Optimizer:
    """AdamW over ``param_groups``: on the parameters' own device (the host when FSDP2 offloads them,
    ``optimizer_and_params``), on the host beside 16-bit weights on the GPU (``optimizer``:
    ``HostOffloadedOptimizer``), and at ZeRO stage 1 with more than one data-parallel rank sharded by
    ``ShardedAdamW``."""
    if zero_stage == 1 and dp_group is not None and dist.get_world_size(dp_group) > 1:
        return ShardedAdamW(module, t, device, dp_group)
    if offload == "optimizer":
        return HostOffloadedOptimizer(module, t, device)
    on_host = offload == "optimizer_and_params"
    host_offload = on_host and device.type == "cuda"  # a GPU trial's optimizer on its host
    return _make_optimizer(param_groups(module, t.weight_decay), t, torch.device("cpu") if on_host else device,
                           host_offload)


class HostOffloadedOptimizer(torch.optim.Optimizer):
    """The torch engine's optimizer offload (ZeRO-Offload's split over FSDP2): the GPU holds the weights and their
    gradients in the compute dtype, the host the fp32 master of each weight's local shard, its fp32 gradient, a
    compute-dtype staging copy and the optimizer's states, all allocated once here (pinned on a GPU's host, so
    the copies run at PCIe speed). A step copies each gradient down once (unscaled and clipped on the GPU
    before), steps the spec's optimizer on the masters on the host (its fused kernel, on the rank's host
    threads, ``use_host_threads``) and copies each updated master up once, in the compute dtype. Its
    ``param_groups`` are the GPU weights': the learning rate, clipping and the loss scaler act on them, and the
    host optimizer's groups take their learning rate and weight decay each step."""

    def __init__(self, module: nn.Module, t: TrainingSpec, device: torch.device):
        super().__init__(param_groups(module, t.weight_decay), {"lr": lr_at(0, t), "weight_decay": t.weight_decay})
        pin = device.type == "cuda"
        # (weight, its fp32 master, the master's gradient buffer, the compute-dtype staging copy)
        self._copies: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        host_groups = []
        for group in self.param_groups:
            masters = []
            for param in group["params"]:
                local = _local(param).detach()
                master = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
                master.copy_(local)
                grad = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
                staging = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
                self._copies.append((param, master, grad, staging))
                masters.append(master)
            host_groups.append({"params": masters, "weight_decay": group["weight_decay"]})
        self.host = _make_optimizer(host_groups, t, torch.device("cpu"), host_offload=pin)
        self._device = device

    @torch.no_grad()
    def step(self, closure=None):
        stepped = [copies for copies in self._copies if copies[0].grad is not None]
        for param, _, _, staging in stepped:  # gradients down, in the compute dtype
            staging.copy_(_local(param.grad), non_blocking=True)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        for param, master, grad, staging in self._copies:  # a weight without a gradient is not stepped
            master.grad = None if param.grad is None else grad.copy_(staging)
        for host_group, group in zip(self.host.param_groups, self.param_groups):
            host_group["lr"], host_group["weight_decay"] = group["lr"], group["weight_decay"]
        self.host.step()
        for param, master, _, staging in stepped:  # the updated weights up, in the compute dtype
            staging.copy_(master)
            _local(param).detach().copy_(staging, non_blocking=True)
        return None


class ShardedAdamW:
    """ZeRO-1 for the torch engine: torch's ``ZeroRedundancyOptimizer`` over the data-parallel group.

    Each rank keeps AdamW states for its share of the parameters only, steps them, and broadcasts the
    updated values to the other replicas. The parameters may be DTensors (replicated over ``dp`` by
    ``replicate``, sharded over ``tp``): ZeroRedundancyOptimizer works on their local tensors, which
    share storage with them, and receives their (already reduced and clipped) local gradients."""

    def __init__(self, module: nn.Module, t: TrainingSpec, device: torch.device, dp_group: dist.ProcessGroup):
        # imported here: torch.distributed.optim TorchScript-compiles its functional optimizers on import
        # (a second of start-up and a deprecation warning each), which only a ZeRO-1 trial needs
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.params = [p for p in module.parameters() if p.requires_grad]
        # the DTensor's own local tensor (a leaf sharing its storage; to_local() would return a view)
        self.local = {id(p): p._local_tensor if isinstance(p, DTensor) else p for p in self.params}
        groups = [{"params": [self.local[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
                  for g in param_groups(module, t.weight_decay)]
        cls, kwargs = _optimizer_class(t, device)
        self.zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls,
                                            process_group=dp_group, lr=lr_at(0, t),
                                            weight_decay=groups[0]["weight_decay"], **kwargs)
        for group in groups[1:]:
            self.zero.add_param_group(group)

    @property
    def param_groups(self) -> list[dict]:
        return self.zero.param_groups

    def attach_grads(self) -> None:
        """Give the local tensors the parameters' (local) gradients, which share their storage."""
        for p in self.params:
            self.local[id(p)].grad = None if p.grad is None else _local(p.grad)

    def step(self) -> None:
        self.attach_grads()
        self.zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
            self.local[id(p)].grad = None



def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sum_of_squares(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Global sum of squared entries of these (same-stage) gradients, as a plain fp32 tensor.

    Shards are summed locally and then reduced once per (mesh, sharded mesh dims) group over the mesh
    dimensions they are sharded on; replicated dimensions are not summed (counted once).
    """
    total = torch.zeros((), device=device, dtype=torch.float32)
    groups: dict[tuple, tuple] = {}
    for g in grads:
        if isinstance(g, DTensor):
            # Any placement that splits the tensor counts, including FSDP2's _StridedShard over TP
            # (its is_shard() is False): only replicated and partial dimensions are not summed.
            shard_dims = tuple(i for i, pl in enumerate(g.placements)
                               if not (pl.is_replicate() or pl.is_partial()))
            key = (_mesh_key(g), shard_dims)
            groups.setdefault(key, (g.device_mesh, shard_dims, []))[2].append(g.to_local())
        else:
            groups.setdefault((), (None, (), []))[2].append(g)
    for mesh, shard_dims, tensors in groups.values():
        squares = torch.stack(torch._foreach_norm(tensors, 2.0)).float().pow(2).sum().to(device)
        for dim in shard_dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total = total + squares
    return total


def clip_grad_norm(module: nn.Module, max_norm: float, pp_group: Optional[dist.ProcessGroup],
                   skip: frozenset = frozenset(), comm_device: Optional[torch.device] = None) -> torch.Tensor:
    """Scale gradients so the whole model's L2 norm is at most ``max_norm``; returns the norm before.

    ``skip`` holds ids of parameters held twice in the pipeline (a tied head): counted on one stage only.
    ``comm_device``: where the collectives run (the GPU when FSDP2 offloads the gradients to the host).
    """
    params = [p for p in module.parameters() if p.grad is not None]
    grad_device = _local(params[0].grad).device if params else torch.device("cpu")
    device = comm_device or grad_device
    total_sq = _sum_of_squares([p.grad for p in params if id(p) not in skip], device)
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total_norm = total_sq.sqrt()
    if max_norm > 0 and params:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).to(grad_device)
        # Scaling the local shards scales the DTensors; no per-parameter DTensor dispatch needed.
        torch._foreach_mul_([_local(p.grad) for p in params], coef)
    return total_norm


def loss_scaler(device: torch.device, compute_dtype: Optional[torch.dtype]) -> Optional[torch.amp.GradScaler]:
    """fp16's dynamic loss scaler for a trial computing in ``compute_dtype`` on ``device``; None for bf16
    and fp32, which need none.

    With a process group it is torch's ``ShardedGradScaler`` over the whole world: it all-reduces the
    overflow flag, so every data-parallel shard, tensor shard and pipeline stage skips the same steps
    (FSDP2's DTensor gradients unscale through DTensor's own op, as with the plain ``GradScaler``, which
    agrees only over each gradient's mesh and so not across pipeline stages)."""
    if compute_dtype != torch.float16:
        return None
    if dist.is_initialized():
        scaler = ShardedGradScaler(device.type, process_group=dist.group.WORLD)
    else:
        scaler = torch.amp.GradScaler(device.type)
    # The scale is created by the first scale(); a pipeline stage without the loss never calls it, yet
    # unscales and joins the overflow all-reduce like every rank.
    scaler.scale(torch.ones((), device=device))
    return scaler


def unscale_grads(optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler]) -> None:
    """Divide the gradients by the loss scale and note whether any is inf or NaN, before clipping reads
    them; nothing without a scaler."""
    if scaler is None:
        return
    if isinstance(optimizer, ShardedAdamW):  # its local tensors get their gradients only at step()
        optimizer.attach_grads()
    with implicit_replication():
        scaler.unscale_(optimizer)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler] = None) -> None:
    """One optimizer step; plain tensors met by DTensors count as replicated. With a loss scaler the step
    is skipped when the gradients overflowed, and the scale is updated (halved after a skip)."""
    with implicit_replication():
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    optimizer.zero_grad(set_to_none=True)


def sync_tied_grads(param: Optional[nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
    """Sum the gradients of a weight shared by the first and last pipeline stages (tied embedding)."""
    if param is None or group is None or param.grad is None:
        return
    if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
        # a vocab-parallel embedding's gradient comes back replicated: take this rank's rows, as the
        # head's gradient on the last stage holds them (a local slice, no communication)
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)
    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
    dist.all_reduce(grad, group=group)
