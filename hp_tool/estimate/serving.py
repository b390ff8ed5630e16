"""The serving-time model: how fast a layout serves requests, one function per term. Pure, no torch.

A server holds the model's weights split over TP x PP GPUs and a KV cache of the requests in flight. For a batch
of ``concurrency`` requests of ``input_len`` prompt and ``output_len`` generated tokens:

- prefill (``prefill_s``): the prompts' forward pass, compute-bound: 2 FLOPs per active parameter per token plus
  the causal attention, quadratic in the prompt, at a fraction of the GPU's dense peak in the weights' precision;
  no faster than reading the weights once;
- decode (``decode_step_s``): one token for every request, memory-bound at serving batch sizes: each step reads the
  weights a token touches (a mixture of experts: the experts some request of the batch routes to) and every
  request's KV cache, per TP rank, at a fraction of the GPU's memory bandwidth; compute-bound once the batch's
  FLOPs take longer than that;
- TP (``tp_allreduce_s``): two all-reduces of the step's hidden states per layer, latency-bound at small batch;
- expert parallelism (``ServingLayout.expert_parallel``, vLLM's ``--enable-expert-parallel``): a mixture of experts'
  routed experts whole on the TP ranks (EP = TP) instead of a 1/TP slice of each; attention stays TP. A GPU holds the
  same share of the weights (``expert_excess_parameters``: more on the busiest rank where TP does not divide the
  experts) and a decode step waits for the rank whose experts the batch routes to most
  (``ep_expert_read_parameters``). With one replica (DP 1) vLLM runs no all-to-all: every TP rank holds every token
  after the attention, runs its own experts on those routed to them, and the MoE layer's output is summed by the
  all-reduce it has without EP (vLLM's ``FusedMoEParallelConfig.use_all2all_kernels`` needs DP > 1), so
  ``tp_allreduce_s`` prices both;
- PP (``pp_handoff_s``): a request's hidden states handed from stage to stage, its stages run one after another;
- KV cache capacity (``kv_capacity_tokens``): what the GPU holds beside the weights and the framework's overhead,
  at the KV cache's precision; the largest concurrency that fits (``max_concurrency``);
- quantised weights (fp8, int8, int4, fp4: bytes per parameter, and the peak the GEMMs run at) and the KV cache's
  precision (bf16 / fp16 / fp8).

``serving_time`` puts them together: time to first token (the batch's prefill), time per output token (a decode
step at the mean context), request latency (prefill plus ``output_len - 1`` steps) and output tokens per second,
of the system and per GPU. The efficiencies (``ServingEfficiency``) are fitted on published serving runs
(benchmarks/published_serving_runs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hp_tool.architectures import active_parameters, count_parameters, expert_parameters
from hp_tool.families.shape import Shape

GIB = 2 ** 30
# bytes per weight by the served model's weight format
WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "fp4": 0.5}
KV_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0}
# the dense peak a weight format's GEMMs run at (the peak_tflops key): fp8 on fp8 tensor cores; weight-only int8 /
# int4 dequantise into 16-bit GEMMs
GEMM_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8": "fp8", "int8": "fp16", "int4": "fp16",
                  "fp4": "fp8"}
WEIGHT_FORMATS = tuple(WEIGHT_BYTES)
KV_FORMATS = tuple(KV_BYTES)


@dataclass(frozen=True)
class ServingGpu:
    """What the model reads of a GPU: its memory, its memory bandwidth, its dense peaks by precision and its
    NVLink bandwidth (all per GPU)."""

    memory_gib: float
    memory_bandwidth_gbps: float  # GB/s
    peak_tflops: dict  # precision -> dense TFLOPS (None where the GPU has none)
    intra_node_bandwidth_gbps: float  # GB/s per direction
    memory_overhead_gib: float = 3.0  # the framework's own: CUDA context, allocator, communication buffers

    def peak(self, weights: str) -> float:
        """The dense peak the GEMMs of ``weights`` run at: its precision's, else 16-bit's."""
        return self.peak_tflops.get(GEMM_PRECISION[weights]) or self.peak_tflops.get("fp16") or \
            self.peak_tflops["bf16"]


@dataclass(frozen=True)
class ServingEfficiency:
    """The fractions of the GPU's peaks a serving engine reaches, and its fixed costs: fitted on 719 published
    serving runs of FasterTransformer, TensorRT-LLM, LMDeploy, vLLM, Megatron-LM and NVIDIA NIM on A100, H100, H200
    and L40S (``python3 benchmarks/published_serving_runs.py --fit``, which also prints the refits leaving each
    engine out). FasterTransformer's 346 runs weigh most: its all-reduces and steps cost more than a CUDA-graphed
    engine's (fitted without it: allreduce_s 3e-05)."""

    bandwidth: float = 0.867  # of the memory bandwidth, a decode step's reads
    compute: float = 0.526  # of the dense peak, the prefill's GEMMs and attention
    allreduce_s: float = 6.43e-05  # one all-reduce's latency within a node (NVLink), the kernels around it included
    step_s: float = 2.66e-03  # a step's fixed cost (kernel launches, sampling, the scheduler)
    memory_utilization: float = 0.9  # of the GPU's memory the engine takes for weights and KV cache (vLLM's default)


@dataclass(frozen=True)
class ServingLayout:
    """One serving layout: its parallel degrees, the requests in flight and their lengths, the weights' and the KV
    cache's formats."""

    tp: int
    pp: int
    concurrency: int  # requests in flight (a static batch's size, a continuous-batching server's running ones)
    input_len: int
    output_len: int
    weights: str = "bf16"  # WEIGHT_FORMATS
    kv_cache: str = "bf16"  # KV_FORMATS
    # static: one batch prefilled together, then decoded together (FasterTransformer's, vLLM's latency benchmark);
    # continuous: requests join as others finish, a step decoding the running ones and prefilling those joining
    # (vLLM's and TensorRT-LLM's servers, their throughput benchmarks)
    batching: str = "static"
    # a mixture of experts' routed experts whole on the TP ranks (EP = TP; vLLM's --enable-expert-parallel) instead
    # of a 1/TP slice of every expert
    expert_parallel: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def ep(self) -> int:
        """The ranks the experts are split over whole: TP with expert parallelism, else 1."""
        return self.tp if self.expert_parallel else 1


@dataclass(frozen=True)
class ServingTime:
    """The model's prediction for a layout (seconds, tokens per second)."""

    ttft_s: float  # time to first token: the batch's prefill
    tpot_s: float  # time per output token: a decode step at the mean context
    latency_s: float  # a request's: prefill and output_len - 1 decode steps
    tokens_per_s: float  # output tokens per second of the whole layout
    tokens_per_s_per_gpu: float
    weights_gib: float  # per GPU
    kv_cache_gib: float  # per GPU, at this concurrency and the full length
    max_concurrency: int  # requests of this length the KV cache holds

    @property
    def memory_gib(self) -> float:
        return self.weights_gib + self.kv_cache_gib


def weight_bytes_per_gpu(shape: Shape, layout: ServingLayout) -> float:
    """The weights one GPU holds: the whole model split over TP x PP, in the weights' format; with expert parallelism
    the busiest rank's whole experts beyond that share (``expert_excess_parameters``) on its stage's layers."""
    excess = shape.num_layers / layout.pp * expert_excess_parameters(shape, layout.tp, layout.expert_parallel)
    return count_parameters(shape) * WEIGHT_BYTES[layout.weights] / layout.gpus + excess * WEIGHT_BYTES[layout.weights]


def experts_per_gpu(shape: Shape, ep: int) -> int:
    """Routed experts of a layer the busiest of ``ep`` ranks holds whole: ceil(experts / EP) (vLLM gives the first
    experts mod EP ranks one more)."""
    return -(-shape.num_experts // ep)


def expert_excess_parameters(shape: Shape, tp: int, expert_parallel: bool) -> float:
    """One layer's routed-expert parameters the busiest GPU holds beyond a 1/TP share of them: with expert
    parallelism, ceil(experts / TP) whole experts less experts / TP of them; 0 without it, or where TP divides the
    experts (the same total, in whole experts); 0 for a dense model."""
    if not expert_parallel or not shape.moe:
        return 0.0
    return (experts_per_gpu(shape, tp) - shape.num_experts / tp) * expert_parameters(shape) / shape.num_experts


def kv_bytes_per_token(shape: Shape, layout: ServingLayout) -> float:
    """KV cache of one token on one GPU, in the layout's KV cache format (``kv_token_bytes``)."""
    return kv_token_bytes(shape, layout.tp, layout.pp, KV_BYTES[layout.kv_cache])


def kv_token_bytes(shape: Shape, tp: int, pp: int, bytes_per_value: float) -> float:
    """KV cache of one token on one GPU: keys and values of its stage's layers, its TP share of the kv heads (a
    kv head is never split: with TP above the kv heads each rank keeps one)."""
    return 2 * (shape.num_layers / pp) * max(1.0, shape.num_kv_heads / tp) * shape.head_dim * bytes_per_value


def kv_capacity_tokens(shape: Shape, layout: ServingLayout, gpu: ServingGpu, eff: ServingEfficiency) -> float:
    """Tokens the KV cache holds on the busiest GPU: the engine's share of its memory less the weights and the
    framework's overhead (0 when the weights do not fit)."""
    free = gpu.memory_gib * eff.memory_utilization * GIB - weight_bytes_per_gpu(shape, layout) - \
        gpu.memory_overhead_gib * GIB
    return max(0.0, free / kv_bytes_per_token(shape, layout))


def max_concurrency(shape: Shape, layout: ServingLayout, gpu: ServingGpu, eff: ServingEfficiency) -> int:
    """Requests of the layout's full length (prompt and output) the KV cache holds at once."""
    return int(kv_capacity_tokens(shape, layout, gpu, eff) // (layout.input_len + layout.output_len))


def routed_share(shape: Shape, batch: int) -> float:
    """The chance that some of ``batch`` tokens, picking ``top_k`` of the experts each (uniformly routed), routes to a
    given expert."""
    return 1 - (1 - shape.top_k / shape.num_experts) ** batch


def non_expert_parameters(shape: Shape) -> float:
    """Parameters every token runs through: all but the layers' routed experts."""
    return count_parameters(shape) - shape.num_layers * expert_parameters(shape)


def touched_weight_parameters(shape: Shape, batch: int) -> float:
    """Parameters a decode step over ``batch`` tokens reads: all of a dense model; of a mixture of experts, what
    every token runs through and, per layer, the experts some token routes to (the expected number of distinct
    experts ``batch`` tokens picking ``top_k`` each touch, uniformly routed)."""
    if not shape.moe:
        return float(count_parameters(shape))
    experts = shape.num_experts
    per_expert = expert_parameters(shape) / experts
    touched = experts * routed_share(shape, batch)
    return non_expert_parameters(shape) + shape.num_layers * touched * per_expert


def busiest_rank_experts(experts: int, share: float, ranks: int) -> float:
    """Expected distinct experts the busiest of ``ranks`` GPUs reads, each holding ``experts`` of them and each
    expert routed to with probability ``share``: the largest of ``ranks`` binomial(experts, share) counts, taken as
    independent (E[max] = sum over x >= 1 of 1 - P(count < x)^ranks)."""
    below, total = 0.0, 0.0
    for x in range(1, experts + 1):
        below += math.comb(experts, x - 1) * share ** (x - 1) * (1 - share) ** (experts - x + 1)
        total += 1 - min(1.0, below) ** ranks
    return total


def ep_expert_read_parameters(shape: Shape, layout: ServingLayout, batch: int) -> float:
    """Routed-expert parameters the busiest GPU reads in a decode step over ``batch`` tokens with expert
    parallelism, every layer: whole experts, of the ceil(experts / EP) it holds, that some token routes to, on the
    rank with the most of them (``busiest_rank_experts``). Without it a rank reads a 1/TP slice of every routed
    expert (``touched_weight_parameters`` / TP): the same where the batch touches every expert, less where it
    touches a few, which then sit on one rank whole."""
    held = experts_per_gpu(shape, layout.ep)
    per_expert = expert_parameters(shape) / shape.num_experts
    return shape.num_layers * busiest_rank_experts(held, routed_share(shape, batch), layout.ep) * per_expert


def decode_weight_bytes(shape: Shape, layout: ServingLayout, batch: int) -> float:
    """Weight bytes the busiest GPU reads in a decode step over ``batch`` tokens: a 1/TP share of what the step
    touches; with expert parallelism a 1/TP share of what every token runs through and its own routed experts
    whole (``ep_expert_read_parameters``)."""
    if not layout.expert_parallel:
        return touched_weight_parameters(shape, batch) * WEIGHT_BYTES[layout.weights] / layout.tp
    return (non_expert_parameters(shape) / layout.tp + ep_expert_read_parameters(shape, layout, batch)) * \
        WEIGHT_BYTES[layout.weights]


def attention_flops(shape: Shape, queries: int, context: float) -> float:
    """FLOPs of the attention scores and their weighted sum for ``queries`` tokens over ``context`` keys each."""
    return 4 * shape.num_layers * queries * context * shape.num_attention_heads * shape.head_dim


def microbatches(layout: ServingLayout) -> list[int]:
    """How the pipeline may split the requests in flight: 1 (a batch through the stages in turn), and with PP the
    powers of two from PP up to the requests, so that the stages work on different micro-batches at once."""
    if layout.pp == 1:
        return [1]
    out, m = [1], layout.pp
    while m <= layout.concurrency:
        out.append(m)
        m *= 2
    return out


def pipelined_s(layout: ServingLayout, one_pass_s, handoff_s) -> float:
    """The fastest way through the pipeline (``microbatches``): m micro-batches of the requests take m + PP - 1
    stage times, a stage time being 1/PP of one micro-batch's pass through every layer (``one_pass_s(requests)``) and
    its hand-off to the next stage (``handoff_s(requests)``)."""
    best = math.inf
    for m in microbatches(layout):
        requests = -(-layout.concurrency // m)
        stage = one_pass_s(requests) / layout.pp + (handoff_s(requests) if layout.pp > 1 else 0.0)
        best = min(best, (m + layout.pp - 1) * stage)
    return best


def prefill_pass_s(shape: Shape, layout: ServingLayout, gpu: ServingGpu, eff: ServingEfficiency,
                   requests: int) -> float:
    """``requests`` prompts through every layer: their FLOPs (2 per active parameter per token, and the causal
    attention over the prompt, half the square) over the TP ranks at ``eff.compute`` of the peak, at least one read
    of the weights, and the TP all-reduces."""
    tokens = requests * layout.input_len
    flops = 2 * active_parameters(shape) * tokens + attention_flops(shape, tokens, layout.input_len / 2)
    compute = flops / (layout.tp * gpu.peak(layout.weights) * 1e12 * eff.compute)
    read = weight_bytes_per_gpu(shape, layout) * layout.pp / (gpu.memory_bandwidth_gbps * 1e9 * eff.bandwidth)
    return max(compute, read) + tp_allreduce_s(shape, layout, tokens, gpu, eff)


def prefill_s(shape: Shape, layout: ServingLayout, gpu: ServingGpu, eff: ServingEfficiency) -> float:
    """Time to first token. A static batch: every prompt's prefill, through the pipeline (``pipelined_s``). Continuous
    batching: the request's own prompt, prefilled in the step it joins."""
    if layout.batching == "continuous":
        return prefill_pass_s(shape, layout, gpu, eff, 1) + pp_handoff_s(shape, layout, layout.input_len, gpu, eff) + \
            eff.step_s
    return pipelined_s(layout, lambda r: prefill_pass_s(shape, layout, gpu, eff, r),
                       lambda r: pp_handoff_s(shape, layout, r * layout.input_len, gpu, eff) / (layout.pp - 1)) + \
        eff.step_s


def decode_pass_s(shape: Shape, layout: ServingLayout, gpu: ServingGpu, eff: ServingEfficiency, requests: int,
                  context: float) -> float:
    """One token for each of ``requests`` requests through every layer: the weights they touch
    (``decode_weight_bytes``) and their KV cache at ``context`` tokens read per TP rank at ``eff.bandwidth`` of the
    memory bandwidth, or their FLOPs at ``eff.compute`` of the peak when those take longer; and the TP all-reduces."""
    weights = decode_weight_bytes(shape, layout, requests)
    kv = requests * context * kv_bytes_per_token(shape, layout) * layout.pp
    read = (weights + kv) / (gpu.memory_bandwidth_gbps * 1e9 * eff.bandwidth)
    flops = 2 * active_parameters(shape) * requests + attention_flops(shape, requests, context)
    compute = flops / (layout.tp * gpu.peak(layout.weights) * 1e12 * eff.compute)
    return max(read, compute) + tp_allreduce_s(shape, layout, requests, gpu, eff)


def joining_prefill_s(shape: Shape, layout: ServingLayout, gpu: ServingGpu, eff: ServingEfficiency) -> float:
    """Continuous batching at a steady state: the prompts that join each step (concurrency / output_len requests
    finish, and as many start), prefilled in the same step: their FLOPs at ``eff.compute`` of the peak (the step
    reads the weights once for both)."""
    tokens = layout.concurrency * layout.input_len / layout.output_len
    flops = 2 * active_parameters(shape) * tokens + attention_flops(shape, tokens, layout.input_len / 2)
    return flops / (layout.tp * gpu.peak(layout.weights) * 1e12 * eff.compute)


def decode_step_s(shape: Shape, layout: ServingLayout, gpu: ServingGpu, eff: ServingEfficiency,
                  context: Optional[float] = None) -> float:
    """Time per output token: one token for every request in flight at ``context`` tokens (default: the mean over
    the output, input + output / 2), through the pipeline (``pipelined_s``), with the step's fixed cost; continuous
    batching adds the prompts that join each step (``joining_prefill_s``)."""
    context = layout.input_len + layout.output_len / 2 if context is None else context
    step = pipelined_s(layout, lambda r: decode_pass_s(shape, layout, gpu, eff, r, context),
                       lambda r: pp_handoff_s(shape, layout, r, gpu, eff) / (layout.pp - 1)) + eff.step_s
    if layout.batching == "continuous":
        step += joining_prefill_s(shape, layout, gpu, eff)
    return step


def tp_allreduce_s(shape: Shape, layout: ServingLayout, tokens: int, gpu: ServingGpu,
                   eff: ServingEfficiency) -> float:
    """Two all-reduces per layer of ``tokens`` tokens' hidden states (16-bit) over the TP ranks: each a latency
    and the ring's 2(TP-1)/TP of the bytes over NVLink; none without TP. With expert parallelism the second sums the
    EP ranks' experts' outputs instead of the TP slices' (vLLM at DP 1: no all-to-all), at the same cost."""
    if layout.tp == 1:
        return 0.0
    volume = tokens * shape.hidden_size * 2 * 2 * (layout.tp - 1) / layout.tp
    return 2 * shape.num_layers * (eff.allreduce_s + volume / (gpu.intra_node_bandwidth_gbps * 1e9))


def pp_handoff_s(shape: Shape, layout: ServingLayout, tokens: int, gpu: ServingGpu, eff: ServingEfficiency) -> float:
    """PP - 1 hand-offs of ``tokens`` tokens' hidden states (16-bit) from a stage to the next."""
    volume = tokens * shape.hidden_size * 2 / layout.tp
    return (layout.pp - 1) * (eff.allreduce_s + volume / (gpu.intra_node_bandwidth_gbps * 1e9))


def serving_time(shape: Shape, layout: ServingLayout, gpu: ServingGpu,
                 eff: ServingEfficiency = ServingEfficiency()) -> ServingTime:
    """TTFT, TPOT, request latency and throughput of ``layout`` (module docstring): a static batch's tokens over
    its latency; a continuous-batching server's, every running request's token each step."""
    ttft = prefill_s(shape, layout, gpu, eff)
    tpot = decode_step_s(shape, layout, gpu, eff)
    latency = ttft + (layout.output_len - 1) * tpot
    tokens = layout.concurrency / tpot if layout.batching == "continuous" else \
        layout.concurrency * layout.output_len / latency
    kv = layout.concurrency * (layout.input_len + layout.output_len) * kv_bytes_per_token(shape, layout)
    return ServingTime(ttft, tpot, latency, tokens, tokens / layout.gpus, weight_bytes_per_gpu(shape, layout) / GIB,
                       kv / GIB, max_concurrency(shape, layout, gpu, eff))
