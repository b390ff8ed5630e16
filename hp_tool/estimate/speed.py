"""Analytic time of one optimizer step for a training layout. Pure arithmetic, no torch.

compute   = (model + recompute FLOPs) / (GPUs · peak · efficiency), efficiency growing with the matmul
            sizes a micro-batch gives each GPU (``matmul_efficiency``);
bubble    = compute · (PP − 1) / (v · m) for m micro-batches per replica and v virtual stages per GPU
            (1F1B, interleaved when v > 1; Narayanan et al. 2021);
TP comm   = ring all-reduces of the layer activations, 2 in forward and 2 in backward per layer, plus
            2 per recomputed layer;
PP comm   = point-to-point activations and gradients between stages, v times as many when interleaved;
DP comm   = the engine's collectives over the stage's parameters (``dp_collectives``: an all-reduce of the
            gradients per step at ZeRO 0-1; at ZeRO-2 and 3 gathers and reduce-scatters per micro-batch,
            ZeRO-3 gathering in forward, in backward and, under DeepSpeed, again for the recompute);
            up to DP_OVERLAP of it hides behind the compute it can overlap (backward for stages 0-2,
            forward and backward for stage 3), so it is exposed in full once it outruns that compute;
EP comm   = a mixture of experts' all-to-all dispatch and combine of the routed tokens per MoE layer, in
            forward, backward and a recomputed forward, over the EP group's link (NVLink when the group
            fits in a node), not overlapped (``ep_comm_s``); the experts' compute runs at the busiest
            rank's load (``expert_imbalance``) and, whole on every TP rank, is not divided by TP;
CP comm   = context parallelism's ring: each layer passes the key/value blocks CP - 1 hops in forward (and a
            recomputed forward), and the blocks with their gradients back round in backward, each hop
            overlapped with the attention over the block it brought; exposed where it outruns it
            (``cp_comm_s``); ZeRO's collectives run over DP x CP ranks;
act. offload = the saved activations copied to pinned host RAM in forward and back in backward, at PCIe
            bandwidth, not overlapped (``activation_offload_s``);
offload   = host-device PCIe traffic of the offloaded shard (gradients down, updated weights up, and
            with parameter offload the weights up for every micro-batch's forward and backward) plus
            the optimizer step on the CPU (CPU_ADAM_PARAMS_PER_S per node, shared by its GPUs).
The constants are deliberately few; trials measure the truth and calibrate them. Validated on published
runs (REFERENCE §12) by benchmarks/published_runs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_tool.architectures import (Shape, checkpointed_layer_counts, model_flops_per_step, recompute_flops_per_step,
                                   stage_expert_parameters, stage_layer_counts, stage_layer_parameters,
                                   vocab_parallel_parameters)
from hp_tool.estimate.layout import GB, Hardware, Layout, rank_shape
from hp_tool.estimate.memory import stage_activation_bytes
from hp_tool.families.decoder import expert_forward_flops
from hp_tool.estimate.methods import ADAPTED, NF4_BITS, adapter_parameters_per_layer, linear_parameters_per_layer

MAX_EFFICIENCY = 0.7  # the fraction of peak large dense matmuls approach (best published runs: 0.5-0.65)
WIDTH_HALF = 384.0  # hidden columns per TP rank at which efficiency is half its saturation
TOKENS_HALF = 128.0  # tokens per micro-batch at which efficiency is half its saturation
DP_OVERLAP = 0.5  # at most this fraction of data-parallel communication hides behind compute
CPU_ADAM_PARAMS_PER_S = 4e9  # parameters per second a node's CPUs update with Adam (DeepSpeed CPU-Adam,
#                              about 1B parameters in 0.25 s on a 2-socket server; Ren et al. 2021)


@dataclass(frozen=True)
class StepTimeEstimate:
    """Seconds per optimizer step, by part."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    offload_s: float = 0.0
    dequant_s: float = 0.0  # QLoRA: 4-bit weights dequantised for every forward, backward and recompute
    ep_comm_s: float = 0.0  # mixture of experts: the all-to-all dispatch and combine of the routed tokens
    cp_comm_s: float = 0.0  # context parallel: the ring's key/value passes not hidden behind attention
    activation_offload_s: float = 0.0  # saved activations to host RAM and back

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.offload_s
                + self.dequant_s + self.ep_comm_s + self.cp_comm_s + self.activation_offload_s)


def matmul_efficiency(shape: Shape, layout: Layout) -> float:
    """Fraction of peak a GPU reaches for this micro-batch and TP width (0 < e < MAX_EFFICIENCY).

    A layer's GEMMs are (tokens of the micro-batch) x (hidden) x (hidden / TP) and wider; each dimension
    below a few hundred leaves the tensor cores underfed, and the work that is not a GEMM (norms,
    softmax, element-wise, launches) costs per token about in proportion to hidden / TP while the GEMMs
    cost its square: efficiency rises hyperbolically with both and saturates at MAX_EFFICIENCY.
    Constants fitted to Narayanan et al. 2021's Table 1 (benchmarks/published_runs.py). With context
    parallelism a rank's GEMMs run over its seq / CP tokens."""
    return gemm_efficiency(layout.mbs * shape.seq_length / layout.cp, shape.hidden_size / layout.tp)


def gemm_efficiency(tokens: float, width: float) -> float:
    """``matmul_efficiency`` of GEMMs over ``tokens`` rows and ``width`` columns per GPU."""
    return MAX_EFFICIENCY * width / (width + WIDTH_HALF) * tokens / (tokens + TOKENS_HALF)


def _ring_allreduce_s(nbytes: float, ranks: int, bandwidth_gbps: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / (bandwidth_gbps * GB) if ranks > 1 else 0.0


def _local_parameters(shape: Shape, layout: Layout) -> float:
    """Parameters one GPU holds (the largest stage's layers, after TP, with the vocabulary matrices split
    over TP), its routed experts (``_local_expert_parameters``) included."""
    embed, head = vocab_parallel_parameters(shape, layout.tp, layout.pp)
    dense = max(stage_layer_parameters(shape, layout.pp, stage) - stage_expert_parameters(shape, layout.pp, stage)
                for stage in range(layout.pp))
    return dense / layout.tp + embed + head + _local_expert_parameters(shape, layout)


def _local_expert_parameters(shape: Shape, layout: Layout) -> float:
    """Routed-expert parameters one GPU holds: the busiest stage's experts over EP, whole on every TP rank."""
    return max(stage_expert_parameters(shape, layout.pp, stage, layout.ep) for stage in range(layout.pp))


def expert_flops_per_step(shape: Shape, layout: Layout) -> float:
    """The routed experts' share of a step's model and recompute FLOPs: forward and backward of every layer
    (backward one matmul less with frozen experts under LoRA) and the forward of each recomputed layer."""
    per_stage = shape.pipeline_layers // layout.pp
    passes = (2.0 if shape.method in ADAPTED else 3.0) * shape.pipeline_layers + \
        layout.pp * min(layout.act_ckpt_layers, per_stage)
    return layout.global_batch_size * passes * expert_forward_flops(shape)


def compute_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds of matmul work per optimizer step (model and recompute FLOPs) on each GPU. A mixture of
    experts' routed experts are whole on every TP rank: at EP 1 each TP rank runs them on all the tokens (their
    FLOPs are not divided by TP); with EP each TP rank dispatches its slice of the tokens, at the busiest EP
    rank's load; GEMMs of the tokens each expert gets (top_k / experts of the micro-batch's)."""
    gpus = layout.gpus
    flops = model_flops_per_step(shape, layout.global_batch_size)
    flops += recompute_flops_per_step(shape, layout.global_batch_size, layout.act_ckpt_layers, layout.pp, layout.act_ckpt_mode)
    experts = expert_flops_per_step(shape, layout)
    peak = gpus * hw.peak_tflops * 1e12
    dense_s = (flops - experts) / (peak * matmul_efficiency(shape, layout))
    if not experts:
        return dense_s
    load = shape.expert_imbalance if layout.ep > 1 else float(layout.tp)
    # one expert's GEMM: the tokens routed to it (top_k / experts of the micro-batch's), its whole width
    tokens = max(1, round(layout.mbs * shape.seq_length / layout.cp * shape.top_k / shape.num_experts))
    return dense_s + experts * load / (peak * gemm_efficiency(tokens, shape.hidden_size))


def ep_comm_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds per step of the all-to-all dispatch and combine of an MoE layer's routed tokens over the EP
    group: each moves top_k copies of the micro-batch's tokens (with TP, of the rank's 1/TP slice of them),
    (EP - 1)/EP of them leaving the rank, twice in forward, twice in backward and twice more in a checkpointed
    layer's recomputed forward; over NVLink when the group (EP x TP consecutive ranks) fits in a node, else
    over the network. 0 at EP 1."""
    if layout.ep <= 1 or not shape.moe:
        return 0.0
    per_stage = shape.pipeline_layers // layout.pp
    exchanges = 4 * per_stage + 2 * min(layout.act_ckpt_layers, per_stage)
    nbytes = layout.mbs * shape.seq_length * shape.top_k * shape.hidden_size * hw.bytes_per_value * \
        (layout.ep - 1) / layout.ep / layout.tp
    within_node = layout.ep * layout.tp <= hw.gpus_per_node
    bandwidth = hw.intra_node_bandwidth_gbps if within_node else hw.inter_node_bandwidth_gbps
    return layout.num_microbatches * exchanges * nbytes / (bandwidth * GB)


def dp_collectives(shape: Shape, layout: Layout) -> float:
    """Data-parallel collectives of one step, each an all-gather or a reduce-scatter of the stage's
    parameters (an all-reduce is two), as the trial engines run them with m micro-batches per replica:

    - ZeRO 0-1: one all-reduce of the gradients per step (2): DDP skips the reduction on all but the last
      micro-batch, DeepSpeed reduces at the accumulation boundary;
    - PP over the torch engine's FSDP2: the schedule gathers the stage once and reduces once per step (2);
    - ZeRO-2: torch (FSDP2 keeping the gathered weights from forward to backward) gathers in each forward
      and reduce-scatters in each backward (2m); DeepSpeed reduce-scatters in each backward and gathers
      the updated weights once (m + 1);
    - ZeRO-3: a gather in forward and one in backward, a reduce-scatter in backward (3m); DeepSpeed
      gathers a checkpointed layer once more for its recompute forward (+ m times the checkpointed share
      of the layers), where FSDP2 recomputes inside the backward's gather."""
    m = layout.num_microbatches
    if layout.zero_stage <= 1 or (layout.engine == "torch" and layout.pp > 1):
        return 2.0
    if layout.zero_stage == 2:
        return 2.0 * m if layout.engine == "torch" else m + 1.0
    per_stage = shape.pipeline_layers // layout.pp
    recompute = min(layout.act_ckpt_layers, per_stage) / per_stage if layout.engine == "deepspeed" else 0.0
    return (3.0 + recompute) * m


def weight_gathers(shape: Shape, layout: Layout) -> float:
    """Of ``dp_collectives``, the all-gathers of sharded weights (trained or frozen): none at ZeRO 0-1 or under
    DeepSpeed's ZeRO-2 (whose one gather per step brings the updated, trained weights back); once per step
    under PP over FSDP2; each forward under FSDP2's ZeRO-2; all but the m reduce-scatters at ZeRO-3."""
    m = layout.num_microbatches
    if layout.zero_stage <= 1:
        return 0.0
    if layout.engine == "torch" and layout.pp > 1:
        return 1.0
    if layout.zero_stage == 2:
        return float(m) if layout.engine == "torch" else 0.0
    return dp_collectives(shape, layout) - m


def dp_comm_s(shape: Shape, layout: Layout, hw: Hardware, num_nodes: int) -> float:
    """Exposed data-parallel communication per step for the layout's ZeRO stage, over the node
    interconnect when the job spans nodes (see the module docstring)."""
    if layout.zero_ranks == 1:
        return 0.0
    bandwidth = hw.inter_node_bandwidth_gbps if num_nodes > 1 else hw.intra_node_bandwidth_gbps
    # a ring all-reduce moves two collectives' volume
    collectives, params = dp_collectives(shape, layout), _local_parameters(shape, layout)
    gathers = weight_gathers(shape, layout)
    # routed experts are gathered and reduced over the DP / EP ranks holding the same experts
    experts = _local_expert_parameters(shape, layout) if layout.ep > 1 else 0.0
    params -= experts
    trained = params if shape.method not in ADAPTED else \
        shape.pipeline_layers / layout.pp * adapter_parameters_per_layer(shape) / layout.tp
    # the sharded weights are gathered whether they train or not; only trained ones have gradients to reduce
    volume = gathers * params + (collectives - gathers) * trained
    expert_volume = gathers * experts + (collectives - gathers) * (experts if shape.method not in ADAPTED else 0.0)
    comm = volume / 2 * _ring_allreduce_s(2.0, layout.zero_ranks, bandwidth) + \
        expert_volume / 2 * _ring_allreduce_s(2.0, layout.edp, bandwidth)
    overlappable = compute_s(shape, layout, hw) * (1.0 if layout.zero_stage >= 3 else 2 / 3)
    return comm - min(DP_OVERLAP * comm, overlappable)


def offload_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds per step spent moving the offloaded shard over PCIe and stepping it on the CPU."""
    if layout.offload == "none":
        return 0.0
    shard = layout.shard(_local_parameters(shape, layout), _local_expert_parameters(shape, layout))
    pcie = 2 * 2 * shard  # 16-bit gradients down, updated 16-bit weights up
    if layout.offload == "optimizer_and_params":
        pcie += 2 * layout.num_microbatches * 2 * shard  # weights up for each forward and backward
    cpu_step = shard / (CPU_ADAM_PARAMS_PER_S / hw.gpus_per_node)
    return pcie / (hw.pcie_bandwidth_gbps * GB) + cpu_step


def tp_allreduce_bytes(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Bytes all-reduced over TP per micro-batch on the busiest stage: one layer activation for each
    sub-layer (attention and MLP; a T5 decoder layer adds cross-attention) in forward and in backward,
    and again in the recomputed forward of a checkpointed layer."""
    per_token = shape.hidden_size * hw.bytes_per_value * layout.mbs
    dec_sublayers = 3 if shape.encoder_decoder else 2
    busiest = 0.0
    for stage in range(layout.pp):
        n_enc, n_dec = stage_layer_counts(shape, layout.pp, stage)
        k_enc, k_dec = checkpointed_layer_counts(shape, layout.pp, stage, layout.act_ckpt_layers)
        enc = 2 * (2 * n_enc + k_enc) * shape.seq_length
        dec = dec_sublayers * (2 * n_dec + k_dec) * shape.target_length
        busiest = max(busiest, (enc + dec) * per_token)
    return busiest


def estimate_step_time(shape: Shape, layout: Layout, hw: Hardware, num_nodes: int) -> StepTimeEstimate:
    """Predicted seconds per optimizer step of the full run on ``num_nodes`` nodes."""
    m = layout.num_microbatches
    compute = compute_s(shape, layout, hw)
    bubble = compute * (layout.pp - 1) / (layout.virtual_stages * m)
    rank = rank_shape(shape, layout)  # the tokens of each sequence a rank holds

    tp_bw = hw.intra_node_bandwidth_gbps if layout.tp <= hw.gpus_per_node else hw.inter_node_bandwidth_gbps
    tp_comm = m * _ring_allreduce_s(tp_allreduce_bytes(rank, layout, hw), layout.tp, tp_bw)

    pp_comm = 0.0
    if layout.pp > 1:
        spans_nodes = layout.model_parallel > hw.gpus_per_node
        pp_bw = hw.inter_node_bandwidth_gbps if spans_nodes else hw.intra_node_bandwidth_gbps
        # an encoder-decoder's stages pass the encoder's and the decoder's hidden states
        tokens = rank.seq_length + (shape.decoder_seq_length or 0)
        boundary_bytes = layout.mbs * tokens * shape.hidden_size * hw.bytes_per_value
        crossings = layout.virtual_stages * (m + layout.pp - 1)  # each micro-batch crosses v times more
        pp_comm = 2 * crossings * boundary_bytes / layout.tp / (pp_bw * GB)

    return StepTimeEstimate(compute, bubble, tp_comm, pp_comm, dp_comm_s(shape, layout, hw, num_nodes),
                            offload_s(shape, layout, hw), dequant_s(shape, layout, hw), ep_comm_s(shape, layout, hw),
                            cp_comm_s(shape, layout, hw), activation_offload_s(shape, layout, hw))


def cp_comm_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Exposed seconds per step of context parallelism's ring (0 at CP 1). Each layer's attention passes its
    key/value block (the rank's seq / CP tokens, the TP rank's key/value heads) CP - 1 hops in forward and in
    a checkpointed layer's recomputed forward, and in backward the blocks with their key/value gradients
    (twice the bytes) CP hops, the last bringing the gradients home. Each hop overlaps the attention over
    the block the last one brought: the attention's share of the layer's FLOPs (scores and their product with
    the values) over the rank's tokens against the whole sequence, backward twice forward; the hops cost
    what they exceed it by. Over NVLink when the ring (CP x TP consecutive ranks) fits in a node."""
    if layout.cp == 1:
        return 0.0
    cp, tp, b = layout.cp, layout.tp, layout.mbs
    local = shape.seq_length / cp
    block = 2 * b * local * shape.kv_dim / tp * hw.bytes_per_value  # one rank's keys and values
    bandwidth = hw.intra_node_bandwidth_gbps if cp * tp <= hw.gpus_per_node else hw.inter_node_bandwidth_gbps
    hop_s = block / (bandwidth * GB)
    # the attention over one received block: 2·2·(rank tokens)·(block tokens)·(attention width / TP) FLOPs
    attention_flops = 4 * b * local * local * shape.attention_dim / tp
    rate = hw.peak_tflops * 1e12 * gemm_efficiency(b * local, shape.hidden_size / tp)
    forward = (cp - 1) * max(0.0, hop_s - attention_flops / rate)
    backward = cp * max(0.0, 2 * hop_s - 2 * attention_flops / rate)
    per_stage = shape.pipeline_layers // layout.pp
    recomputed = min(layout.act_ckpt_layers, per_stage)
    return layout.num_microbatches * ((per_stage + recomputed) * forward + per_stage * backward)


def activation_offload_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds per step of activation offload: every micro-batch's saved activations copied to pinned host RAM
    in forward and back in backward over PCIe (``offloaded_activation_bytes`` per micro-batch in flight; torch's
    ``save_on_cpu`` copies in line, not overlapped). 0 without it, or where the device is the host."""
    if not hw.offloads_activations(layout):
        return 0.0
    rank = rank_shape(shape, layout)
    per_microbatch = max(stage_activation_bytes(rank, layout, hw, stage)[0] for stage in range(layout.pp))
    return layout.num_microbatches * 2 * per_microbatch / (hw.pcie_bandwidth_gbps * GB)


def dequant_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """QLoRA's dequantisation per step: every micro-batch's forward and backward (and the recompute of a
    checkpointed layer) read each 4-bit weight of the stage's layers and write its 16-bit copy, bound by
    the GPU's memory bandwidth. 0 for the other methods."""
    if shape.method != "qlora":
        return 0.0
    per_stage = shape.pipeline_layers / layout.pp
    passes = 2 * per_stage + min(layout.act_ckpt_layers, per_stage)  # layers dequantised per micro-batch
    nbytes = passes * linear_parameters_per_layer(shape) / layout.tp * (NF4_BITS / 8 + hw.bytes_per_value)
    return layout.num_microbatches * nbytes / (hw.memory_bandwidth_gbps * GB)


def extrapolate_step_time_s(measured_step_time_s: float, shape: Shape, trial: Layout, full: Layout,
                            hw: Hardware, trial_nodes: int, full_nodes: int) -> float:
    """Step time of the full run from a trial's measurement on fewer nodes: each replica does the same
    work, so only what depends on the data-parallel degree differs, and that difference is modelled:
    the data-parallel communication (more or slower in the full run) and the offloaded shard's traffic
    and CPU step (smaller with more shards; never removing more than the trial's modelled part)."""
    extra = max(0.0, dp_comm_s(shape, full, hw, full_nodes) - dp_comm_s(shape, trial, hw, trial_nodes))
    offload_change = offload_s(shape, full, hw) - offload_s(shape, trial, hw)
    return measured_step_time_s + extra + offload_change
