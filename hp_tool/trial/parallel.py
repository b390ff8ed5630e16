"""Apply a spec's parallel layout to one pipeline stage: TP, then EP or CP, then activation checkpointing, then DP.

The order matters and follows torchtitan: tensor parallelism first (it replaces Linear weights by
DTensor shards on the ``tp`` mesh), then ``checkpoint_wrapper`` around the first ``act_ckpt_layers``
layers of the stage (whole, or under the per-op policy of ``act_ckpt_mode: selective``), then FSDP2 ``fully_shard`` (or FSDP2-style ``replicate`` for plain DDP) on the
``dp`` mesh, per layer and then for the whole stage. Everything happens on the meta device; the stage is
materialised afterwards, so each rank only ever allocates its own shard.

Tensor parallelism follows Megatron: q/k/v and the MLP's up (and gate) projections are split by
columns, the attention output and MLP down projections by rows, so each layer needs one all-reduce in
forward and one in backward; which modules those are in a family's layer is its record's
(``TorchFamily.layer_plan``, :mod:`hp_tool.trial.families`). The input embedding and the output head are split along the vocabulary
(vocab-parallel; the logits stay sharded into the loss); norms and learned positions are replicated.

Expert parallelism (a mixture of experts, ``parallel.ep`` > 1) splits each layer's experts by expert over
the ``ep`` mesh with transformers' own plan and all-to-all token dispatch (``apply_expert_parallel``). The
data-parallel ranks are then an (edp, ep) grid, ``dp`` its flattening (:func:`hp_tool.trial.dist.build_mesh`):
dense weights are replicated or sharded over all of ``dp`` as without EP, the experts, different on the
ranks of an EP group, over ``edp`` only, and their gradients completed after the step's backward
(``complete_expert_grads`` says why).

Context parallelism (``parallel.cp`` > 1) splits each sequence over the ``cp`` mesh and runs the layers'
attention as a ring over it (:mod:`hp_tool.trial.context_parallel`); its ranks hold the same weights, so DP
wraps the stage over ``dp_cp``, dp and cp flattened, as torchtitan's ``dp_shard_cp``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from hp_tool.contracts.spec import ParallelSpec
from hp_tool.errors import ConfigError, require
from hp_tool.trial.context_parallel import apply_context_parallel
from hp_tool.trial.dist import weight_dp_dim, weight_dp_size
from hp_tool.trial.families import TorchFamily, torch_family
from hp_tool.trial.models import loss_fn
from hp_tool.trial.selective_checkpoint import checkpointed
from hp_tool.trial.stage import StageModule

log = logging.getLogger(__name__)

def tp_styles(float8: bool) -> tuple[type, type]:
    """(column-wise, row-wise) parallel styles: torch's, or for Float8 linears torchao's own
    (``Float8ColwiseParallel`` and ``Float8RowwiseParallel`` cast a linear's input and its output's gradient to
    fp8 with their scales as its DTensors move), as torchtitan splits Float8 linears over TP. The sequence a
    sequence-parallel layer gathers is gathered in the compute dtype, as its collectives (gloo's among them) carry
    it; torchtitan gathers it in fp8 (``PrepareFloat8ModuleInput``), half the bytes on NCCL."""
    if not float8:
        return ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    return Float8ColwiseParallel, Float8RowwiseParallel


def layer_tp_plan(family: TorchFamily, layer: nn.Module, sequence_parallel: bool = False,
                  float8: bool = False) -> dict:
    """The ``parallelize_module`` plan of one layer of ``family``: its TP plan (``TorchFamily.layer_plan``),
    q/k/v-style projections by columns and output projections by rows; with ``sequence_parallel`` also its
    sequence plan (``TorchFamily.sequence_plan``): the row-split projections reduce-scatter their outputs to
    sequence shards, the sharded modules run on the shards, the gathered ones gather the sequence first. With
    ``float8`` (the layer's linears are torchao's Float8Linear) the styles are torchao's (``tp_styles``)."""
    colwise, rowwise = tp_styles(float8)
    shards = Shard(1) if sequence_parallel else None  # None: RowwiseParallel's all-reduce to a replica
    plan = {name: colwise() if style == "colwise" else rowwise(output_layouts=shards)
            for name, style in family.layer_plan(layer).items()}
    if not sequence_parallel:
        return plan
    sequence = family.sequence_plan
    require(sequence is not None, "parallel.sequence_parallel", True,
            f"the engine has no sequence-parallel plan for family {family.name}'s layers",
            "use sequence_parallel false")
    # the norms hand back their local shards: a norm whose output meets the residual (Gemma's after the attention and
    # the MLP) adds it to the shard the residual holds; the gathered modules take the shards as Shard(1)
    plan.update({name: SequenceParallel(use_local_output=True) for name in sequence.sharded})
    for name, keyword in sequence.gathered.items():
        plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)) \
            if keyword is None else PrepareModuleInput(input_kwarg_layouts={keyword: Shard(1)},
                                                       desired_input_kwarg_layouts={keyword: Replicate()})
    return plan


def apply_tensor_parallel(stage: StageModule, tp_mesh: DeviceMesh, vocab_parallel: bool = True,
                          sequence_parallel: bool = False, float8: bool = False) -> None:
    """Shard each layer's projections over ``tp_mesh`` with ``parallelize_module`` (the family's plans,
    ``layer_tp_plan``); with ``vocab_parallel``, also the input embedding and the output head along the
    vocabulary.

    Vocab-parallel: the embedding's rows are split (each rank looks up the ids it holds, one all-reduce
    joins them) and the head's output columns, so each rank computes logits for its slice of the
    vocabulary only; the loss is then computed on the sharded logits (models.make_loss_fn, inside
    ``loss_parallel``). A tied head shares the embedding's vocabulary-sharded weight."""
    tp, family = tp_mesh.size(), torch_family(stage.family)  # the spec's rules admit sequence_parallel here
    for layer in stage.layers.values():
        parallelize_module(layer, tp_mesh, layer_tp_plan(family, layer, sequence_parallel, float8))
        family.shard_heads(layer, tp)
    if not vocab_parallel:
        return
    between = Shard(1) if sequence_parallel else Replicate()  # the hidden states between the layers
    if stage.is_first:
        parallelize_module(stage.embed_tokens, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=between))
    if sequence_parallel and stage.norm is not None:
        parallelize_module(stage.norm, tp_mesh, SequenceParallel())
    if stage.is_last:
        parallelize_module(stage.lm_head, tp_mesh,
                           ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=True))
    stage.retie()  # both are Shard(0) of the same [vocab, hidden] matrix, so one tensor serves both


EP_DISPATCH = "ep_dispatch_experts"  # the style of an expert plan's module that receives the routed tokens
EP_IMPLEMENTATION = "all_to_all"  # training: tokens go to their experts' ranks and come back (AllToAllEP)


def apply_expert_parallel(stage: StageModule, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
    """Split each layer's experts over ``ep_mesh`` with transformers' expert-parallel plan (the family's
    ``expert_plan``): the 3-D expert tensors become DTensors ``Shard(0)`` (each rank holds E / EP whole
    experts; the weight initialisation fills its slice of the layout-independent full tensor), and the
    experts module sends each (token, expert) pair to the expert's rank and the results back with two
    all-to-alls, whose backward carries every token's gradient back to its rank. ``tp_mesh`` (size 1 here):
    the ranks that share one batch."""
    plan = torch_family(stage.family).expert_plan
    require(plan is not None, "parallel.ep", ep_mesh.size(), f"family {stage.family} has no experts to split",
            "use ep 1")
    try:  # transformers 5's expert parallelism; dense layouts need none of it
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError as exc:
        raise ConfigError("parallel.ep", ep_mesh.size(), f"this transformers has no expert parallelism ({exc})",
                          'pip install -U "transformers>=5" (its transformers.distributed.expert_parallel), '
                          "or use ep 1") from exc
    for layer in stage.layers.values():
        apply_expert_parallelism(layer, ep_mesh, tp_mesh, plan, ep_implementation=EP_IMPLEMENTATION)


def expert_modules(stage: nn.Module) -> list[nn.Module]:
    """The modules holding a stage's (or an interleaved rank's) split experts: each layer's module the family's
    expert plan dispatches tokens to, found by name through checkpoint wrappers; none for a dense family."""
    plan = torch_family(stage.family).expert_plan or {}
    names = tuple(f".{name}" for name, style in plan.items() if style == EP_DISPATCH)
    return [module for name, module in stage.named_modules() if names and name.endswith(names)]


@torch.no_grad()
def complete_expert_grads(stage: nn.Module, ep: int, tp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Make the experts' gradients the single-process ones once the step's backward has run: the mean over
    the global batch, as for every dense weight.

    A dense weight's gradient on a rank is that of its own tokens' loss (a mean over its micro-batches),
    and data parallelism averages it over the DP ranks. An expert lives on one rank of each EP group, and the
    all-to-all's backward brings it the gradients of the tokens all EP peers routed to it, each peer's
    loss a mean over that peer's tokens: the sum of the EP peers' gradients. Averaged over the ``edp`` ranks
    that hold the same expert (its data-parallel wrapper), it is EP times the mean over the DP ranks: divided
    by EP here. With TP (``tp_group``) each rank of a TP group dispatches its own slice of the tokens the
    group shares, so the whole experts each TP rank holds got a part of the gradient: summed over TP first."""
    if ep == 1:
        return
    for experts in expert_modules(stage):
        for param in experts.parameters():
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if tp_group is not None:
                dist.all_reduce(grad, group=tp_group)
            grad.div_(ep)


def apply_activation_checkpointing(stage: StageModule, num_layers: int, mode: str = "full") -> None:
    """Recompute the activations of the first ``num_layers`` layers of this stage in backward: whole layers
    (``full``), or under torchtitan's per-op policy (``selective``, :mod:`hp_tool.trial.selective_checkpoint`)."""
    for key in stage.checkpoint_keys(num_layers):
        stage.layers[key] = checkpointed(stage.layers[key], mode)


def apply_data_parallel(stage: StageModule, dp_mesh: DeviceMesh, zero_stage: int, offload: str,
                        param_dtype: Optional[torch.dtype], device: torch.device,
                        expert_mesh: Optional[DeviceMesh] = None, master_weights: str = "fp32") -> None:
    """Data parallelism over ``dp_mesh`` for a ZeRO stage: 0 and 1 replicate the stage (DDP; stage 1
    shards the optimizer, optim.ShardedAdamW), 2 = FSDP2 without resharding after forward, 3 = FSDP2
    full shard. Offload (stages 2-3): FSDP2's CPUOffloadPolicy keeps the sharded parameters, their
    gradients and so the optimizer step on the host (pinned buffers with a GPU).

    ``param_dtype`` (bf16 on GPU) makes FSDP gather and compute in that dtype while the optimizer keeps
    fp32 master weights; gradients are reduced in fp32, and in the parameters' bf16 with ``master_weights`` bf16
    (no fp32 copy of anything, as torchtune's bf16 recipes reduce).

    ``expert_mesh`` (with expert parallelism): the ``edp`` ranks holding the same experts. Each layer's
    experts are wrapped first, over it, so the dense wrappers skip them: their gradients must not be
    reduced over ``dp``, whose ranks hold different experts (``complete_expert_grads`` completes them).
    """
    # OPT's layer returns a view; harmless here because the stage never modifies a layer output in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                              reduce_dtype=torch.float32 if master_weights == "fp32" else param_dtype)
    experts = expert_modules(stage) if expert_mesh is not None else []
    if zero_stage <= 1:
        for module in experts:
            replicate(module, mesh=expert_mesh, mp_policy=mp)
        # a frozen base (LoRA, QLoRA's 4-bit weights) stays plain tensors: identical on every replica, never
        # reduced, and computed on as held, without the unsharded compute-dtype copy replicate keeps of its own
        frozen = {p for p in stage.parameters() if not p.requires_grad}
        replicate(stage, mesh=dp_mesh, mp_policy=mp, ignored_params=frozen or None)
        return
    extra = {}
    if offload == "optimizer_and_params":  # the optimizer's offload alone is the optimizer's (optim.py)
        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    reshard = zero_stage >= 3
    for module in experts:
        fully_shard(module, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp, **extra)
    for module in stage.bias_modules():  # called outside its layer's forward: its own unit
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, **extra)
    for layer in stage.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, **extra)
    # The root unit holds embeddings, final norm and head; the last unit is used right after forward.
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp, **extra)


def compile_layers(stage: StageModule) -> None:
    """Each transformer layer under torch.compile, after checkpointing and before FSDP2, as torchtitan compiles its
    blocks: the layer wrapped (``torch.compile``'s module, whose ``_orig_mod.`` prefix ``stage.canonical_name``
    drops), so FSDP2's hooks run around the compiled call (a module compiled in place, ``nn.Module.compile``, runs
    eager once FSDP2 wraps it). The layers share one compiled graph (the same code); the first step compiles it
    (a warm-up step, untimed)."""
    for key, layer in list(stage.layers.items()):
        stage.layers[key] = torch.compile(layer)


def parallelize_stage(stage: StageModule, par: ParallelSpec, mesh: Optional[DeviceMesh],
                      param_dtype: Optional[torch.dtype], device: torch.device, fp8: bool = False) -> None:
    """Apply TP, EP, CP, activation checkpointing, torch.compile and DP to ``stage`` in place (still on meta).
    With CP the data parallelism spans dp x cp (``dist.weight_dp_dim``). ``fp8``: the layers' linears are Float8
    (hp_tool/trial/converters.py), split over TP by torchao's styles."""
    if par.tp > 1:
        apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=par.sequence_parallel, float8=fp8)
    if par.ep > 1:
        apply_expert_parallel(stage, mesh["ep"], mesh["tp"])
    if par.cp > 1:
        attention = torch_family(stage.family).attention
        require(attention is not None, "parallel.cp", par.cp,
                f"family {stage.family}'s attention is not split over context-parallel ranks", "use cp 1")
        apply_context_parallel(stage, mesh["cp"], attention)
    if par.act_ckpt_layers > 0:
        apply_activation_checkpointing(stage, par.act_ckpt_layers, par.act_ckpt_mode)
    if par.compile:
        compile_layers(stage)
    if weight_dp_size(par) > 1 or par.offload != "none":  # FSDP2 on one data-parallel rank still offloads
        apply_data_parallel(stage, mesh[weight_dp_dim(par)], par.zero_stage, par.offload, param_dtype, device,
                            expert_mesh=mesh["edp"] if par.ep > 1 else None, master_weights=par.master_weights)


def build_schedule(chunks: list[StageModule], par: ParallelSpec, mesh: DeviceMesh, pp_rank: int,
                   n_microbatches: int, device: torch.device, loss_fn=loss_fn):
    """The pipeline schedule driving this rank's stage modules over the ``pp`` mesh: 1F1B (or GPipe) for
    one stage, interleaved 1F1B for ``par.virtual_stages`` chunks (chunk k is virtual stage
    pp_rank + k·PP)."""
    group, total = mesh["pp"].get_group(), par.pp * len(chunks)
    stages = [PipelineStage(chunk, pp_rank + k * par.pp, total, device, group=group)
              for k, chunk in enumerate(chunks)]
    # scale_grads divides by the micro-batch count: gradients are the mean over micro-batches, as
    # with plain gradient accumulation.
    if len(stages) > 1:
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    schedule_cls = Schedule1F1B if par.pipeline_schedule == "1F1B" else ScheduleGPipe
    if schedule_cls is Schedule1F1B and n_microbatches < par.pp:
        log.warning("1F1B needs at least pp=%d micro-batches per step, the spec gives %d; using GPipe",
                    par.pp, n_microbatches)
        schedule_cls = ScheduleGPipe
    return schedule_cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def needs_grad_sync_control(par: ParallelSpec) -> bool:
    """Whether to skip DP gradient reduction on all but the last micro-batch (DDP's no_sync)."""
    return weight_dp_size(par) > 1 and par.pp == 1 and par.zero_stage <= 1


def set_grad_sync(stage: nn.Module, enabled: bool) -> None:
    """Turn DP gradient reduction on or off for the next backward (FSDP2 and replicate modules)."""
    setter = getattr(stage, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)
