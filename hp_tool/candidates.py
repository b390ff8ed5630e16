"""Candidate grid: the product of the dimension table's rows (hp_tool/dimensions.py) -> validity -> estimates ->
prune -> order.

The grid is one generic product over the table (``grid_dimensions``): each dimension searches its list (the
user's ``train_settings`` list, resolved once by ``build_grid``; TP, PP and MBS from the family's table), or where
the list is left null and the dimension has a rule (``RULES``), the values its rule gives at each point of the
product from the dimensions it reads (set first); a dimension with neither searches its default. The model's
dimensions (sequence length, method) are the planner's, one shape and recipe a call; the memory savers (ZeRO
stage, offload) are searched per layout (``_layout_candidates``).

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

Long context, each list given in full is searched in full; left null (``sequence_parallel_values``, ``loss_values``, ``build_grid``):
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
from typing import Callable, Mapping, Optional

from hp_tool.adaptive import SCOUT_RANGE
from hp_tool.architectures import Shape, pipeline_problem
from hp_tool.base_config import TS, Cluster
from hp_tool.config import TrainSettings
from hp_tool.calibration import values_of
from hp_tool.dimensions import BY_NAME, DIMENSIONS, Dimension, regime_of
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
    values: Optional[dict] = None  # every searched dimension's value by name (planner.candidate_dimensions), once

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
    """What the grid searches: each grid dimension's list by name (the user's, or what ``build_grid`` resolves for
    the model and cluster), or None (or absent) where its rule (``RULES``) picks values per layout, and the
    memory savers."""

    lists: Mapping[str, Optional[list]]
    mp_range: tuple[int, int]
    act_ckpt_step: int
    savers: list[tuple[int, str]] = dataclasses.field(default_factory=lambda: [(3, "none")])  # (stage, offload)
    heuristic_savers: bool = False  # search one saver per layout (zero_stages/offload null)

    def given(self, name: str) -> Optional[list]:
        """The list of dimension ``name`` (None: its rule's, or its default)."""
        return self.lists.get(name)


CP_MIN_TOKENS = 8192  # the heuristic's context parallelism leaves each rank at least this many tokens
CHUNKED_LOSS_FROM = 8192  # the heuristic's chunked loss from this many tokens per sequence
ACTIVATION_OFFLOAD_FROM = 16384  # the heuristic searches activation offload from this many tokens


def context_parallel_sizes(ts: TrainSettings, shape: Shape, gpus_per_node: int) -> list[int]:
    """CP sizes to search: the user's list; else 1, and for a family whose attention the engine splits the
    powers of two that leave each rank at least CP_MIN_TOKENS tokens and fit in a node."""
    if ts.context_parallel_sizes is not None:
        return list(ts.context_parallel_sizes)
    if not shape.facts.trial.context_parallel:
        return [1]
    return [c for c in (1, 2, 4, 8, 16, 32) if c == 1 or (shape.seq_length // c >= CP_MIN_TOKENS
                                                          and c <= gpus_per_node)]


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
    return shape.facts.sizing.grid_table(shape)


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
    """Every grid dimension's list: the user's (``train_settings``, by the row's key) where given; TP, PP and MBS
    from the family's table for the size and sequence length (NeMo's); EP, CP and activation offload from the
    model and cluster; the rest left to their rules (``RULES``) or defaults."""
    tp, pp, mbs, (lo, hi) = lookup(grid_table(shape), size_b, inclusive=True)
    if ts.pipeline_parallel_sizes is None:  # the heuristic keeps only PP values that split the layers
        pp = [p for p in pp if pipeline_problem(shape, p) is None] or [1]
    savers, heuristic = memory_savers(ts, host_ram_known)
    lists = {d.name: None if (given := getattr(ts, d.key, None)) is None else list(given) for d in grid_dimensions()}
    lists["tp"] = lists["tp"] or list(tp)
    lists["pp"] = lists["pp"] or list(pp)
    lists["mbs"] = lists["mbs"] or list(mbs)
    lists["ep"] = expert_parallel_sizes(ts, shape, gpus_per_node)
    lists["cp"] = context_parallel_sizes(ts, shape, gpus_per_node)
    if lists["activation_offload"] is None:
        lists["activation_offload"] = [False, True] if host_ram_known and shape.seq_length >= ACTIVATION_OFFLOAD_FROM \
            else [False]
    return Grid(lists=lists, mp_range=(ts.min_model_parallel_size or lo, ts.max_model_parallel_size or hi),
                act_ckpt_step=lookup(ACT_CKPT_STEP, size_b), savers=savers, heuristic_savers=heuristic)


@dataclass(frozen=True, slots=True)
class At:
    """Where the grid's product is when a rule picks a dimension's values: the model, the grid, the hardware and
    the layout so far (the dimensions the rule reads set, the rest at their defaults)."""

    shape: Shape
    grid: Grid
    hw: Hardware
    layout: Layout


@dataclass(frozen=True)
class Rule:
    """How a dimension's values are picked where its list is not given (or mended where it is), per point of
    the product: ``values(given, at)`` -> the values, or (the values, why, for plan.csv's note). It reads no more
    of the layout than the dimensions it ``reads`` (and the model's recipe): the grid nests the dimension inside
    those, and asks once per combination of their values."""

    reads: tuple[str, ...]
    values: Callable[[Optional[list], At], "list | tuple[list, str]"]


def compile_values(given: Optional[list], at: At) -> tuple[list[bool], str]:
    """The compile values to search for a layout, and why the heuristic runs it eager where it does: the
    user's list (no note); else compiled wherever the engine compiles the layout's layers on a GPU, as torchtitan
    and torchtune train, and eager on CPU processes, where Inductor's compile of each trial's layers would take
    longer than the trial's steps and fused kernels change nothing the CPU preset prices."""
    if given is not None:
        return list(given), ""
    if at.hw.device_is_host:
        return [False], "eager: CPU processes (compiling the layers would outlast a trial's steps)"
    bad = compile_problem(True, at.layout.engine, at.layout.tp)
    return ([False], f"eager: {bad}") if bad else ([True], "")


def sequence_parallel_values(given: Optional[list], at: At) -> list[bool]:
    """The user's list, or the heuristic's one value: sequence parallelism wherever it runs (it never adds time
    in the model and divides the norms' activations by TP)."""
    if given is not None:
        return list(given)
    return [at.layout.replace(sequence_parallel=True).sequence_problem(at.shape) is None]


def loss_values(given: Optional[list], at: At) -> list[str]:
    """The user's list, or the heuristic's one loss: chunked from CHUNKED_LOSS_FROM tokens per sequence where it
    runs (judged without sequence parallelism, which it never runs with: TP 1), else the whole-logits one."""
    if given is not None:
        return list(given)
    chunked = at.shape.seq_length >= CHUNKED_LOSS_FROM and \
        at.layout.replace(loss="chunked", sequence_parallel=False).sequence_problem(at.shape) is None
    return ["chunked" if chunked else "full"]


def virtual_stage_values(given: Optional[list], at: At) -> list[int]:
    """The grid's virtual stages per pipeline rank for the layout's PP: the user's list (only 1 without a
    pipeline), or NeMo's choice: 1, and for a decoder-only model with PP > 2 also 2 and one layer per chunk
    (num_layers / PP), those that divide the layers per stage."""
    shape, pp = at.shape, at.layout.pp
    if given is not None:
        return [v for v in given if v == 1 or pp > 1] or [1]
    if shape.encoder_decoder or pp <= 2 or pipeline_problem(shape, pp) is not None:
        return [1]
    per_stage = shape.pipeline_layers // pp
    return sorted({v for v in (1, 2, per_stage) if per_stage % v == 0})


def act_ckpt_values(given: Optional[list], at: At) -> list[int]:
    """The grid's checkpointed layers per stage: the user's list, or 0 to the stage's layers (both stacks'
    for an encoder-decoder) in the size's step divided by PP, interleaved in multiples of the virtual
    stages (each chunk recomputes the same number)."""
    if given is not None:
        return list(given)
    shape, pp, virtual_stages = at.shape, at.layout.pp, at.layout.virtual_stages
    per_stage = shape.pipeline_layers // pp if pipeline_problem(shape, pp) is None else 0
    step = max(1, at.grid.act_ckpt_step // pp)
    step = -(-step // virtual_stages) * virtual_stages
    return list(range(0, per_stage + 1, step))


def act_ckpt_mode_values(given: Optional[list], at: At) -> list[str]:
    """How the grid recomputes the layout's checkpointed layers: full alone when it checkpoints none (the mode
    means nothing then); the user's list; or the heuristic's: full, and selective too where the layout
    checkpoints every layer of its stage (as torchtitan applies it; fewer checkpointed layers already trade
    memory for time layer by layer) and selective runs (``Layout.checkpoint_mode_problem``)."""
    shape, layout = at.shape, at.layout
    if layout.act_ckpt_layers == 0:
        return ["full"]
    if given is not None:
        return list(given)
    per_stage = shape.pipeline_layers // layout.pp if pipeline_problem(shape, layout.pp) is None else 0
    if layout.act_ckpt_layers != per_stage:
        return ["full"]
    selective = layout.replace(act_ckpt_mode="selective")
    return ["full", "selective"] if selective.checkpoint_mode_problem(shape) is None else ["full"]


_SEQUENCE_READS = ("tp", "pp", "ep", "cp", "engine", "activation_offload")  # what Layout.sequence_problem reads
# the dimensions whose values a rule picks per point of the product, by name
RULES: dict[str, Rule] = {
    "compile": Rule(("engine", "tp"), compile_values),
    "sequence_parallel": Rule(_SEQUENCE_READS, sequence_parallel_values),
    "loss": Rule(_SEQUENCE_READS, loss_values),
    "virtual_stages": Rule(("pp",), virtual_stage_values),
    "act_ckpt_layers": Rule(("pp", "virtual_stages"), act_ckpt_values),
    "act_ckpt_mode": Rule(("pp", "act_ckpt_layers", "engine", "cp", "activation_offload"), act_ckpt_mode_values),
}
MODEL_DIMENSIONS = ("seq_length", "method")  # the planner's: one shape and recipe a call of plan_candidates
SAVER_DIMENSIONS = ("zero_stage", "offload")  # searched per layout (``_layout_candidates``)


def grid_dimensions() -> tuple[Dimension, ...]:
    """The dimensions the grid's product nests, outermost first: the table's rows but the model's and the memory
    savers'; those without a rule first, in table order (their lists make one product), then those a rule picks,
    each after the dimensions its rule reads."""
    return _nesting(DIMENSIONS, tuple((name, rule.reads) for name, rule in RULES.items()))


@functools.cache
def _nesting(dims: tuple[Dimension, ...], reads: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[Dimension, ...]:
    needs = dict(reads)
    grid = [d for d in dims if d.name not in MODEL_DIMENSIONS + SAVER_DIMENSIONS]
    out = [d for d in grid if d.name not in needs]
    pending = [d for d in grid if d.name in needs]
    names = {d.name for d in grid}
    while pending:
        placed = {d.name for d in out}
        ready = next((d for d in pending if names & set(needs[d.name]) <= placed), None)
        if ready is None:
            raise ValueError(f"grid rules read each other in a cycle: {[d.name for d in pending]}")
        out.append(ready)
        pending.remove(ready)
    return tuple(out)


def grid_values(d: Dimension, at: At) -> tuple[list, str]:
    """The values dimension ``d`` searches at ``at``, and why (plan.csv's note): its rule's where it has one, else
    its list, else its default."""
    given = at.grid.given(d.name)
    rule = RULES.get(d.name)
    if rule is None:
        return (list(given) if given is not None else [d.default]), ""
    out = rule.values(given, at)
    return out if isinstance(out, tuple) else (out, "")


def grid_layouts(shape: Shape, grid: Grid, hw: Hardware, root: Layout, gpus: int) -> list[tuple[Layout, str]]:
    """Every layout of the grid's product from ``root`` (the model's recipe, the first memory saver) on ``gpus``
    GPUs (data parallelism filling them), with the notes of the rules that chose its values; in grid order
    (``grid_dimensions``)."""
    dims = grid_dimensions()
    listed = [d for d in dims if d.name not in RULES]
    frontier: list[tuple[Layout, str]] = []
    for values in itertools.product(*(grid_values(d, At(shape, grid, hw, root))[0] for d in listed)):
        change = {d.name: v for d, v in zip(listed, values) if getattr(root, d.name) != v}
        dp = max(1, gpus // (change.get("tp", root.tp) * change.get("pp", root.pp) * change.get("cp", root.cp)))
        frontier.append((root.replace(**change, dp=dp), ""))
    for d in dims[len(listed):]:
        name, reads, nxt = d.name, RULES[d.name].reads, []
        picked: dict[tuple, tuple[list, str]] = {}  # what the rule reads -> its values: it reads nothing else
        for layout, note in frontier:
            key = tuple([getattr(layout, r) for r in reads])
            if key not in picked:
                picked[key] = grid_values(d, At(shape, grid, hw, layout))
            values, why = picked[key]
            why = f"{note}; {why}" if note and why else note or why
            for v in values:
                nxt.append((layout if getattr(layout, name) == v else layout.replace(**{name: v}), why))
        frontier = nxt
    return frontier


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
    root = Layout(Degrees(global_batch_size=gbs), recipe).replace(zero_stage=stage, offload=offload)
    out: list[Candidate] = []
    for layout, note in grid_layouts(shape, grid, cluster.hw, root, cluster.gpus):
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
