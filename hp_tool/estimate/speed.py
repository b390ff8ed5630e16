"""Analytic time of one optimizer step for a training layout. Pure arithmetic, no torch.

compute   = the linears' (model + recompute) FLOPs / (GPUs · peak · efficiency), efficiency growing with the
            matmul sizes a micro-batch gives each GPU (``matmul_efficiency``, the curve the gpu preset's),
            plus causal flash attention priced apart: the FLOPs its kernels compute (half the scores,
            the backward's recompute) at an efficiency rising with the rank's tokens and head dimension
            (``attention_efficiency``; at ``HOPPER_ATTENTION_EFFICIENCY``, measured, for a stack with Hopper's own
            kernels, ``Hardware.hopper_attention``); with fp8 linears their FLOPs at the GPU's fp8 peak;
element-wise = the bytes an eager layer's norms, casts, rotary embeddings, activations and residual adds read and
            write (the family's ``layer_bytes`` per token, LoRA's ``ADAPTER_BYTES`` per adapted linear), forward,
            backward and a checkpointed layer's recompute, at the GPU's memory bandwidth (``elementwise_s``);
            fused kernels (torch.compile, or a stack that fuses them: ``Hardware.fused_elementwise``) move
            ``FUSED_ELEMENTWISE`` of those bytes;
fp8 casts = the Float8 linears' amax scans, casts and transposes at the GPU's memory bandwidth (``fp8_cast_s``);
host      = what the host's dispatch of an eager step's operators takes beyond the GPU's work it launches
            (``hp_tool.estimate.host``): the step's floor where the kernels are small (short sequences,
            micro-batch 1);
bubble    = (compute + element-wise) · (PP − 1) / (v · m) for m micro-batches per replica and v virtual stages per GPU
            (1F1B, interleaved when v > 1; Narayanan et al. 2021);
TP comm   = ring all-reduces of the layer activations, 2 in forward and 2 in backward per layer, plus
            2 per recomputed layer, less the share a stack hides behind the GEMMs (``Hardware.tp_comm_hidden``:
            async TP, Transformer Engine's userbuffers; none in hp_tool's engines);
PP comm   = point-to-point activations and gradients between stages, v times as many when interleaved;
DP comm   = the engine's collectives over the stage's parameters (``dp_traffic``: an all-reduce of the
            gradients per step at ZeRO 0-1; at ZeRO-2 and 3 gathers and reduce-scatters per micro-batch,
            ZeRO-3 gathering in forward, in backward and, under DeepSpeed, again for the recompute), each
            costed by topology (``collective_s``: NVLink within a node, the node's aggregate network between
            nodes) and overlapped layer by layer with the forward or backward it runs beside; exposed is
            what outruns that compute plus one layer's share (``dp_comm_s``);
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
            the optimizer step on the CPU at the node's CPU Adam rate (``cpu_adam_params_per_s``: its host
            threads, ``gpu.host_cpu_cores``, at a per-thread rate up to a memory-bandwidth ceiling), shared by
            its GPUs.
The constants are deliberately few; trials measure the truth and calibrate them. Validated on published
runs (REFERENCE §12) by benchmarks/published_runs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_tool.architectures import (Shape, checkpointed_layer_counts, model_flops_per_step, recompute_flops_per_step,
                                   stage_expert_parameters, stage_layer_counts, stage_layer_parameters,
                                   vocab_parallel_parameters)
from hp_tool.engine_facts import engine_facts
from hp_tool.estimate.host import host_s
from hp_tool.estimate.layout import GB, Hardware, Layout, rank_shape, stage_layers
from hp_tool.estimate.memory import adapter_parameters, cached, linear_parameters, stage_activation_bytes
from hp_tool.families.decoder import expert_forward_flops
from hp_tool.families.methods import NF4_BITS, attention_core_flops_per_layer, linear_shapes

# attention kernels (FlashAttention-2, Dao 2023, Fig. 4-7: causal forward + backward on A100 80 GiB at head dim 128
# reaches 118, 171, 187 and 192 TFLOPS at 512, 2K, 8K and 16K tokens, about 62% of peak x s / (s + 330); at head
# dim 64 about 10% less): efficiency = the GPU's attention_efficiency x s / (s + ATTENTION_TOKENS_HALF)
# x the head dimension's factor d / (d + ATTENTION_HEAD_DIM_HALF), relative to d = 128
ATTENTION_TOKENS_HALF = 330.0
ATTENTION_HEAD_DIM_HALF = 16.0
# the flash backward recomputes the scores and runs four more matmuls: 2.5 times the forward's FLOPs
# (Dao 2023, §3.1), and a causal kernel skips the masked half of the scores
FLASH_BACKWARD = 2.5
# Hopper's own attention kernels (cuDNN's fused attention, which Transformer Engine calls on H100; FlashAttention-3 is
# of its class) run at their own rate, not a multiple of the preset's fitted FlashAttention-2 one: FlashAttention-3's
# paper (Shah et al. 2024, Fig. 5-6: H100 80GB SXM5, bf16, head dim 128, 8K tokens) measures cuDNN's causal forward
# at 529 TFLOPS and its backward at 518, FlashAttention-2's at 333 and 318: Hopper's kernels' saturation = their
# forward and backward (1 : FLASH_BACKWARD FLOPs) at 8K tokens over the SXM's 989 TFLOPS dense peak, less the rise
# with tokens (about 0.55: 521 TFLOPS at 8K)
HOPPER_ATTENTION_EFFICIENCY = ((1 + FLASH_BACKWARD) / (1 / 529 + FLASH_BACKWARD / 518) / 989
                               / (8192 / (8192 + ATTENTION_TOKENS_HALF)))
# An eager layer's element-wise kernels stream their tensors through GPU memory: the fraction of the datasheet
# bandwidth they reach (large element-wise kernels: 80-90% on A100 and H100)
ELEMENTWISE_BANDWIDTH = 0.8
# Fused kernels (torch.compile's Inductor, Transformer Engine's and Megatron's fused norms, activations and
# rotary embeddings) read each tensor of a chain of element-wise operators once and write its result once: the
# fraction of the eager bytes they move. Chosen on the published pretraining runs (benchmarks/published_runs.py,
# torchtitan's compiled runs, NeMo's and Megatron's): 0.1 to 0.5 give a step-time median of 5.6, 5.1, 4.7 and 6.2%
# over the 146 runs, each GPU's efficiency refitted; torchtitan's Llama 3.1 8B runs 16% faster compiled on H100
# (5762 -> 6667 tokens/s per GPU on 8 GPUs)
FUSED_ELEMENTWISE = 0.3
# LoRA's element-wise bytes per token per input and output feature of an adapted linear, forward, backward and
# recompute, as the engine runs it (hp_tool/trial/methods.py: the scaling and the sum folded into B's matmul, the
# input read in the compute dtype): only the input's gradient, summed over the base and the adapter, is left.
# Counted on the engine's Llama layer, every linear adapted, adapters fp32 over a bf16 base
# (benchmarks/elementwise_bytes.py); the per-micro-batch casts of the rank-sized adapters are not priced
ADAPTER_BYTES = (0.0, 2.1, 0.0)
# A non-zero LoRA dropout's bytes per token per input feature of each adapted linear (each drops its input out
# apart), forward, backward and recompute, as a GPU runs torch's ``native_dropout``: the input read (2 bytes), the
# dropped-out copy (2) and its bool mask (1) written; backward reads the gradient and the mask and writes the
# input's gradient
DROPOUT_BYTES = (5.0, 5.0, 5.0)
# CPU Adam (``cpu_adam_params_per_s``). DeepSpeed's CPU-Adam steps 1 to 10 billion parameters in 0.22 to 2.57 s, about
# 4e9 parameters per second (Ren et al. 2021, ZeRO-Offload, Table 3), on a DGX-2's host: 2 x 24-core Xeon Platinum
# 8168, 96 threads, 12 channels of DDR4-2666 (Table 2). The step is an OpenMP loop that streams about 30 bytes per
# parameter through host memory (fp32 weight, gradient and both moments read; weight and moments written back; the
# 16-bit copy for the GPU), so on a whole node memory bandwidth bounds it, not the threads' arithmetic: one thread on
# its own steps about 1.3e9 parameters per second (DeepSpeed 0.19.8 on one core of an AMD EPYC cloud VM), while the
# paper's 4e9 is about 120 GB/s, under half the DGX-2's 256 GB/s peak, 1.25 GB/s per thread. Servers give each
# hardware thread a similar share of DRAM bandwidth (peak over threads, from the CPUs' memory channels: 1.6 GB/s on a
# DGX A100, 2.1 on a g5.48xlarge, 2.7 on a DGX-2 or DGX H100, 2.9 on a p4d), so a node steps in proportion to its
# threads, at the paper's rate per thread; an instance that is a slice of a server (g5.4xlarge: 16 of a host's 192
# vCPUs) is priced at its threads' share, what it gets when its neighbours are busy. Where a preset names no host
# (gpu.host_cpu_cores null) the node steps at the paper's rate, as its 96 threads did.
CPU_ADAM_PARAMS_PER_S = 4e9  # parameters per second a node of unknown host steps (the paper's DGX-2)
CPU_ADAM_REFERENCE_THREADS = 96  # the DGX-2 host's threads that rate was measured on
CPU_ADAM_PARAMS_PER_S_PER_THREAD = CPU_ADAM_PARAMS_PER_S / CPU_ADAM_REFERENCE_THREADS  # about 4.2e7
# The ceiling: the host's memory bandwidth (the gpu preset's ``host_memory_bandwidth_gbps``, its CPUs' channels x
# their rate), of which a streaming loop sustains STREAM's fraction, 70-75% of peak, at CPU_ADAM_HOST_BYTES per
# parameter, whatever the thread count. A host of unknown memory is priced as a 2-socket host with 16 channels of
# DDR4-3200 (410 GB/s peak: DGX A100's 2 x EPYC 7742, g5.48xlarge's and p5's EPYC hosts), about 1e10 parameters
# per second, which binds above 240 threads (the DGX A100's 256); a DGX H100's 614 GB/s (2 x 8 channels of
# DDR5-4800) allows 1.5e10, above what its 224 threads step.
STREAM_FRACTION = 0.73
CPU_ADAM_HOST_BYTES = 30.0  # bytes per parameter a CPU Adam step streams through host memory (above)
REFERENCE_HOST_MEMORY_GBPS = 409.6  # 2 sockets x 8 channels x DDR4-3200 (25.6 GB/s each)
CPU_ADAM_MAX_PARAMS_PER_S = STREAM_FRACTION * REFERENCE_HOST_MEMORY_GBPS * 1e9 / CPU_ADAM_HOST_BYTES  # about 1e10


cached_model_flops = cached(model_flops_per_step)
cached_recompute_flops = cached(recompute_flops_per_step)
cached_expert_forward_flops = cached(expert_forward_flops)


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
    fp8_cast_s: float = 0.0  # Float8 linears: amax scans, casts and transposes
    host_s: float = 0.0  # the host's operator dispatch beyond the GPU work it launches (hp_tool.estimate.host)
    elementwise_s: float = 0.0  # the layers' element-wise kernels at the GPU's memory bandwidth

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.offload_s
                + self.dequant_s + self.ep_comm_s + self.cp_comm_s + self.activation_offload_s + self.fp8_cast_s
                + self.host_s + self.elementwise_s)


def matmul_efficiency(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Fraction of peak a GPU reaches for this micro-batch's linears at this TP width (0 < e < the GPU's
    ``max_efficiency``).

    A layer's GEMMs are (tokens of the micro-batch) x (hidden) x (hidden / TP) and wider; each dimension
    below a few hundred leaves the tensor cores underfed, and the work that is not a GEMM (norms,
    element-wise, launches) costs per token about in proportion to hidden / TP while the GEMMs cost its
    square: efficiency rises hyperbolically with both and saturates at the GPU's ``max_efficiency``. The
    three constants are the gpu preset's (``efficiency``, fitted per generation by
    benchmarks/published_runs.py). With context parallelism a rank's GEMMs run over its seq / CP tokens."""
    return gemm_efficiency(layout.mbs * shape.seq_length / layout.cp, shape.hidden_size / layout.tp, hw)


def gemm_efficiency(tokens: float, width: float, hw: Hardware) -> float:
    """``matmul_efficiency`` of GEMMs over ``tokens`` rows and ``width`` columns per GPU on ``hw``."""
    return hw.max_efficiency * width / (width + hw.width_half) * tokens / (tokens + hw.tokens_half)


def attention_efficiency(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Fraction of peak the flash attention kernels reach over a rank's seq / CP tokens at the shape's head
    dimension (constants above, from FlashAttention-2's measurements; the GPU's saturation from its preset, or
    ``HOPPER_ATTENTION_EFFICIENCY`` with Hopper's own kernels, ``Hardware.hopper_attention``)."""
    tokens, d = shape.seq_length / layout.cp, shape.head_dim
    head = d / (d + ATTENTION_HEAD_DIM_HALF) / (128 / (128 + ATTENTION_HEAD_DIM_HALF))
    saturation = HOPPER_ATTENTION_EFFICIENCY if hw.hopper_attention else hw.attention_efficiency
    return min(1.0, saturation * tokens / (tokens + ATTENTION_TOKENS_HALF) * head)


def priced_apart(shape: Shape, hw: Hardware) -> bool:
    """Whether attention is priced on its own: flash kernels over a decoder-only model's causal attention (an
    encoder-decoder's attention and unfused attention are priced with the linears, as counted)."""
    return hw.flash_attention and not shape.encoder_decoder


def attention_flops_per_step(shape: Shape, layout: Layout) -> tuple[float, float]:
    """(the attention core's FLOPs as the model counts them: Q·Kᵀ and scores·V over the whole sequence, 3x
    forward plus the forward of each recomputed layer; the FLOPs the causal flash kernels compute: half the
    scores, forward, the backward's 2.5x and the recompute's forward) of one step."""
    core = attention_core_flops_per_layer(shape)
    layers = shape.num_layers
    recomputed = layout.pp * stage_layers(shape, layout)[1]
    counted = core * (3 * layers + recomputed)
    kernels = core / 2 * ((1 + FLASH_BACKWARD) * layers + recomputed)
    return layout.global_batch_size * counted, layout.global_batch_size * kernels


def _ring_allreduce_s(nbytes: float, ranks: int, bandwidth_gbps: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / (bandwidth_gbps * GB) if ranks > 1 else 0.0


def _local_parameters(shape: Shape, layout: Layout) -> float:
    """Parameters one GPU holds (the largest stage's layers, after TP, with the vocabulary matrices split
    over TP), its routed experts (``_local_expert_parameters``) included."""
    return local_parameters(shape, layout.tp, layout.pp, layout.ep)


@cached
def local_parameters(shape: Shape, tp: int, pp: int, ep: int) -> float:
    """``_local_parameters`` of a TP x PP x EP layout."""
    embed, head = vocab_parallel_parameters(shape, tp, pp)
    dense = max(stage_layer_parameters(shape, pp, stage) - stage_expert_parameters(shape, pp, stage)
                for stage in range(pp))
    return dense / tp + embed + head + local_expert_parameters(shape, pp, ep)


def _local_expert_parameters(shape: Shape, layout: Layout) -> float:
    """Routed-expert parameters one GPU holds: the busiest stage's experts over EP, whole on every TP rank."""
    return local_expert_parameters(shape, layout.pp, layout.ep)


@cached
def local_expert_parameters(shape: Shape, pp: int, ep: int) -> float:
    """``_local_expert_parameters`` of a PP x EP layout."""
    return max(stage_expert_parameters(shape, pp, stage, ep) for stage in range(pp))


def expert_flops_per_step(shape: Shape, layout: Layout) -> float:
    """The routed experts' share of a step's model and recompute FLOPs: forward and backward of every layer
    (backward one matmul less with frozen experts under LoRA) and the forward of each recomputed layer."""
    passes = (2.0 if layout.adapted else 3.0) * shape.pipeline_layers + layout.pp * stage_layers(shape, layout)[1]
    return layout.global_batch_size * passes * cached_expert_forward_flops(shape)


@cached
def compute_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds of matmul work per optimizer step (model and recompute FLOPs) on each GPU: the linears at
    ``matmul_efficiency`` (at the GPU's Float8 peak where they run in it), and with flash kernels the causal
    attention on its own (``attention_flops_per_step`` at ``attention_efficiency``). A mixture of experts'
    routed experts are whole on every TP rank: at EP 1 each TP rank runs them on all the tokens (their FLOPs
    are not divided by TP); with EP each TP rank dispatches its slice of the tokens, at the busiest EP rank's
    load; GEMMs of the tokens each expert gets (top_k / experts of the micro-batch's)."""
    gpus = layout.gpus
    flops = cached_model_flops(shape, layout.global_batch_size, layout.lora)
    flops += cached_recompute_flops(shape, layout.global_batch_size, layout.act_ckpt_layers, layout.pp,
                                    layout.act_ckpt_mode)
    experts = expert_flops_per_step(shape, layout)
    peak = gpus * hw.peak_tflops * 1e12
    # Float8 linears run at the fp8 peak (the routed experts are no nn.Linear: torchao leaves them in bf16)
    linear_peak = gpus * hw.fp8_peak_tflops * 1e12 if layout.fp8 else peak
    attention = 0.0
    if priced_apart(shape, hw):
        counted, kernels = attention_flops_per_step(shape, layout)
        flops -= counted
        attention = kernels / (gpus * hw.peak_tflops * 1e12 * attention_efficiency(shape, layout, hw))
    dense_s = (flops - experts) / (linear_peak * matmul_efficiency(shape, layout, hw)) + attention
    if not experts:
        return dense_s
    load = shape.expert_imbalance if layout.ep > 1 else float(layout.tp)
    # one expert's GEMM: the tokens routed to it (top_k / experts of the micro-batch's), its whole width
    tokens = max(1, round(layout.mbs * shape.seq_length / layout.cp * shape.top_k / shape.num_experts))
    return dense_s + experts * load / (peak * gemm_efficiency(tokens, shape.hidden_size, hw))


def elementwise_ffn(shape: Shape) -> float:
    """The feed-forward width a token's element-wise work runs over: a mixture of experts' top_k experts'."""
    return shape.ffn_hidden_size * (shape.top_k if shape.num_experts else 1)


def layer_pass_bytes(shape: Shape, layout: Layout) -> tuple[float, float, float]:
    """(forward, backward, recompute) element-wise bytes per token one layer moves on a rank under the layout's
    method: the family's ``layer_bytes`` (a x hidden + b x ffn, a mixture of experts' ffn times its top_k) and
    ``ADAPTER_BYTES`` per input and output feature of each adapted linear and, with a non-zero dropout,
    ``DROPOUT_BYTES`` per input feature, over TP (each rank's slice)."""
    ffn = elementwise_ffn(shape)
    passes = [a * shape.hidden_size + b * ffn for a, b in shape.facts.time.layer_bytes]
    if layout.adapted:
        linears = [shape for name, shape in linear_shapes(shape).items() if name in layout.lora.target_modules]
        features, inputs = sum(i + o for i, o in linears), sum(i for i, _ in linears)
        dropout = DROPOUT_BYTES if layout.lora.dropout > 0 else (0.0, 0.0, 0.0)
        passes = [n + per * features + drop * inputs for n, per, drop in zip(passes, ADAPTER_BYTES, dropout)]
    return tuple(n / layout.tp for n in passes)


@cached
def elementwise_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds per step of the busiest stage's element-wise kernels: every micro-batch's tokens on the rank
    (seq / CP) through each layer's forward and backward and a checkpointed layer's recompute
    (``layer_pass_bytes``) at ``ELEMENTWISE_BANDWIDTH`` of the GPU's memory bandwidth; fused (torch.compile, or
    ``hw.fused_elementwise``), ``FUSED_ELEMENTWISE`` of the bytes. 0 where the device is the host (the CPU preset's
    efficiency prices a CPU rank's work whole)."""
    if hw.device_is_host:
        return 0.0
    forward, backward, recompute = layer_pass_bytes(shape, layout)
    per_stage, recomputed = stage_layers(shape, layout)
    tokens = layout.mbs * shape.seq_length / layout.cp
    nbytes = layout.num_microbatches * tokens * (per_stage * (forward + backward) + recomputed * recompute)
    if layout.compile or hw.fused_elementwise:
        nbytes *= FUSED_ELEMENTWISE
    return nbytes / (hw.memory_bandwidth_gbps * GB * ELEMENTWISE_BANDWIDTH)


def ep_comm_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds per step of the all-to-all dispatch and combine of an MoE layer's routed tokens over the EP
    group: each moves top_k copies of the micro-batch's tokens (with TP, of the rank's 1/TP slice of them),
    (EP - 1)/EP of them leaving the rank, twice in forward, twice in backward and twice more in a checkpointed
    layer's recomputed forward; over NVLink when the group (EP x TP consecutive ranks) fits in a node, else
    over the network. 0 at EP 1."""
    if layout.ep <= 1 or not shape.moe:
        return 0.0
    per_stage, recomputed = stage_layers(shape, layout)
    exchanges = 4 * per_stage + 2 * recomputed
    nbytes = layout.mbs * shape.seq_length * shape.top_k * shape.hidden_size * layout.bytes_per_value * \
        (layout.ep - 1) / layout.ep / layout.tp
    within_node = layout.ep * layout.tp <= hw.gpus_per_node
    bandwidth = hw.intra_node_bandwidth_gbps if within_node else hw.inter_node_bandwidth_gbps
    return layout.num_microbatches * exchanges * nbytes / (bandwidth * GB)


@dataclass(frozen=True)
class DataParallelTraffic:
    """The data-parallel collectives of one step as the trial engines run them, each an all-gather or a
    reduce-scatter (an all-reduce is two) of the stage's weights (``*_gathers``: every sharded weight, trained
    or frozen) or of its trained parameters (the rest), by the compute they overlap."""

    forward_gathers: float = 0.0  # per micro-batch, prefetched layer by layer during its forward
    backward_gathers: float = 0.0  # per micro-batch, during its backward (ZeRO-3 and DeepSpeed's recompute)
    backward_reduces: float = 0.0  # per micro-batch, each layer's gradients reduce-scattered during its backward
    step_gathers: float = 0.0  # once per step, during the first micro-batch's forward (PP over FSDP2)
    step_reduces: float = 0.0  # once per step, during the last micro-batch's backward (gradient all-reduce: 2)
    step_after: float = 0.0  # once per step after the optimizer, exposed (DeepSpeed ZeRO-2's updated weights)


def dp_traffic(shape: Shape, layout: Layout) -> DataParallelTraffic:
    """The engine's data-parallel collectives of one step (``DataParallelTraffic``):

    - ZeRO 0-1: one all-reduce of the gradients per step (2), bucket by bucket during the last micro-batch's
      backward: DDP skips the reduction on all but the last micro-batch, DeepSpeed reduces at the accumulation
      boundary;
    - PP over the torch engine's FSDP2: the schedule gathers the stage once and reduces once per step;
    - ZeRO-2: torch (FSDP2 keeping the gathered weights from forward to backward) gathers in each forward and
      reduce-scatters in each backward; DeepSpeed reduce-scatters in each backward and gathers the updated
      weights once after the step;
    - ZeRO-3: a gather in forward and one in backward, a reduce-scatter in backward; DeepSpeed gathers a
      checkpointed layer once more for its recompute forward (the checkpointed share of the layers), where
      FSDP2 recomputes inside the backward's gather."""
    if layout.zero_stage <= 1:
        return DataParallelTraffic(step_reduces=2.0)
    facts = engine_facts(layout.engine)
    if facts.pipeline_defers_reshard and layout.pp > 1:
        return DataParallelTraffic(step_gathers=1.0, step_reduces=1.0)
    if layout.zero_stage == 2:
        if facts.zero2_gathers_each_forward:
            return DataParallelTraffic(forward_gathers=1.0, backward_reduces=1.0)
        return DataParallelTraffic(backward_reduces=1.0, step_after=1.0)
    per_stage, recomputed = stage_layers(shape, layout)
    recompute = recomputed / per_stage if facts.recompute_gathers else 0.0
    return DataParallelTraffic(forward_gathers=1.0, backward_gathers=1.0 + recompute, backward_reduces=1.0)


def dp_collectives(shape: Shape, layout: Layout) -> float:
    """All-gathers and reduce-scatters of one step (``dp_traffic``), m micro-batches per replica."""
    t, m = dp_traffic(shape, layout), layout.num_microbatches
    return m * (t.forward_gathers + t.backward_gathers + t.backward_reduces) + t.step_gathers + t.step_reduces + \
        t.step_after


def collective_s(nbytes: float, ranks: int, per_node: int, hw: Hardware) -> float:
    """Seconds of one all-gather or reduce-scatter of ``nbytes`` (the gathered whole) over ``ranks`` GPUs,
    ``per_node`` of them on each node: hierarchically, the part within a node over NVLink ((k - 1)/k of the
    bytes at the intra-node bandwidth) and the part between the n nodes over the node's aggregate network
    ((n - 1)/n of the bytes over the k GPUs' NICs), as NCCL's rings and trees spread a collective over every
    NIC of a node. 0 over one rank."""
    if ranks <= 1:
        return 0.0
    k = max(1, min(ranks, per_node))
    n = -(-ranks // k)
    intra = (k - 1) / k * nbytes / (hw.intra_node_bandwidth_gbps * GB)
    inter = (n - 1) / n * nbytes / (k * hw.inter_node_bandwidth_gbps * GB) if n > 1 else 0.0
    return intra + inter


def zero_ranks_per_node(layout: Layout, hw: Hardware, num_nodes: int) -> int:
    """Of the DP x CP ranks holding the same weights, how many share a node: all of them on one node; else
    the layout's GPUs on a node over TP (the mesh is (pp, dp, cp, tp), TP innermost: each node holds its GPUs / TP
    of a TP rank's data-parallel peers)."""
    if num_nodes <= 1:
        return layout.zero_ranks
    per_node = min(hw.gpus_per_node, max(1, layout.gpus // num_nodes))  # the layout's GPUs spread over its nodes
    return max(1, min(layout.zero_ranks, per_node // layout.tp))



def dp_comm_s(shape: Shape, layout: Layout, hw: Hardware, num_nodes: int) -> float:
    """Exposed data-parallel communication per step (``dp_traffic``). Each collective costs ``collective_s``
    over the ZeRO ranks (DP x CP; a mixture of experts' routed experts over the DP / EP ranks holding them):
    gathers of the weights in the training precision, reductions of the trained gradients at the engine's
    ``reduce_bytes`` (with ``master_weights`` bf16 in the training precision: no fp32 copy to reduce). The
    engines overlap them with compute layer by layer (FSDP2 prefetches the next layer's gather and
    reduce-scatters each layer's gradients as its backward ends; DeepSpeed's overlap_comm likewise),
    so each phase exposes what outruns the compute it overlaps, plus one layer's share that nothing hides (the
    first gather, the last reduction): a forward's gathers its forward, a backward's gathers and
    reduce-scatters its backward (and recompute), once-a-step collectives the first forward or the last
    backward; DeepSpeed ZeRO-2's gather after the optimizer is exposed whole."""
    if layout.zero_ranks == 1:
        return 0.0
    t, m = dp_traffic(shape, layout), layout.num_microbatches
    params = _local_parameters(shape, layout)
    # routed experts are gathered and reduced over the DP / EP ranks holding the same experts
    experts = _local_expert_parameters(shape, layout) if layout.ep > 1 else 0.0
    dense = params - experts
    adapted = layout.adapted
    trained = dense if not adapted else \
        shape.pipeline_layers / layout.pp * adapter_parameters(shape, layout.lora) / layout.tp
    per_node = zero_ranks_per_node(layout, hw, num_nodes)
    bpv = layout.bytes_per_value
    rbytes = bpv if layout.master_weights == "bf16" else engine_facts(layout.engine).reduce_bytes or bpv

    def gather(count: float) -> float:  # the weights, trained or frozen
        if not count:
            return 0.0
        return count * (collective_s(dense * bpv, layout.zero_ranks, per_node, hw) +
                        collective_s(experts * bpv, layout.edp, per_node, hw))

    def reduce(count: float) -> float:  # the trained gradients
        if not count:
            return 0.0
        return count * (collective_s(trained * rbytes, layout.zero_ranks, per_node, hw) +
                        (0.0 if adapted else collective_s(experts * rbytes, layout.edp, per_node, hw)))

    compute = (compute_s(shape, layout, hw) + elementwise_s(shape, layout, hw)) / m  # one micro-batch's kernels
    per_stage, recomputed = stage_layers(shape, layout)
    backward = (1.0 if adapted else 2.0) + recomputed / per_stage
    forward_s, backward_s = compute / (1 + backward), compute * backward / (1 + backward)

    def exposed(comm: float, hidden_by: float) -> float:
        return max(0.0, comm - hidden_by) + comm / per_stage

    per_microbatch = exposed(gather(t.forward_gathers), forward_s) + \
        exposed(gather(t.backward_gathers) + reduce(t.backward_reduces), backward_s)
    once = exposed(gather(t.step_gathers), forward_s) + exposed(reduce(t.step_reduces), backward_s) + \
        reduce(t.step_after)
    return m * per_microbatch + once


def offload_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Seconds per step spent moving the offloaded shard over PCIe and stepping it on the CPU, as the engine moves
    it (``offload_pcie_bytes``), and the CPU's Adam step of the trained shard at the node's rate shared by its GPUs.
    Under LoRA only the adapters are stepped and their gradients moved (the frozen base has none)."""
    if layout.offload == "none":
        return 0.0
    trained = _offloaded_trained(shape, layout)
    cpu_step = trained / (cpu_adam_params_per_s(hw) / hw.gpus_per_node)  # the node's GPUs share its host
    return offload_pcie_bytes(shape, layout) / (hw.pcie_bandwidth_gbps * GB) + cpu_step


def _offloaded_trained(shape: Shape, layout: Layout) -> float:
    """The trained parameters of the rank's offloaded shard: the whole shard, or under LoRA its adapters (the
    rank's share of its stage's, ``memory.host_phases_gib``'s count)."""
    if layout.adapted:
        return (shape.pipeline_layers / layout.pp * adapter_parameters(shape, layout.lora) / layout.tp
                / layout.zero_ranks)
    return layout.shard(_local_parameters(shape, layout), _local_expert_parameters(shape, layout))


def offload_pcie_bytes(shape: Shape, layout: Layout) -> float:
    """Bytes one GPU moves over PCIe per step under offload, as its engine moves them:

    - gradients down: once per micro-batch where the engine adds them on the host
      (``offloads_moving_each_microbatch``: FSDP2's parameter offload, ZeRO-Offload), else once per step (the
      torch engine's optimizer offload keeps them sharded on the GPU until the host step); in the engine's reduce
      dtype under its parameter offload (FSDP2's fp32 master), else in the training precision;
    - optimizer-only offload: the updated weights up once per step, in the training precision;
    - parameter offload: the shard up for each gather, every micro-batch's forward and, at ZeRO-3, its backward
      (ZeRO-2 keeps the gathered layer from forward to backward), its trained part at ``offload_upload_bytes``
      (FSDP2's fp32 master) and a frozen base at the training precision."""
    facts = engine_facts(layout.engine)
    bpv, m = layout.bytes_per_value, layout.num_microbatches
    trained = _offloaded_trained(shape, layout)
    moves = m if layout.offload in facts.offloads_moving_each_microbatch else 1
    if layout.offload != "optimizer_and_params":
        return bpv * trained * moves + bpv * trained
    shard = layout.shard(_local_parameters(shape, layout), _local_expert_parameters(shape, layout))
    gathers = m * (2 if layout.zero_stage >= 3 else 1)
    return ((facts.reduce_bytes or bpv) * trained * moves
            + gathers * ((facts.offload_upload_bytes or bpv) * trained + bpv * (shard - trained)))


def cpu_adam_params_per_s(hw: Hardware) -> float:
    """Parameters per second the node's host CPUs step with Adam, all its GPUs' processes together: its threads
    (``host_cpu_cores``) at ``CPU_ADAM_PARAMS_PER_S_PER_THREAD``, at most what the host's memory streams
    (``host_memory_bandwidth_gbps`` x ``STREAM_FRACTION`` / ``CPU_ADAM_HOST_BYTES``; ``CPU_ADAM_MAX_PARAMS_PER_S``
    where unknown); ``CPU_ADAM_PARAMS_PER_S`` where the threads are unknown. A 16-thread g5.4xlarge steps 6.7e8 per
    second, a 96-thread p4d 4e9, a 192-thread g5.48xlarge 8e9, a 256-thread DGX A100 1e10 (its memory's ceiling)."""
    if hw.host_cpu_cores is None:
        return CPU_ADAM_PARAMS_PER_S
    ceiling = CPU_ADAM_MAX_PARAMS_PER_S if hw.host_memory_bandwidth_gbps is None else \
        STREAM_FRACTION * hw.host_memory_bandwidth_gbps * 1e9 / CPU_ADAM_HOST_BYTES
    return min(CPU_ADAM_PARAMS_PER_S_PER_THREAD * hw.host_cpu_cores, ceiling)


def tp_allreduce_bytes(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Bytes all-reduced over TP per micro-batch on the busiest stage: one layer activation for each
    sub-layer (attention and MLP; a T5 decoder layer adds cross-attention) in forward and in backward,
    and again in the recomputed forward of a checkpointed layer."""
    per_token = shape.hidden_size * layout.bytes_per_value * layout.mbs
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
    compute, elementwise = compute_s(shape, layout, hw), elementwise_s(shape, layout, hw)
    bubble = (compute + elementwise) * (layout.pp - 1) / (layout.virtual_stages * m)
    rank = rank_shape(shape, layout)  # the tokens of each sequence a rank holds

    tp_bw = hw.intra_node_bandwidth_gbps if layout.tp <= hw.gpus_per_node else hw.inter_node_bandwidth_gbps
    # the share of the collectives a stack overlaps with the GEMMs beside them does not show
    tp_comm = m * _ring_allreduce_s(tp_allreduce_bytes(rank, layout, hw), layout.tp, tp_bw) * (1 - hw.tp_comm_hidden)

    pp_comm = 0.0
    if layout.pp > 1:
        spans_nodes = layout.model_parallel > hw.gpus_per_node
        pp_bw = hw.inter_node_bandwidth_gbps if spans_nodes else hw.intra_node_bandwidth_gbps
        # an encoder-decoder's stages pass the encoder's and the decoder's hidden states
        tokens = rank.seq_length + (shape.decoder_seq_length or 0)
        boundary_bytes = layout.mbs * tokens * shape.hidden_size * layout.bytes_per_value
        crossings = layout.virtual_stages * (m + layout.pp - 1)  # each micro-batch crosses v times more
        pp_comm = 2 * crossings * boundary_bytes / layout.tp / (pp_bw * GB)

    dequant, fp8_cast = dequant_s(shape, layout, hw), fp8_cast_s(shape, layout, hw)
    # the GPU runs the kernels behind the host's dispatch of them: the host shows where it takes longer
    host = max(0.0, host_s(shape, layout, hw) - (compute + dequant + fp8_cast + elementwise))
    return StepTimeEstimate(compute, bubble, tp_comm, pp_comm, dp_comm_s(shape, layout, hw, num_nodes),
                            offload_s(shape, layout, hw), dequant, ep_comm_s(shape, layout, hw),
                            cp_comm_s(shape, layout, hw), activation_offload_s(shape, layout, hw), fp8_cast, host,
                            elementwise)


def cp_comm_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Exposed seconds per step of context parallelism's ring (0 at CP 1). Each layer's attention passes its
    key/value block (the rank's seq / CP tokens, the TP rank's key/value heads) CP - 1 hops in forward and in
    a checkpointed layer's recomputed forward, and in backward the blocks with their key/value gradients
    (twice the bytes) CP hops, the last bringing the gradients home. Each hop overlaps the attention over
    the block the last one brought: the attention's share of the layer's FLOPs (scores and their product with
    the values) over the rank's tokens against the whole sequence at ``attention_efficiency``, the flash backward
    2.5 times the forward; the hops cost what they exceed it by. Over NVLink when the ring (CP x TP consecutive ranks) fits in a node."""
    if layout.cp == 1:
        return 0.0
    cp, tp, b = layout.cp, layout.tp, layout.mbs
    local = shape.seq_length / cp
    block = 2 * b * local * shape.kv_dim / tp * layout.bytes_per_value  # one rank's keys and values
    bandwidth = hw.intra_node_bandwidth_gbps if cp * tp <= hw.gpus_per_node else hw.inter_node_bandwidth_gbps
    hop_s = block / (bandwidth * GB)
    # the attention over one received block: 2·2·(rank tokens)·(block tokens)·(attention width / TP) FLOPs
    attention_flops = 4 * b * local * local * shape.attention_dim / tp
    rate = hw.peak_tflops * 1e12 * attention_efficiency(shape, layout, hw)
    forward = (cp - 1) * max(0.0, hop_s - attention_flops / rate)
    backward = cp * max(0.0, 2 * hop_s - FLASH_BACKWARD * attention_flops / rate)
    per_stage, recomputed = stage_layers(shape, layout)
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


# Bytes of GPU memory traffic per element of a Float8 linear's input, output gradient and weight, per micro-batch
# (torchao's dynamic tensorwise scaling, eager): each is read for its amax (2 bytes), read again and written in
# fp8 (2 + 1), and its fp8 copy transposed for the backward's other matmul (1 + 1).
FP8_CAST_BYTES = 7


def fp8_cast_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Float8 linears' casts and scale bookkeeping per step: for each linear of the stage's layers (and each
    recomputed one's forward), every micro-batch's input, output gradient and weight amax-scanned, cast and
    transposed (``FP8_CAST_BYTES``), bound by the GPU's memory bandwidth; 0 without fp8."""
    if not layout.fp8:
        return 0.0
    linears = linear_shapes(shape).values()
    per_stage, recomputed = stage_layers(shape, layout)
    tokens = layout.mbs * shape.seq_length / layout.cp
    layer_bytes = FP8_CAST_BYTES * (tokens * sum(i + o for i, o in linears) + sum(i * o for i, o in linears))
    layers = per_stage + recomputed / 2  # a recomputed forward casts again
    return layout.num_microbatches * layers * layer_bytes / layout.tp / (hw.memory_bandwidth_gbps * GB)


def dequant_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """QLoRA's dequantisation per step: every micro-batch's forward and backward (and the recompute of a
    checkpointed layer) read each 4-bit weight of the stage's layers and write its 16-bit copy, bound by
    the GPU's memory bandwidth. 0 for the other methods."""
    if layout.method != "qlora":
        return 0.0
    per_stage, recomputed = stage_layers(shape, layout)
    passes = 2 * per_stage + recomputed  # layers dequantised per micro-batch
    nbytes = passes * linear_parameters(shape) / layout.tp * (NF4_BITS / 8 + layout.bytes_per_value)
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
