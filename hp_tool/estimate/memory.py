"""Analytic peak memory per GPU for one training layout. Pure arithmetic, no torch.

Model states: mixed-precision Adam, 16 bytes per parameter (DeepSpeed: 2 weights, 2 gradients, 12 fp32
master and Adam moments; the torch engine: 4 fp32 weights that are the master, 4 gradients, 8 moments),
each part divided over the data-parallel ranks from the ZeRO stage that shards it (Rajbhandari et al.
2020), and moved to host RAM when offloaded; plus the compute-dtype copy of the weights that forward makes
and backward reads (``compute_copy_bytes``). Activations per layer: GPT from Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2, without dropout masks (the trial
engine's models run without dropout; LoRA's adapters' dropout: families/methods.py); Llama (GQA, SwiGLU,
RMSNorm, RoPE) and T5 derived tensor by tensor for the engine's modules. Each term is checked against the
traced engine (tests/test_memory_check.py, benchmarks/memory_terms.py). A checkpointed layer keeps its input
and, checkpointed selectively, the outputs the per-op policy keeps (``selective_kept_bytes``); one layer's
recompute runs in backward, once the loss has freed its logits. Pipeline: 1F1B keeps up to PP micro-batches
in flight on the first stage.
Logits (``logits_bytes``): the whole-logits loss holds the logits, their log-softmax and gradient (as traced);
the chunked loss one chunk's logits and the gradients it computes in forward (hp_tool/trial/loss.py).

Long context: context parallelism gives each rank seq / CP tokens of every sequence (``rank_shape``) and
ZeRO shards over DP x CP ranks (``Layout.zero_ranks``); sequence parallelism divides the norms' and a
checkpointed layer's input by TP (the family's activation formula); activation offload keeps the tensors
saved for backward in host RAM, leaving one sub-layer's working set on the GPU (``working_layer_bytes``) and
the rest in the node's RAM (``offloaded_activation_bytes``).

The trial engine shards the transformer layers across TP ranks, and the input embedding, the output head
and so the logits along the vocabulary (vocab-parallel); learned positions and norms stay whole. The
estimate counts them the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hp_tool.architectures import (Shape, checkpointed_layer_counts, count_parameters, expert_parameters,
                                   layer_parameters, selective_kept_matmuls, stage_expert_parameters,
                                   stage_layer_counts, stage_layer_parameters, vocab_parallel_parameters)
from hp_tool.estimate.layout import (GIB, PART_OF, Hardware, Layout, interleave_held_tensors,
                                     microbatches_in_flight, rank_shape, ring_tile_rows)
from hp_tool.engine_facts import engine_facts
from hp_tool.recipe import Adapters
from hp_tool.sharding import master_on_host
from hp_tool.families.methods import (NF4_BITS, activation_delta_bytes, adapter_parameters_per_layer,
                                      linear_parameters_per_layer, linear_shapes)
from hp_tool.families.registry import LayerAt

MODEL_STATE_BYTES = 16  # 2 (16-bit weights) + 2 (16-bit grads) + 12 (fp32 master, Adam m, v)
# Optimizer states per trainable parameter beyond the fp32 master (REFERENCE §13): Adam's m and v in fp32 (8),
# none for SGD without momentum, the momentum buffer (4), bitsandbytes' 8-bit m and v (2, block scales aside).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 0, "sgd_momentum": 4, "adamw_8bit": 2}
CHECKPOINT_GATHER_BYTES = 4  # per parameter of the whole model: a full fp32 checkpoint gathered on rank 0
# a published model is gathered in its 16-bit dtype to be written (hp_tool/trial/checkpoint.py)
PRETRAINED_GATHER_BYTES = 2
# Loading a checkpoint (meta-device init, then tensor by tensor): a process holds one full tensor as stored
# (16-bit) and as the fp32 value its shard is cut from, 2 + 4 bytes per element of the largest tensor.
LOAD_COPY_BYTES = 6
HOST_PROCESS_OVERHEAD_GIB = 3.0  # host RAM of one training process (torch, CUDA libraries, data); calibrate


# The planner asks the model's own terms (and those of a few integers) for every candidate: cached by their
# arguments (shapes, layouts and hardware are frozen).
cached = functools.lru_cache(maxsize=4096)


@cached
def layer_parameter_counts(shape: Shape) -> tuple[int, int, int]:
    """(one decoder-stack layer's parameters, an encoder layer's, one layer's routed experts')."""
    return layer_parameters(shape), layer_parameters(shape, encoder=True), expert_parameters(shape)


model_parameters = cached(count_parameters)
adapter_parameters = cached(adapter_parameters_per_layer)
linear_parameters = cached(linear_parameters_per_layer)


def layer_activation_bytes(shape: Shape, layout: Layout, hw: Hardware, encoder: bool = False) -> float:
    """One layer's stored activations for the family (an encoder layer when ``encoder``), one micro-batch,
    bytes; with an adapter method what it changes (``methods.activation_delta_bytes``: dropout's mask is a
    byte an element on a GPU, a value of the input's dtype on a CPU); with fused norms (a stack's,
    ``Hardware.fused_norms``, or torch.compile's) less what they do not keep (``Family.memory.fused_norm_saving``), and
    under torch.compile less what Inductor recomputes (``Family.memory.compiled_saving``), where the family counts them."""
    bpv = layout.bytes_per_value
    return _layer_activation_bytes(shape, layout.lora, layout.mbs, layout.tp, layout.sequence_parallel, bpv,
                                   hw.flash_attention, encoder, bpv if hw.device_is_host else 1, hw.fused_norms,
                                   layout.compile)


@cached
def _layer_activation_bytes(shape: Shape, lora: Optional[Adapters], mbs: int, tp: int, sp: bool, bpv: int, flash: bool,
                            encoder: bool, mask_bytes: int, fused_norms: bool = False,
                            compiled: bool = False) -> float:
    terms, fused = shape.facts.memory, 0.0
    at = LayerAt(mbs, tp, sp, bpv, flash=flash, encoder=encoder, frozen_norms=lora is not None)
    if (fused_norms or compiled) and terms.fused_norm_saving is not None and not encoder:
        fused += terms.fused_norm_saving(shape, at)
    if compiled and terms.compiled_saving is not None and not encoder:
        fused += terms.compiled_saving(shape, at)
    return (terms.activation_bytes(shape, at) - fused
            + activation_delta_bytes(shape, lora, mbs, tp, sp, bpv, mask_bytes))


def autocast_casts_weights(layout: Layout, hw: Hardware) -> bool:
    """Whether the weights stay fp32 and 16-bit autocast casts them for each forward: the torch engine's
    parameters on one rank, where no data-parallel wrapper holds them in the compute dtype (the engine wraps a
    stage in FSDP2 whenever it offloads, on one rank too)."""
    return (engine_facts(layout.engine).fp32_weights and layout.master_weights == "fp32" and layout.zero_ranks == 1
            and layout.offload == "none" and layout.bytes_per_value < 4)


def model_state_bytes(params: float, dp: int, zero_stage: int = 3, offload: str = "none",
                      engine: str = "torch", optimizer: str = "adamw", master_weights: str = "fp32",
                      bytes_per_value: float = 2.0) -> float:
    """GPU bytes of the weights, gradients and optimizer states of ``params`` local parameters.

    ``deepspeed``: 16-bit weights (2) and gradients (2), fp32 master and Adam moments (12); ZeRO-1 divides
    the 12 over the ``dp`` ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights (REFERENCE §5: 16Ψ,
    4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; the 12 is the master's 4 plus ``OPTIMIZER_STATE_BYTES[optimizer]``,
    8 for Adam). ``torch``: the parameters are the fp32 master (4), gradients fp32
    (4), Adam moments (8); ZeRO-1 (optim.ShardedAdamW) divides the moments, ZeRO-2 and 3 (FSDP2 shards the
    parameters either way) all three: 16Ψ, 8Ψ + 8Ψ/N, 16Ψ/N, 16Ψ/N (the moments' 8 is
    ``OPTIMIZER_STATE_BYTES[optimizer]``). The 16-bit compute copy is
    ``compute_copy_bytes``. Offload leaves the optimizer part (and with optimizer_and_params the weights
    and gradients too) in host RAM; an engine whose offload moves the gradients (DeepSpeed's ZeRO-Offload,
    ``offload_moves_gradients``) keeps their ZeRO-2/3 partition there as well, reducing through its bucket
    (``reduce_bucket_bytes``). ``master_weights`` bf16 (torch): bf16 weights (2) and gradients (2) and the
    optimizer's moments in bf16 (half of ``OPTIMIZER_STATE_BYTES``; 8-bit AdamW's stay 8-bit), no fp32 master.
    The torch engine's optimizer offload keeps the weights and gradients on the GPU in the compute dtype
    (``bytes_per_value``), its fp32 master on the host with the optimizer's states."""
    n = max(1, dp)
    on_gpu = offload != "optimizer_and_params"
    states = OPTIMIZER_STATE_BYTES[optimizer]
    facts = engine_facts(engine)
    if master_weights == "bf16":  # everything the step keeps in bf16
        weights, grads, opt_bytes = 2.0, 2.0, float(states if optimizer == "adamw_8bit" else states / 2)
    elif master_on_host(engine, offload):
        weights, grads, opt_bytes = float(bytes_per_value), float(bytes_per_value), 0.0
    elif facts.fp32_weights:  # the fp32 parameter is the master
        weights, grads, opt_bytes = 4.0, 4.0, float(states)
    else:  # 16-bit weights and gradients, the fp32 master among the optimizer states
        weights, grads, opt_bytes = 2.0, 2.0, 4.0 + states
    grads_div = n if zero_stage >= 2 else 1
    weights_div = n if zero_stage >= 3 or (zero_stage == 2 and facts.zero2_shards_weights) else 1
    gpu_weights = weights * params / weights_div if on_gpu else 0.0
    grads_on_gpu = on_gpu and not (offload != "none" and zero_stage >= 2 and facts.offload_moves_gradients)
    gpu_grads = grads * params / grads_div if grads_on_gpu else 0.0
    gpu_optimizer = opt_bytes * params / (n if zero_stage >= 1 else 1) if offload == "none" else 0.0
    return gpu_weights + gpu_grads + gpu_optimizer


def reduce_bucket_bytes(trained: float, layout: Layout) -> float:
    """GPU bytes of the engine's gradient reduction bucket at ZeRO-2 and 3 (``reduce_bucket_elements``: DeepSpeed's
    contiguous IPG buffer, never larger than the ``trained`` parameters it reduces), in the training precision;
    0 for an engine without one."""
    bucket = engine_facts(layout.engine).reduce_bucket_elements
    if not bucket or layout.zero_stage < 2:
        return 0.0
    return min(trained, bucket) * layout.bytes_per_value


def compute_copy_bytes(params: float, gathered_layer: float, layout: Layout, hw: Hardware) -> float:
    """Bytes of the weights' compute-dtype copy that one step's forward makes and its backward reads, for a
    stage of ``params`` local parameters whose largest layer has ``gathered_layer``.

    Under PP over FSDP2 (torch engine, ZeRO-2/3): the whole stage unsharded and its fp32 gradients, the
    schedule reshards and reduces only after the step's last backward. Otherwise sharded weights (ZeRO-3,
    or FSDP2's offload): a gathered layer and the one prefetched. Torch engine
    otherwise: over DP ranks, replicate (ZeRO 0-1) and FSDP2 at ZeRO-2 keep the whole stage unsharded in
    the compute dtype until backward ends (fp32 too: the unsharded parameters are their own tensors); on
    one rank, autocast's 16-bit casts of the weights (none in fp32). DeepSpeed keeps 16-bit weights: no copy.
    Measured against the trace in tests/test_memory_check.py."""
    bpv = layout.bytes_per_value
    facts = engine_facts(layout.engine)
    if (facts.pipeline_defers_reshard and layout.pp > 1 and layout.zero_ranks > 1 and layout.zero_stage >= 2
            and layout.offload == "none"):
        # torch.distributed.pipelining defers FSDP2's reduction and resharding to the step's last backward:
        # the stage stays unsharded in the compute dtype and its gradients accumulate unsharded in fp32
        # (in place of their shard, counted in the states)
        return bpv * params + 4 * params * (1 - 1 / layout.zero_ranks)
    if layout.zero_stage >= 3 and (layout.zero_ranks > 1 or layout.offload == "optimizer_and_params"
                                   or master_on_host(layout.engine, layout.offload)):
        return 2 * bpv * gathered_layer
    if not facts.fp32_weights:  # 16-bit weights: computed on as they are
        return 0.0
    if layout.zero_ranks > 1 or layout.offload != "none":  # FSDP2 on one rank gathers a copy too
        return bpv * params
    return bpv * params if autocast_casts_weights(layout, hw) else 0.0


@cached
def stage_parameters(shape: Shape, tp: int, pp: int, ep: int = 1) -> tuple[float, ...]:
    """Parameters one GPU holds on each pipeline stage (after TP and EP): its layers, the embedding on the
    first stage, the head on the last. A mixture of experts' routed experts are split over the ``ep`` ranks
    and whole on every TP rank (``stage_expert_parameters``). Cached: the planner asks it for every
    micro-batch, saver and trial size of a TP x PP."""
    embed_p, head_p = vocab_parallel_parameters(shape, tp, pp)
    out = [(stage_layer_parameters(shape, pp, stage) - stage_expert_parameters(shape, pp, stage)) / tp
           + stage_expert_parameters(shape, pp, stage, ep) for stage in range(pp)]
    out[0] += embed_p
    out[-1] += head_p
    return tuple(out)


def sharded_state_bytes(shape: Shape, layout: Layout, params: float, stage: int) -> float:
    """``model_state_bytes`` of a stage's ``params`` local parameters, its routed experts sharded by ZeRO over
    the data-parallel ranks holding the same experts (DP / EP) and the rest over all DP ranks."""
    experts = stage_expert_parameters(shape, layout.pp, stage, layout.ep)
    savers = (layout.zero_stage, layout.offload, layout.engine, layout.optimizer, layout.master_weights,
              layout.bytes_per_value)
    return model_state_bytes(params - experts, layout.zero_ranks, *savers) + \
        (model_state_bytes(experts, layout.edp, *savers) if experts else 0.0)


@dataclass(frozen=True)
class HostPhases:
    """Host RAM of a node in each phase of a run, GiB."""

    load_gib: float  # every node while the checkpoint loads (as train_gib when the run loads none)
    train_gib: float  # every node while training: the processes and their offloaded shards
    save_rank0_gib: float  # rank 0's node while it gathers and writes the whole model

    @property
    def node_gib(self) -> float:
        """What every node needs: the larger of loading and training."""
        return max(self.load_gib, self.train_gib)


def largest_tensor(shape: Shape) -> int:
    """Elements of the model's largest single tensor: the vocabulary matrix or an MLP matrix."""
    return max(shape.vocab_size, shape.ffn_hidden_size) * shape.hidden_size


def host_phases_gib(shape: Shape, layout: Layout, gpus_on_node: int, hw: Optional[Hardware] = None) -> HostPhases:
    """Host RAM per phase of a node with ``gpus_on_node`` processes of ``layout``, GiB:
    train: each process (HOST_PROCESS_OVERHEAD_GIB) with its offloaded shard (the engine's ``host_offload_bytes`` per
    parameter of it, for Adam; another optimizer's own states in place of Adam's 8 bytes) and, with
    activation offload, its offloaded activations (``offloaded_activation_bytes``; ``hw`` needed); load (a pretrained model, read tensor by tensor): each process also holds one full
    tensor (LOAD_COPY_BYTES per element of the largest); save on rank 0: the whole model gathered in fp32
    (4·M, REFERENCE §5), a pretrained model in its 16-bit dtype (2·M)."""
    per_param = engine_facts(layout.engine).host_bytes(layout.offload)
    if per_param:  # the offloaded optimizer's own states in place of Adam's 8 bytes
        per_param += OPTIMIZER_STATE_BYTES[layout.optimizer] - OPTIMIZER_STATE_BYTES["adamw"]
    shard = max(layout.shard(params, stage_expert_parameters(shape, layout.pp, stage, layout.ep))
                for stage, params in enumerate(stage_parameters(shape, layout.tp, layout.pp, layout.ep)))
    offloaded = per_param * shard
    if layout.adapted and per_param:  # the adapters' states; parameter offload moves the frozen base too
        adapters = shape.num_layers / layout.pp * adapter_parameters(shape, layout.lora) / layout.tp / layout.zero_ranks
        base = shard * (2 if layout.offload == "optimizer_and_params" else 0)
        offloaded = per_param * adapters + base
    if layout.activation_offload:
        assert hw is not None, "activation offload's host RAM needs the hardware (bytes per value)"
        offloaded += offloaded_activation_bytes(shape, layout, hw)  # (none where the device is the host)
    train = gpus_on_node * (offloaded + HOST_PROCESS_OVERHEAD_GIB * GIB)
    load = train + (gpus_on_node * LOAD_COPY_BYTES * largest_tensor(shape) if shape.pretrained else 0.0)
    save = train + (PRETRAINED_GATHER_BYTES if shape.pretrained else CHECKPOINT_GATHER_BYTES) * model_parameters(shape)
    return HostPhases(load / GIB, train / GIB, save / GIB)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per GPU on the most loaded pipeline stage, in GiB."""

    model_states_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float

    @property
    def total_gib(self) -> float:
        return self.model_states_gib + self.activations_gib + self.logits_gib + self.overhead_gib


def stage_activation_bytes(shape: Shape, layout: Layout, hw: Hardware, stage: int) -> tuple[float, float]:
    """(bytes one micro-batch leaves stored on ``stage``, the recompute buffer): full activations of its
    layers, only the input of its checkpointed ones (and under selective checkpointing what the per-op policy
    keeps, ``selective_kept_bytes``), and for a stage holding decoder layers of an encoder-decoder the encoder
    output their cross-attention reads; while a checkpointed layer is recomputed in backward its full
    activations are live once more (under selective checkpointing, those the policy did not keep)."""
    tp, sp = layout.tp, layout.sequence_parallel
    bpv, b, h = layout.bytes_per_value, layout.mbs, shape.hidden_size
    sp_div = tp if sp else 1
    n_enc, n_dec = stage_layer_counts(shape, layout.pp, stage)
    k_enc, k_dec = checkpointed_layer_counts(shape, layout.pp, stage, layout.act_ckpt_layers)
    at = LayerAt(b, tp, sp, bpv, ep=layout.ep)
    dec_full = layer_activation_bytes(shape, layout, hw) + \
        shape.facts.memory.expert_parallel_activation_bytes(shape, at) + ring_saved_bytes(shape, layout)
    dec_input = shape.target_length * b * h * bpv / sp_div
    # what the per-op policy keeps of a checkpointed layer, stored until its backward and part of its recompute
    # (decoder-only families: hp_tool/sharding.py checkpoint_mode_problem)
    policy_kept = selective_kept_bytes(shape, b, tp, sp, bpv) if layout.act_ckpt_mode == "selective" else 0.0
    stored = k_dec * (dec_input + policy_kept) + (n_dec - k_dec) * dec_full
    buffer = dec_full - policy_kept if k_dec else 0.0
    if n_enc:
        enc_full = layer_activation_bytes(shape, layout, hw, encoder=True)
        stored += k_enc * shape.seq_length * b * h * bpv / sp_div + (n_enc - k_enc) * enc_full
        buffer = max(buffer, enc_full if k_enc else 0.0)
    if shape.encoder_decoder and n_dec:
        stored += shape.seq_length * b * h * bpv  # the encoder output, read by every cross-attention
    if stage == layout.pp - 1 and shape.facts.memory.head_activation_bytes is not None:
        stored += shape.facts.memory.head_activation_bytes(shape, at)  # final norm, head input
    return stored, buffer


@cached
def selective_kept_bytes(shape: Shape, mbs: int, tp: int, sequence_parallel: bool, bytes_per_value: int) -> float:
    """What selective checkpointing's per-op policy keeps of one checkpointed layer beyond its input, one
    micro-batch, bytes per TP rank: the outputs of the matmuls it keeps (``architectures.selective_kept_matmuls``,
    every second of the family's ``layer_matmuls``: Llama's q, v, gate and down), the attention kernel's output
    and fp32 log-sum-exp, and with sequence parallelism the reduce-scatter after each row-split matmul. A
    column-split matmul's output is 1/TP of its features on a rank, a row-split one's the whole width (its
    partial sums, kept before the all-reduce or reduce-scatter), a ``whole`` one's whole. Checked against the
    trace (tests/test_selective_checkpoint.py)."""
    p, tokens = bytes_per_value, mbs * shape.seq_length
    kept = sum(m.outputs / (tp if m.split == "colwise" else 1) for m in selective_kept_matmuls(shape))
    attention = (p * shape.attention_dim + 4 * shape.num_attention_heads) / tp
    scattered = 0.0
    if sequence_parallel:
        scattered = shape.hidden_size / tp * sum(m.split == "rowwise" for m in shape.facts.arch.layer_matmuls(shape))
    return tokens * (p * (kept + scattered) + attention)


def ring_saved_bytes(shape: Shape, layout: Layout) -> float:
    """What context parallelism's ring attention keeps for backward beyond the attention the family's formula
    counts, one layer and micro-batch (``shape`` at the rank's tokens): its output in fp32, apart from the
    compute-dtype copy the layer goes on with (hp_tool/trial/ring_attention.py). 0 without CP."""
    if layout.cp == 1:
        return 0.0
    return 4.0 * layout.mbs * shape.seq_length * shape.attention_dim / layout.tp


def ring_transient_bytes(shape: Shape, layout: Layout) -> float:
    """The ring's working memory at the peak of a layer's attention backward beyond what the layer keeps
    (``shape`` at the rank's tokens): one tile of fp32 scores (``ring_tile_rows`` query rows)
    and two fp32 tensors of the queries' size (the queries' gradient and the output gradient, or the block's
    keys and values over every query head), as traced at 4K-8K tokens on CPU and for a bf16 GPU
    (tests/test_long_context_memory.py). 0 without CP."""
    if layout.cp == 1:
        return 0.0
    b, s, heads = layout.mbs, shape.seq_length, shape.num_attention_heads / layout.tp
    tile = min(s, ring_tile_rows(round(b * heads), s)) * b * heads * s * 4  # fp32 scores of one tile
    return tile + 2 * 4.0 * b * s * shape.attention_dim / layout.tp


def stage_adapter_parameters(shape: Shape, layout: Layout, stage: int) -> float:
    """Adapter parameters one GPU holds on pipeline ``stage`` (0 for full training)."""
    return sum(stage_layer_counts(shape, layout.pp, stage)) * adapter_parameters(shape, layout.lora) / layout.tp


def stage_compute_copy_bytes(shape: Shape, layout: Layout, hw: Hardware, params: float, stage: int,
                             gathered_layer: float) -> float:
    """``compute_copy_bytes`` of the stage's parameters, its adapters included; QLoRA's 4-bit weights are
    dequantised one layer at a time instead (``stage_state_bytes``). Under LoRA / QLoRA on one rank only the
    fp32 adapters are cast: the frozen base is held in the compute dtype (``frozen_base_bytes``); replicated
    over data-parallel ranks (ZeRO 0-1) the base is left out of the replica's copy too."""
    adapters = stage_adapter_parameters(shape, layout, stage)
    replicated = layout.zero_ranks > 1 and layout.zero_stage <= 1
    if layout.adapted and (autocast_casts_weights(layout, hw) or replicated):
        return compute_copy_bytes(adapters, gathered_layer, layout, hw)
    quantised = 0.0
    if layout.method == "qlora":
        quantised = sum(stage_layer_counts(shape, layout.pp, stage)) * linear_parameters(shape) / layout.tp
    return compute_copy_bytes(params - quantised + adapters, gathered_layer, layout, hw)


def frozen_base_bytes(layout: Layout) -> float:
    """Bytes per parameter of an adapter method's frozen base as every engine holds it: the training precision's
    (the torch engine casts it to its 16-bit compute dtype, hp_tool/trial/weights.py hold_in; DeepSpeed
    holds 16-bit weights); fp32 in fp32."""
    return float(layout.bytes_per_value)


def stage_state_bytes(shape: Shape, layout: Layout, hw: Hardware, params: float, stage: int,
                      gathered_layer: float) -> float:
    """GPU bytes of pipeline ``stage``'s weights, gradients, optimizer states and compute copies (``params``
    parameters on this GPU after TP).

    Full training: ``model_state_bytes`` + ``compute_copy_bytes`` + ``reduce_bucket_bytes``. LoRA / QLoRA (families/methods.py): the
    frozen base as the engines hold it (``frozen_base_bytes``; QLoRA: its layers' linear weights in
    NF4_BITS per parameter) with no gradient or optimizer state, sharded by ZeRO-3 / FSDP2 and moved to the
    host by parameter offload as for full training, with full training's compute copies; QLoRA's transient
    dequantised copy of the layer's largest weight; the adapters' own states as full training's."""
    copies = stage_compute_copy_bytes(shape, layout, hw, params, stage, gathered_layer)
    if not layout.adapted:
        return sharded_state_bytes(shape, layout, params, stage) + copies + reduce_bucket_bytes(params, layout)
    bpv = layout.bytes_per_value
    layers = sum(stage_layer_counts(shape, layout.pp, stage))
    adapters = stage_adapter_parameters(shape, layout, stage)
    weight_bytes = frozen_base_bytes(layout)
    base, dequantised = params * weight_bytes, 0.0
    if layout.method == "qlora":
        quantised = layers * linear_parameters(shape) / layout.tp
        base = (params - quantised) * weight_bytes + quantised * NF4_BITS / 8
        dequantised = max(i * o for i, o in linear_shapes(shape).values()) / layout.tp * bpv
    sharded = layout.zero_stage >= 3 and (layout.zero_ranks > 1 or layout.offload == "optimizer_and_params")
    experts = stage_expert_parameters(shape, layout.pp, stage, layout.ep) * weight_bytes
    on_gpu = 0.0 if layout.offload == "optimizer_and_params" else layout.shard(base, experts) if sharded else base
    return on_gpu + copies + dequantised + reduce_bucket_bytes(adapters, layout) + model_state_bytes(
        adapters, layout.zero_ranks, layout.zero_stage, layout.offload, layout.engine, layout.optimizer,
        layout.master_weights, layout.bytes_per_value)


# Bytes per logit the whole-logits loss holds at its peak (cross-entropy's backward), as traced in fp32 and bf16
# (tests/test_long_context_memory.py): the logits (or their 16-bit form and fp32 upcast), log-softmax's output and
# the gradient, 12; the vocabulary-parallel loss under TP (torch's loss_parallel) one fp32 copy more, 16.
WHOLE_LOSS_BYTES = {False: 12, True: 16}


def logits_bytes(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Bytes the loss holds on the last stage for one micro-batch of the rank's tokens (``shape`` as the rank
    sees it, ``rank_shape``).

    full: ``WHOLE_LOSS_BYTES`` per logit of the rank's vocabulary (vocabulary-parallel: 1/TP of it): the loss
    runs eager, as hp_tool's engine and torchtitan's compiled runs (which compile the layers, not the loss) run it.
    chunked
    (hp_tool/trial/loss.py, TP 1): the hidden states' gradient (tokens x hidden, compute dtype) and the head
    weight's fp32 gradient (vocabulary x hidden) it computes in forward, and one chunk in flight: 12 bytes per
    logit, the fp32 logits with logsumexp's two temporaries of their size (then the logits and their softmax),
    as traced (tests/test_long_context_memory.py). Soft-capped logits (``Family.arch.softcapped_logits``) keep their
    tanh's output besides: the logits' bytes (compute dtype) per logit of the whole loss, an fp32 chunk's in the
    chunked one (tests/test_gemma.py)."""
    bpv, tokens = layout.bytes_per_value, layout.mbs * shape.target_length
    if layout.loss == "full":
        # with activation offload the log-softmax output waits in host RAM until backward brings it back
        per_logit = WHOLE_LOSS_BYTES[layout.tp > 1] - (2 if hw.offloads_activations(layout) else 0) + \
            (bpv if shape.facts.arch.softcapped_logits else 0)
        return tokens * shape.vocab_size * per_logit / layout.tp
    return tokens * shape.hidden_size * bpv + 4 * shape.vocab_size * shape.hidden_size + \
        loss_freed_bytes(shape, layout, hw)


def loss_freed_bytes(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """The part of ``logits_bytes`` the loss's backward has freed when the layers' backward starts: all the
    whole-logits loss holds; of the chunked loss its one chunk in flight (12 bytes per logit), not the hidden
    states' and head weight's gradients it computed in forward."""
    tokens = layout.mbs * shape.target_length
    if layout.loss == "full":
        return logits_bytes(shape, layout, hw)
    # the fp32 logits and logsumexp's two temporaries, or the logits and their softmax; a soft cap's fp32 tanh
    per_logit = 12 + (4 if shape.facts.arch.softcapped_logits else 0)
    return min(layout.loss_chunk_tokens, tokens) * shape.vocab_size * per_logit


def offloaded_activation_bytes(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Bytes of saved activations one GPU keeps in host RAM with activation offload: what the busiest
    stage would otherwise store for its micro-batches in flight (0 without offload, or where the device is the
    host)."""
    if not hw.offloads_activations(layout):
        return 0.0
    rank = rank_shape(shape, layout)
    return max(microbatches_in_flight(layout, stage) * stage_activation_bytes(rank, layout, hw, stage)[0]
               for stage in range(layout.pp))


def eager_trace_excess_gib(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """What a traced figure of ``layout`` holds beyond the layout's own peak, GiB per GPU: the tracer runs a
    compiled layout's layers eager (hp_tool/trial/trace/inflight.py ``traced_spec``), and they keep what Inductor's
    fused region does not (``Family.memory.fused_norm_saving``, ``Family.memory.compiled_saving``); 0 for an eager layout."""
    if not layout.compile:
        return 0.0
    return estimate_memory(shape, layout.replace(compile=False), hw).total_gib - \
        estimate_memory(shape, layout, hw).total_gib


def estimate_memory(shape: Shape, layout: Layout, hw: Hardware) -> MemoryEstimate:
    """Peak memory per GPU on the most loaded pipeline stage. Stage i of 1F1B holds up to PP - i
    micro-batches' activations in flight (the first stage the most; interleaved 1F1B more, and the receive
    buffers and sends its runtime holds: ``microbatches_in_flight``, ``interleave_held_tensors``); the first
    stage holds the embedding, the last the head and the logits (``logits_bytes``). Activations and logits
    are of the rank's tokens (``rank_shape``: the sequence over CP); with activation offload the stored
    activations are in host RAM and what one sub-layer's backward brings back is on the GPU
    (``working_layer_bytes``). A checkpointed layer's recompute (and CP's ring working memory, and what a layer's
    backward allocates: ``Family.memory.backward_transient_bytes``) runs in backward, after the loss has freed the logits:
    the last stage holds the larger of the two, not both (tests/test_selective_checkpoint.py measures both modes of
    checkpointing against the trace)."""
    best: MemoryEstimate | None = None
    best_total = -1.0
    for states, (activations, stage_logits) in zip(state_terms(shape, layout, hw), activation_terms(shape, layout, hw)):
        total = states + activations + stage_logits
        if total > best_total:
            best_total = total
            best = MemoryEstimate(states / GIB, activations / GIB, stage_logits / GIB, hw.memory_overhead_gib)
    assert best is not None
    return best


# the recipe's fields the model states depend on and the activations do not: ``activation_terms`` is computed once for
# the layouts that differ only in them (the planner tries several memory savers per layout)
STATE_ONLY_FIELDS = frozenset({"zero_stage", "offload", "optimizer", "master_weights"})
_activations: dict = {}
# the layout's fields the activations depend on and the model states do not: ``state_terms`` is computed once for the
# layouts that differ only in them (the planner tries every micro-batch, checkpointing and loss of a layout's savers)
ACTIVATION_ONLY_FIELDS = frozenset({"mbs", "global_batch_size", "act_ckpt_layers", "act_ckpt_mode", "sequence_parallel",
                                    "loss", "loss_chunk_tokens", "activation_offload", "compile"})
_STATE_KEYS = tuple(k for k in PART_OF if k not in ACTIVATION_ONLY_FIELDS)
_ACTIVATION_KEYS = tuple(k for k in PART_OF if k not in STATE_ONLY_FIELDS)
_states: dict = {}


def state_terms(shape: Shape, layout: Layout, hw: Hardware) -> tuple[float, ...]:
    """Per pipeline stage, the bytes of its weights, gradients, optimizer states and compute copies on one GPU
    (``stage_state_bytes``); the same for layouts that differ only in ``ACTIVATION_ONLY_FIELDS``."""
    return _kept(_states, shape, layout, hw, _STATE_KEYS, _state_terms)


def _state_terms(shape: Shape, layout: Layout, hw: Hardware) -> tuple[float, ...]:
    tp, ep = layout.tp, layout.ep
    layer, encoder_layer, experts = layer_parameter_counts(shape)
    gathered_layer = max(layer - experts, encoder_layer) / tp + experts / ep
    return tuple(stage_state_bytes(shape, layout, hw, params, stage, gathered_layer)
                 for stage, params in enumerate(stage_parameters(shape, tp, layout.pp, ep)))


def activation_terms(shape: Shape, layout: Layout, hw: Hardware) -> tuple[tuple[float, float], ...]:
    """Per pipeline stage, (activations and transient bytes, logits bytes) on the GPU at the stage's peak (see
    ``estimate_memory``); the same for layouts that differ only in ``STATE_ONLY_FIELDS``."""
    return _kept(_activations, shape, layout, hw, _ACTIVATION_KEYS, _activation_terms)


def _kept(store: dict, shape: Shape, layout: Layout, hw: Hardware, keys: tuple[str, ...],
          compute: Callable[[Shape, Layout, Hardware], Any]) -> Any:
    """``compute(shape, layout, hw)``, kept in ``store`` by the layout's fields named in ``keys``: the planner asks
    tens of thousands of layouts that differ only in the fields left out."""
    fields = layout.__dict__
    key = (shape, hw, *[fields[k] for k in keys])
    found = store.get(key)
    if found is None:
        if len(store) > 200_000:  # a bound on a long-lived process's memory
            store.clear()
        found = store[key] = compute(shape, layout, hw)
    return found


def _activation_terms(shape: Shape, layout: Layout, hw: Hardware) -> tuple[tuple[float, float], ...]:
    tp, pp = layout.tp, layout.pp
    bpv = layout.bytes_per_value
    rank = rank_shape(shape, layout)
    logits = logits_bytes(rank, layout, hw)
    out = []
    for stage in range(pp):
        per_microbatch, buffer = stage_activation_bytes(rank, layout, hw, stage)
        if hw.offloads_activations(layout):
            activations, buffer = working_layer_bytes(rank, layout, hw), 0.0
        else:
            activations = microbatches_in_flight(layout, stage) * per_microbatch
        # the hidden states a stage sends and receives, sequence-sharded over TP under sequence parallelism
        activations += sum(interleave_held_tensors(layout, stage)) * layout.mbs * rank.seq_length * \
            shape.hidden_size * bpv / (tp if layout.sequence_parallel else 1)
        # a layer's backward (its recompute, the ring's working memory) starts once the loss has freed its logits:
        # the larger of the two is the peak's
        freed = loss_freed_bytes(rank, layout, hw) if stage == pp - 1 else 0.0
        transient = ring_transient_bytes(rank, layout) + \
            shape.facts.memory.backward_transient_bytes(rank, LayerAt(layout.mbs, tp, bytes_per_value=bpv))
        out.append((activations + max(0.0, buffer + transient - freed), logits if stage == pp - 1 else 0.0))
    return tuple(out)


def working_layer_bytes(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """What stays on the GPU of the saved activations with activation offload, one micro-batch: the tensors one
    sub-layer's backward brings back at once, the largest being the MLP's (its four saved products of the FFN
    width for a gated MLP, two otherwise) with its norm's fp32 input; as traced for a bf16 GPU
    (tests/test_long_context_memory.py)."""
    b, s, p = layout.mbs, shape.seq_length, layout.bytes_per_value
    products = (4 if shape.gated_mlp else 2) * p * s * b * shape.ffn_hidden_size / layout.tp
    return products + 4.0 * s * b * shape.hidden_size / (layout.tp if layout.sequence_parallel else 1)
