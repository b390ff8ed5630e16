"""Candidate grid: product of engine x TP x PP x EP x CP x virtual stages x MBS x checkpointed layers x
checkpointing mode x sequence parallel x loss x activation offload x (ZeRO stage, offload) -> validity ->
estimates -> prune -> order.

Pure planning: no I/O, no torch. Every candidate ends with a status and, unless selected, the reason:
``invalid`` (the layout cannot exist on this model and cluster, or the engine cannot run the
combination), ``pruned`` (predicted not to fit in GPU memory or host RAM), ``over_limit`` (valid and
fitting, but ranked below limit_search_runs), ``selected``.

ZeRO stage and offload: lists given in full are searched in full. Left to the heuristic (either null),
each layout searches one memory saver: of those that fit, one without offload when any fits (offload
trades speed for memory), then the one whose benchmark needs the fewest nodes (sharding more needs fewer
data-parallel ranks to fit), then the lightest (sharding.SAVING_ORDER), as a lighter saver is never
predicted slower. The lighter ones that do not fit are listed as pruned with
their numbers; the rest, and combinations the engine cannot run, are not candidates.

Long context, each list given in full is searched in full; left null (``long_context_values``):
sequence parallelism wherever it runs (it never adds time in the model and divides the norms' activations
by TP); context parallelism 1 and the powers of two leaving each rank at least ``CP_MIN_TOKENS`` tokens,
within a node with TP; the chunked loss from ``CHUNKED_LOSS_FROM`` tokens per sequence where it runs (the
same FLOPs as the whole-logits loss, which at 8K tokens and a 128K vocabulary holds 12.6 GiB per sequence); activation offload searched beside none from ``ACTIVATION_OFFLOAD_FROM`` tokens
with a host RAM figure (it costs PCIe time, so only where activations dominate memory).

Checkpointing mode, the list given in full is searched for every layout with checkpointed layers; left null
(``act_ckpt_mode_values``): full, and selective too where a layout checkpoints every layer of its stage and
selective runs, so the grid grows by one candidate per such layout.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional

from hp_tool.adaptive import SCOUT_RANGE
from hp_tool.architectures import Shape, pipeline_problem
from hp_tool.base_config import TS, Cluster
from hp_tool.config import TrainSettings
from hp_tool.calibration import values_of
from hp_tool.dimensions import BY_NAME, DIMENSIONS, regime_of
from hp_tool.estimate.layout import Hardware, Layout, Problem
from hp_tool.recipe import Degrees, Recipe
from hp_tool.estimate.memory import HostPhases, estimate_memory, host_phases_gib
from hp_tool.estimate.speed import estimate_step_time
from hp_tool.tables import ACT_CKPT_STEP, lookup
from hp_tool.sharding import SAVING_ORDER, compile_problem, fp8_problem
from hp_tool.vocab import INVALID, OFFLOADS, OVER_LIMIT, PRUNED, SELECTED, ZERO_STAGES
from hp_tool.throughput import throughput



@dataclass(slots=True)
class Candidate:
    """A layout of the full run (``full``) with the planner's verdict and predictions, and the benchmark
    trial that stands for it (its nodes, data parallelism and batch)."""

    full: Layout  # the full run's layout: its data-parallel replicas and global batch
    shape: Optional[Shape] = None  # the model at this candidate's sequence length
    trial_id: str = ""  # named once by the planner (planner.name_candidates); every file name derives from it
    status: str = SELECTED
    reason: str = ""
    reason_key: str = ""  # the config key a rejection is about
    note: str = ""  # why a heuristic default chose what it did where the engine could not do better (plan.csv)
    trial_nodes: int = 0  # nodes the benchmark trial uses (TP*PP GPUs rounded up to whole nodes)
    trial_gpus_per_node: int = 0
    trial_dp: int = 0
    trial_global_batch_size: int = 0  # the full run's per-replica batch times trial_dp
    memory_gib: Optional[float] = None  # predicted peak per GPU in the trial
    full_memory_gib: Optional[float] = None  # predicted peak per GPU in the full run
    host_memory_gib: Optional[float] = None  # predicted host RAM of the busiest node (trial or full run)
    rank0_host_memory_gib: Optional[float] = None  # predicted host RAM of rank 0's node saving the full run's model
    traced_memory_gib: Optional[float] = None  # traced peak per GPU in the trial (tensors + overhead)
    memory_check: str = "analytic"  # what the fit was judged on: traced, or analytic (and why not traced)
    step_time_s: Optional[float] = None  # predicted optimizer step of the full run
    compute_time_s: Optional[float] = None  # its compute part (matmuls, element-wise, recompute, pipeline bubble)
    comm_time_s: Optional[float] = None  # the rest: TP / PP / DP communication and offload
    tokens_per_s_per_gpu: Optional[float] = None
    model_tflops_per_gpu: Optional[float] = None
    rank: Optional[int] = None  # 1 = predicted fastest, among valid and fitting candidates

    def reject(self, status: str, key: str, reason: str) -> None:
        self.status, self.reason_key, self.reason = status, key, reason

    def layout(self, dp: int, global_batch_size: int) -> Layout:
        """This layout with ``dp`` data-parallel replicas sharing ``global_batch_size`` sequences (the full
        run's own Layout when those are its own)."""
        if (dp, global_batch_size) == (self.full.dp, self.full.global_batch_size):
            return self.full
        return self.full.replace(dp=dp, global_batch_size=global_batch_size)

    def trial_layout(self) -> Layout:
        """The layout the benchmark trial runs."""
        return self.layout(self.trial_dp, self.trial_global_batch_size)

    tp = property(lambda self: self.full.tp)
    pp = property(lambda self: self.full.pp)
    dp = property(lambda self: self.full.dp)
    mbs = property(lambda self: self.full.mbs)
    act_ckpt_layers = property(lambda self: self.full.act_ckpt_layers)
    engine = property(lambda self: self.full.engine)
    zero_stage = property(lambda self: self.full.zero_stage)
    offload = property(lambda self: self.full.offload)
    virtual_stages = property(lambda self: self.full.virtual_stages)
    optimizer = property(lambda self: self.full.optimizer)
    ep = property(lambda self: self.full.ep)
    cp = property(lambda self: self.full.cp)


@dataclass(frozen=True)
class Grid:
    tp: list[int]
    pp: list[int]
    mbs: list[int]
    act_ckpt: Optional[list[int]]  # None: heuristic values per PP
    mp_range: tuple[int, int]
    act_ckpt_step: int
    engines: list[str] = dataclasses.field(default_factory=lambda: ["torch"])
    savers: list[tuple[int, str]] = dataclasses.field(default_factory=lambda: [(3, "none")])  # (stage, offload)
    heuristic_savers: bool = False  # search one saver per layout (zero_stages/offload null)
    virtual: Optional[list[int]] = None  # virtual stages per pipeline rank; None: heuristic per PP
    optimizers: list[str] = dataclasses.field(default_factory=lambda: ["adamw"])
    master_weights: list[str] = dataclasses.field(default_factory=lambda: ["fp32"])
    ep: list[int] = dataclasses.field(default_factory=lambda: [1])  # expert-parallel sizes (mixture of experts)
    cp: list[int] = dataclasses.field(default_factory=lambda: [1])  # context-parallel sizes
    sequence_parallel: Optional[list[bool]] = None  # None: wherever it runs
    losses: Optional[list[str]] = None  # None: chunked from CHUNKED_LOSS_FROM tokens where it runs
    activation_offload: list[bool] = dataclasses.field(default_factory=lambda: [False])
    fp8: list[bool] = dataclasses.field(default_factory=lambda: [False])
    compile: Optional[list[bool]] = None  # None: compiled wherever the engine compiles the layers on a GPU
    act_ckpt_modes: Optional[list[str]] = None  # None: full, and selective where every layer is checkpointed


CP_MIN_TOKENS = 8192  # the heuristic's context parallelism leaves each rank at least this many tokens
CHUNKED_LOSS_FROM = 8192  # the heuristic's chunked loss from this many tokens per sequence
ACTIVATION_OFFLOAD_FROM = 16384  # the heuristic searches activation offload from this many tokens


def context_parallel_sizes(ts: TrainSettings, shape: Shape, gpus_per_node: int) -> list[int]:
    """CP sizes to search: the user's list; else 1, and for a family whose attention the engine splits the
    powers of two that leave each rank at least CP_MIN_TOKENS tokens and fit in a node."""
    if ts.context_parallel_sizes is not None:
        return list(ts.context_parallel_sizes)
    if not shape.facts.context_parallel:
        return [1]
    return [c for c in (1, 2, 4, 8, 16, 32) if c == 1 or (shape.seq_length // c >= CP_MIN_TOKENS
                                                          and c <= gpus_per_node)]


def compile_values(grid: Grid, layout: Layout, hw: Hardware) -> tuple[list[bool], str]:
    """The compile values to search for a layout, and why the heuristic runs it eager where it does: the
    user's list (no note); else compiled wherever the engine compiles the layout's layers on a GPU, as torchtitan
    and torchtune train, and eager on CPU processes, where Inductor's compile of each trial's layers would take
    longer than the trial's steps and fused kernels change nothing the CPU preset prices."""
    if grid.compile is not None:
        return list(grid.compile), ""
    if hw.device_is_host:
        return [False], "eager: CPU processes (compiling the layers would outlast a trial's steps)"
    bad = compile_problem(True, layout.engine, layout.tp)
    return ([False], f"eager: {bad}") if bad else ([True], "")


def long_context_values(grid: Grid, shape: Shape, layout: Layout) -> list[tuple[bool, str]]:
    """(sequence parallel, loss) pairs to search for a layout: the user's lists, or the heuristic's one
    pair: sequence parallelism and the chunked loss (from CHUNKED_LOSS_FROM tokens) where each runs."""
    def runs(**change) -> bool:
        return layout.replace(**change).sequence_problem(shape) is None

    sps = grid.sequence_parallel if grid.sequence_parallel is not None else \
        [runs(sequence_parallel=True)]
    losses = grid.losses if grid.losses is not None else \
        ["chunked" if shape.seq_length >= CHUNKED_LOSS_FROM and runs(loss="chunked") else "full"]
    return [(sp, loss) for sp in sps for loss in losses]


def expert_parallel_sizes(ts: TrainSettings, shape: Shape, gpus_per_node: int) -> list[int]:
    """EP sizes to search: the user's list; for a mixture of experts 1 and the powers of two dividing its
    experts within one node (the all-to-all then stays on NVLink); 1 for a dense model."""
    if ts.expert_parallel_sizes is not None:
        return list(ts.expert_parallel_sizes)
    if not shape.moe:
        return [1]
    return [e for e in (1, 2, 4, 8, 16, 32, 64) if shape.num_experts % e == 0 and e <= max(1, gpus_per_node)]


def grid_table(shape: Shape) -> list:
    """The family's heuristic grid table: GPT-3's (seq 2048); T5's for T5 and mT5 (seq 512); Llama's for
    the shortest tabled sequence length at least the model's (the longest one beyond)."""
    return shape.facts.grid_table(shape)


def memory_savers(ts: TrainSettings, host_ram_known: bool) -> tuple[list[tuple[int, str]], bool]:
    """The (ZeRO stage, offload) pairs to search and whether the heuristic picks among them per layout.

    Both lists given: every pair. Either left null: the pairs of SAVING_ORDER the given list allows (all
    stages, and offload only with a host RAM figure), lightest first; ``_layout_candidates`` picks one per
    layout (see the module docstring)."""
    if ts.zero_stages is not None and ts.offload is not None:
        return [(z, o) for z in ts.zero_stages for o in ts.offload], False
    stages = ts.zero_stages if ts.zero_stages is not None else ZERO_STAGES
    offloads = ts.offload if ts.offload is not None else (OFFLOADS if host_ram_known else ("none",))
    return [(z, o) for z, o in SAVING_ORDER if z in stages and o in offloads], True


def build_grid(ts: TrainSettings, shape: Shape, size_b: float, host_ram_known: bool = True,
               gpus_per_node: int = 8) -> Grid:
    """Heuristic lists for the family, size and sequence length (NeMo tables) with the user's lists taking
    their place when given."""
    tp, pp, mbs, (lo, hi) = lookup(grid_table(shape), size_b, inclusive=True)
    if ts.pipeline_parallel_sizes is None:  # the heuristic keeps only PP values that split the layers
        pp = [p for p in pp if pipeline_problem(shape, p) is None] or [1]
    savers, heuristic = memory_savers(ts, host_ram_known)
    return Grid(
        tp=list(ts.tensor_parallel_sizes or tp),
        pp=list(ts.pipeline_parallel_sizes or pp),
        mbs=list(ts.micro_batch_sizes or mbs),
        act_ckpt=None if ts.act_ckpt_layers is None else list(ts.act_ckpt_layers),
        mp_range=(ts.min_model_parallel_size or lo, ts.max_model_parallel_size or hi),
        act_ckpt_step=lookup(ACT_CKPT_STEP, size_b),
        engines=list(ts.engines or ["torch"]),
        savers=savers,
        heuristic_savers=heuristic,
        virtual=None if ts.virtual_pipeline_sizes is None else list(ts.virtual_pipeline_sizes),
        optimizers=list(ts.optimizers or ["adamw"]),
        master_weights=list(ts.master_weights or ["fp32"]),
        ep=expert_parallel_sizes(ts, shape, gpus_per_node),
        cp=context_parallel_sizes(ts, shape, gpus_per_node),
        sequence_parallel=None if ts.sequence_parallel is None else list(ts.sequence_parallel),
        losses=None if ts.losses is None else list(ts.losses),
        activation_offload=list(ts.activation_offload) if ts.activation_offload is not None else
        [False, True] if host_ram_known and shape.seq_length >= ACTIVATION_OFFLOAD_FROM else [False],
        act_ckpt_modes=None if ts.act_ckpt_modes is None else list(ts.act_ckpt_modes),
        fp8=list(ts.fp8 or [False]),
        compile=None if ts.compile is None else list(ts.compile),
    )


def virtual_stage_values(grid: Grid, shape: Shape, pp: int) -> list[int]:
    """The grid's virtual stages per pipeline rank for ``pp``: the user's list (only 1 without a pipeline),
    or NeMo's choice: 1, and for a decoder-only model with PP > 2 also 2 and one layer per chunk
    (num_layers / PP), those that divide the layers per stage."""
    if grid.virtual is not None:
        return [v for v in grid.virtual if v == 1 or pp > 1] or [1]
    if shape.encoder_decoder or pp <= 2 or pipeline_problem(shape, pp) is not None:
        return [1]
    per_stage = shape.pipeline_layers // pp
    return sorted({v for v in (1, 2, per_stage) if per_stage % v == 0})


def act_ckpt_values(grid: Grid, shape: Shape, pp: int, virtual_stages: int = 1) -> list[int]:
    """The grid's checkpointed layers per stage: the user's list, or 0 to the stage's layers (both stacks'
    for an encoder-decoder) in the size's step divided by PP, interleaved in multiples of the virtual
    stages (each chunk recomputes the same number)."""
    if grid.act_ckpt is not None:
        return grid.act_ckpt
    per_stage = shape.pipeline_layers // pp if pipeline_problem(shape, pp) is None else 0
    step = max(1, grid.act_ckpt_step // pp)
    step = -(-step // virtual_stages) * virtual_stages
    return list(range(0, per_stage + 1, step))


def act_ckpt_mode_values(grid: Grid, shape: Shape, layout: Layout) -> list[str]:
    """How the grid recomputes ``layout``'s checkpointed layers: full alone when it checkpoints none (the mode
    means nothing then); the user's list; or the heuristic's: full, and selective too where the layout
    checkpoints every layer of its stage (as torchtitan applies it; fewer checkpointed layers already trade
    memory for time layer by layer) and selective runs (``Layout.checkpoint_mode_problem``)."""
    if layout.act_ckpt_layers == 0:
        return ["full"]
    if grid.act_ckpt_modes is not None:
        return list(grid.act_ckpt_modes)
    per_stage = shape.pipeline_layers // layout.pp if pipeline_problem(shape, layout.pp) is None else 0
    if layout.act_ckpt_layers != per_stage:
        return ["full"]
    selective = layout.replace(act_ckpt_mode="selective")
    return ["full", "selective"] if selective.checkpoint_mode_problem(shape) is None else ["full"]


# train_settings keys of the Layout fields a problem can name: each dimension's list, and the global batch
FIELD_KEYS = {**{d.name: d.key for d in DIMENSIONS}, "global_batch_size": "global_batch_size"}


# rules judged per (ZeRO stage, offload), not per layout
PER_SAVER_RULES = ("savers", "optimizer", "method", "expert_savers")


# the recipe's fields the rules judged per saver read
SAVER_RULE_FIELDS = ("engine", "zero_stage", "offload", "optimizer", "master_weights", "method", "lora")


def per_saver_problem(shape: Shape, layout: Layout) -> Optional[Problem]:
    """The first problem of the rules judged per saver (``PER_SAVER_RULES``) for ``layout``."""
    fields = layout.__dict__
    return _per_saver_problem(shape, layout.tp, layout.pp, layout.ep, *(fields[k] for k in SAVER_RULE_FIELDS))


@functools.lru_cache(maxsize=4096)
def _per_saver_problem(shape: Shape, tp: int, pp: int, ep: int, *recipe) -> Optional[Problem]:
    """``per_saver_problem`` of the rules, which read no more of a layout than these degrees and the recipe's
    ``SAVER_RULE_FIELDS``; cached, as every layout of the same degrees and savers asks the same."""
    layout = Layout(Degrees(tp, pp, ep=ep), Recipe(**dict(zip(SAVER_RULE_FIELDS, recipe))))
    return layout.saver_problem() or layout.optimizer_problem() or layout.method_problem(shape) or \
        layout.expert_saver_problem()


@functools.lru_cache(maxsize=4096)
def degree_reason(shape: Shape, gpus: int, gpus_per_node: int, mp_range: tuple[int, int], engine: str, tp: int,
                  pp: int, ep: int, cp: int, dp: int) -> Optional[tuple[str, str]]:
    """(train_settings key, reason) when no layout of these degrees can exist on ``gpus`` GPUs, whatever its
    micro-batch, checkpointing or savers, else None; in this order: a problem naming TP or PP (the heads, a
    node, the layers), TP*PP (*CP) not dividing the GPUs, a problem naming EP, TP*PP outside the
    model-parallel range. The rules whose problems name TP, PP or EP read no more of a layout than these
    fields; cached, as every layout of the same degrees asks the same."""
    layout = Layout.of(tp=tp, pp=pp, dp=dp, global_batch_size=dp, engine=engine, ep=ep, cp=cp)
    problems = [p for p in layout.problems(shape, gpus_per_node) if p.rule not in PER_SAVER_RULES]
    for p in problems:
        if p.field in ("tp", "pp"):
            return FIELD_KEYS[p.field], p.reason
    mp = tp * pp
    if gpus % (mp * cp):
        what = f"TP*PP={mp}" if cp == 1 else f"TP*PP*CP={mp * cp}"
        return "num_nodes", f"{what} does not divide the {gpus} GPUs"
    for p in problems:
        if p.field == "ep":
            return FIELD_KEYS[p.field], p.reason
    if not mp_range[0] <= mp <= mp_range[1]:
        return "max_model_parallel_size", f"TP*PP={mp} outside model-parallel range {list(mp_range)}"
    return None


def invalid_reason(shape: Shape, c: Candidate, cluster: Cluster, mp_range: tuple[int, int]) -> Optional[tuple[str, str]]:
    """(train_settings key, reason) when the layout cannot exist on the cluster, else None: its degrees'
    (``degree_reason``), then the rest of the Layout's own rules (but the memory savers', judged per saver)."""
    bad = degree_reason(shape, cluster.gpus, cluster.hw.gpus_per_node, tuple(mp_range), c.engine, c.tp, c.pp, c.ep,
                        c.cp, c.dp)
    if bad:
        return bad
    problems = [p for p in c.full.problems(shape, cluster.hw.gpus_per_node)
                if p.rule not in PER_SAVER_RULES and p.rule != "fp8"]
    if problems:
        return FIELD_KEYS[problems[0].field], problems[0].reason
    layout = c.full  # fp8's: the GPU's own rule (fp8 tensor cores), then the layout's
    no_fp8 = fp8_problem(shape.family, layout.fp8, layout.engine, layout.tp, layout.method, layout.precision,
                         cluster.hw.fp8_peak_tflops, cluster.gpu_name, layout.sequence_parallel)
    return (FIELD_KEYS["fp8"], no_fp8) if no_fp8 else None


@functools.cache
def trial_node_counts(mp: int, gpn: int, num_nodes: int) -> tuple[int, ...]:
    """Node counts a benchmark of a TP*PP=mp layout can use, fewest first: whole nodes holding whole
    model replicas (the fewest is ceil(mp / gpn) nodes), up to the full run's. With expert parallelism ``mp``
    is TP*PP*EP: the trial needs the EP data-parallel ranks its experts are split over."""
    fewest = math.ceil(mp / gpn)
    return (fewest, *(k for k in range(fewest + 1, num_nodes + 1) if (k * gpn) % mp == 0))


def _set_trial(c: Candidate, gpn: int, nodes: int) -> Layout:
    """The benchmark on ``nodes`` nodes, data parallelism filling them; each replica does the full run's
    per-replica work, so the step time carries over."""
    mp = c.tp * c.pp * c.cp
    c.trial_nodes = nodes
    c.trial_dp = max(1, (nodes * gpn) // mp)
    c.trial_gpus_per_node = mp * c.trial_dp // nodes
    c.trial_global_batch_size = c.full.global_batch_size // c.dp * c.trial_dp
    return c.trial_layout()


def estimate(shape: Shape, c: Candidate, cluster: Cluster, usable_gib: float,
             host_usable_gib: Optional[float] = None) -> None:
    """Fill the candidate's predicted memory (trial and full run), host RAM and full-run step time. A candidate
    over ``usable_gib`` per GPU even on the full run's nodes stops there: its memory is what prunes it, and its
    host RAM and step time (of a layout that cannot run) are left unestimated, as most of a large grid is.

    The trial runs on the fewest whole nodes on which it fits: ``usable_gib`` per GPU (a sharded stage may
    need more ranks than one model replica) and, when given, ``host_usable_gib`` per node (offloaded states
    are sharded over the trial's ranks, so a one-node trial of a run offloading over several nodes holds all
    of them); the full run's nodes at most."""
    hw, gpn = cluster.hw, cluster.hw.gpus_per_node
    full = c.full
    c.full_memory_gib = estimate_memory(shape, full, hw).total_gib
    counts = trial_node_counts(c.tp * c.pp * c.cp * c.full.ep, gpn, cluster.num_nodes)
    if c.full_memory_gib > usable_gib:  # no trial fits where the full run does not
        c.memory_gib = c.full_memory_gib
        _set_trial(c, gpn, counts[-1])
        return
    full_host = host_phases_gib(shape, full, gpn, hw)
    trial_gib: dict[int, float] = {}  # trial nodes -> predicted peak per GPU
    trial_host: dict[int, HostPhases] = {}  # trial nodes -> predicted host RAM of a node

    def trial_memory(nodes: int) -> float:
        if nodes not in trial_gib:
            trial = _set_trial(c, gpn, nodes)
            trial_gib[nodes] = c.full_memory_gib if trial is full else estimate_memory(shape, trial, hw).total_gib
        return trial_gib[nodes]

    def host_memory(nodes: int) -> HostPhases:
        if nodes not in trial_host:
            trial = _set_trial(c, gpn, nodes)
            trial_host[nodes] = full_host if trial is full and c.trial_gpus_per_node == gpn else \
                host_phases_gib(shape, trial, c.trial_gpus_per_node, hw)
        return trial_host[nodes]

    def fits(nodes: int) -> bool:
        return trial_memory(nodes) <= usable_gib and (host_usable_gib is None
                                                      or host_memory(nodes).node_gib <= host_usable_gib)

    # Memory per GPU and host RAM per node never grow with more data-parallel shards, so bisect for the first
    # count that fits (the largest when none does). The largest is the full run's own nodes: when the full run
    # does not fit, no trial does, and the bisection is skipped (as it is when there is one count).
    full_fits = host_usable_gib is None or full_host.node_gib <= host_usable_gib  # its GPU memory fits (above)
    if not full_fits or len(counts) == 1:
        nodes = counts[-1]
    else:
        first = bisect.bisect_left(counts, True, key=fits)
        nodes = counts[min(first, len(counts) - 1)]
    c.memory_gib = trial_memory(nodes)
    c.host_memory_gib = max(host_memory(nodes).node_gib, full_host.node_gib)
    _set_trial(c, gpn, nodes)
    c.rank0_host_memory_gib = full_host.save_rank0_gib
    split = estimate_step_time(shape, full, hw, cluster.num_nodes)
    step = c.step_time_s = split.total_s
    c.compute_time_s = split.compute_s + split.elementwise_s + split.bubble_s
    c.comm_time_s = step - c.compute_time_s
    rate = throughput(shape, c.full.global_batch_size, step, cluster.gpus, hw.peak_tflops, c.full.lora)
    c.tokens_per_s_per_gpu, c.model_tflops_per_gpu = rate["tokens_per_s_per_gpu"], rate["model_tflops_per_gpu"]


def _fit(shape: Shape, c: Candidate, cluster: Cluster, ts: TrainSettings) -> None:
    """Estimate a valid candidate and prune it when over GPU memory, then when over host RAM (each judged on
    the larger of the trial's and the full run's figure; the trial's nodes are chosen so that it fits
    wherever the full run does)."""
    hw = cluster.hw
    usable = hw.usable_gib(ts.memory_margin)
    host_usable = None if hw.host_ram_gib is None else hw.host_ram_gib * (1 - ts.memory_margin)
    estimate(shape, c, cluster, usable, host_usable)
    need = max(c.memory_gib, c.full_memory_gib)
    if need > usable:
        c.reject(PRUNED, "gpu.memory_gib",
                 f"predicted {need:.2f} GiB per GPU > {usable:.2f} GiB usable "
                 f"({hw.gpu_memory_gib:g} GiB - {ts.memory_margin:.0%} margin)")
        return
    if host_usable is not None and c.host_memory_gib > host_usable:
        c.reject(PRUNED, "gpu.host_ram_gib",
                 f"predicted {c.host_memory_gib:.1f} GiB host RAM per node > {host_usable:.1f} GiB usable "
                 f"({hw.host_ram_gib:g} GiB - {ts.memory_margin:.0%} margin)")


def _layout_candidates(shape: Shape, grid: Grid, ts: TrainSettings, cluster: Cluster,
                       layout: Layout) -> list[Candidate]:
    """The candidates of one layout over the grid's memory savers (see the module docstring); ``layout``
    carries the first of them."""
    def saving(stage: int, offload: str) -> Layout:
        if (stage, offload) == (layout.zero_stage, layout.offload):
            return layout
        return layout.replace(zero_stage=stage, offload=offload)

    first = Candidate(saving(*grid.savers[0]), shape)
    bad = invalid_reason(shape, first, cluster, grid.mp_range)
    if bad:  # the layout itself cannot exist: one row says so
        first.reject(INVALID, f"{TS}.{bad[0]}", bad[1])
        return [first]
    fewest_nodes = trial_node_counts(layout.tp * layout.pp * layout.cp * layout.ep, cluster.hw.gpus_per_node,
                                     cluster.num_nodes)[0]
    out, unrunnable = [], []
    for stage, offload in grid.savers:
        saved = saving(stage, offload)
        bad = per_saver_problem(shape, saved)
        if bad and grid.heuristic_savers and unrunnable:
            continue  # of the savers the engine cannot run, the heuristic lists the first at most
        c = Candidate(saved, shape)
        if bad:
            c.reject(INVALID, f"{TS}.{FIELD_KEYS[bad.field]}", bad.reason)
            (unrunnable if grid.heuristic_savers else out).append(c)
            continue
        _fit(shape, c, cluster, ts)
        out.append(c)
        if grid.heuristic_savers and c.status == SELECTED and c.offload == "none" and c.trial_nodes == fewest_nodes:
            break  # nothing after it can be chosen over it (see the ordering below)
    if not grid.heuristic_savers:
        return out
    fitting = [c for c in out if c.status == SELECTED]
    if not fitting:  # nothing fits: every saver tried, each with its numbers
        return out or unrunnable[:1]  # a layout the engine runs with no saver still gets its row
    best = min(fitting, key=lambda c: (c.offload != "none", c.trial_nodes, out.index(c)))
    return [c for c in out[:out.index(best)] if c.status != SELECTED] + [best]


def plan_candidates(shape: Shape, size_b: float, ts: TrainSettings, cluster: Cluster, gbs: int, recipe: Recipe,
                    grid: Optional[Grid] = None) -> list[Candidate]:
    """Every candidate of the grid (default: ``build_grid``), each recipe the grid's choices made on
    ``recipe`` (what trains and in which precision), with status and reason; selected ones ranked fastest
    first."""
    grid = grid or build_grid(ts, shape, size_b, cluster.hw.host_ram_gib is not None, cluster.hw.gpus_per_node)
    stage, offload = grid.savers[0]
    out: list[Candidate] = []
    for opt, mw, engine, tp, pp, ep, cp, mbs, ao, f8 in itertools.product(
            grid.optimizers, grid.master_weights, grid.engines, grid.tp, grid.pp, grid.ep, grid.cp, grid.mbs,
            grid.activation_offload, grid.fp8):
        dp = max(1, cluster.gpus // (tp * pp * cp))
        eager = Layout(Degrees(tp, pp, mbs=mbs, ep=ep, cp=cp), recipe).replace(engine=engine, activation_offload=ao,
                                                                                fp8=f8)
        compiles, note = compile_values(grid, eager, cluster.hw)
        for base, sp, loss in ((b, sp, loss) for b in (eager.replace(compile=c) for c in compiles)
                               for sp, loss in long_context_values(grid, shape, b)):
            chosen = base.replace(zero_stage=stage, offload=offload, sequence_parallel=sp, optimizer=opt, loss=loss,
                                  master_weights=mw).recipe
            for vp in virtual_stage_values(grid, shape, pp):
                at = Layout(Degrees(tp, pp, dp, mbs, gbs, vp, ep, cp), chosen)
                for ac in act_ckpt_values(grid, shape, pp, vp):
                    layout = at.replace(act_ckpt_layers=ac)
                    for mode in act_ckpt_mode_values(grid, shape, layout):
                        if mode != layout.act_ckpt_mode:
                            layout = layout.replace(act_ckpt_mode=mode)
                        for c in _layout_candidates(shape, grid, ts, cluster, layout):
                            c.note = note
                            out.append(c)
    rank_candidates(out, ts.limit_search_runs)
    return out


COVERAGE = "kept for coverage"  # a selected candidate's note: kept beyond the limit's ranks as its regime's best


def rank_candidates(cands: list[Candidate], limit: int) -> None:
    """Rank the fitting candidates (selected or over the limit), predicted fastest first, and keep ``limit`` of
    them: first, for each value of a regime dimension (``dimensions.regime_of``: each TP, PP, method, engine,
    offload, compile and fp8 value) that could compete, the best-predicted candidate with it (its prediction within
    ``SCOUT_RANGE`` of the best overall, the range in which the adaptive search scouts what it has not measured:
    its own error could make it the fastest), so that the search can calibrate every such value
    (hp_tool/calibration.py ``value_ratios``); then the next best overall. The rest become over_limit; a candidate
    kept beyond the limit's ranks says so in its note. Candidates of several sequence lengths do the same tokens
    per step, so their step times compare."""
    for c in cands:
        if c.status == OVER_LIMIT:
            c.status, c.reason, c.reason_key = SELECTED, "", ""
        if c.note and COVERAGE in c.note:  # an earlier ranking's word; this one decides again
            c.note = "; ".join(part for part in c.note.split("; ") if not part.startswith(COVERAGE))
    fitting = [c for c in cands if c.status == SELECTED]
    fitting.sort(key=lambda c: (c.step_time_s, c.memory_gib, c.tp, c.pp, c.ep, c.cp, c.virtual_stages, c.mbs,
                                c.act_ckpt_layers, c.engine, c.zero_stage, c.offload, c.full.sequence_parallel,
                                c.full.loss, c.full.activation_offload, c.full.act_ckpt_mode, c.full.fp8,
                                c.full.compile))
    best = fitting[0].step_time_s if fitting else 0.0
    value_best: dict[tuple, Candidate] = {}  # a regime's value -> the best candidate with it
    for i, c in enumerate(fitting, start=1):
        c.rank = i
        if c.step_time_s <= SCOUT_RANGE * best:
            for value in values_of(regime_of(c.full.values())):
                value_best.setdefault(value, c)
    coverage = sorted({id(c): c for c in value_best.values()}.values(), key=lambda c: c.rank)[:limit]
    covered = {id(c) for c in coverage}
    kept = covered | {id(c) for c in [c for c in fitting if id(c) not in covered][:limit - len(coverage)]}
    for c in fitting:
        if id(c) not in kept:
            c.reject(OVER_LIMIT, f"{TS}.limit_search_runs",
                     f"predicted rank {c.rank} is beyond limit_search_runs={limit}"
                     + (" (the best candidate of each regime value that could compete kept first)"
                        if c.rank <= limit else ""))
        elif c.rank > limit:
            values = [BY_NAME[name].words(value) for (name, value), kept_c in value_best.items() if kept_c is c]
            c.note = "; ".join(filter(None, [c.note, f"{COVERAGE}: the best-predicted with {', '.join(values)}, "
                                                     f"{c.step_time_s / best:.2f}x the best prediction"]))
