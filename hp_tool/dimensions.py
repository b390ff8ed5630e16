"""The searched dimensions as data: one row per knob of the training grid.

Each row says where a dimension comes from (its ``train_settings`` list), what it sets (the layout or spec
field), how it is named (its trial-id token, CSV column, printed header, words in a recommendation), how a
rejected list is mended, and its default (what a layout without it runs, which also keeps the
fingerprint of a spec written before the dimension existed). The trial id, the CSV columns and their types,
the printed tables, the recommendation and the fingerprint's defaults are derived here, so they cannot
drift apart.

Pure data and string building: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from hp_tool.errors import require
from hp_tool.recipe import SECTIONS
from hp_tool.vocab import (ACT_CKPT_MODES, ENGINE_CODES, ENGINES, LOSSES, MASTER_WEIGHTS, METHODS, OFFLOAD_CODES,
                           OFFLOADS, OPTIMIZER_CODES, OPTIMIZERS, INVALID, ZERO_STAGES)

# where a token goes in a trial id: family_size<model>_tp<tp>_pp<pp>_mbs<mbs>_ac<ac>_<engine><saver>
SLOTS = ("model", "tp", "pp", "mbs", "ac", "saver")


@dataclass(frozen=True)
class Dimension:
    """One searched knob."""

    name: str  # the field it sets (Layout / ParallelSpec; seq_length and method: the model's)
    key: str  # its train_settings list
    kind: type  # int | bool | str: the CSV cell's type
    default: Any  # what a layout that does not set it runs
    always: bool  # named in every table and sentence; else only where some layout differs from the default
    header: str  # the printed tables' column
    slot: str  # where its token goes in a trial id (SLOTS)
    token: Callable[[Any], str]  # its part of the trial id, from its value ("" for none)
    words: Callable[[Any], str]  # its phrase in a layout named in words
    fix: str  # how to mend a list that leaves no valid candidate
    added: bool = False  # added after specs were first written: the fingerprint leaves it out at its default
    choices: Optional[tuple] = None  # the values its list may hold; None: integers from ``least``
    least: int = 1
    # it changes how fast the engine runs a layout relative to the model's prediction (which collectives run, what
    # kernels, what trains): the adaptive search calibrates each combination of these apart (``regime_recipe``);
    # the others (sequence length, micro-batch, checkpointing, ...) the model's own terms carry within a regime
    regime: bool = False
    doc: str = ""  # its train_settings key's description (docs/configuration.md): what a list sets, what null searches

    @property
    def spec(self) -> str:
        """The TrialSpec section holding it: its layout field's (hp_tool/recipe.py ``SECTIONS``); the sequence
        length the model's."""
        return SECTIONS.get(self.name, "model")

    @property
    def column(self) -> str:
        """Its column in plan.csv, all_trials, the summaries and comparison.csv."""
        return self.name

    def require(self, value: Any, section: str) -> None:
        """Refuse a spec's value of this dimension (``section``.name) that none of its lists may hold: one not
        among its choices, or an integer below its least."""
        key = f"{section}.{self.name}"
        if self.choices is not None:
            require(value in self.choices, key, value, f"is not a known {self.name}", f"use one of {list(self.choices)}")
        else:
            require(value >= self.least, key, value, f"must be at least {self.least}", f"use an integer >= {self.least}")

    def shown(self, values: Iterable[Any]) -> bool:
        """Whether a table or sentence about layouts with these values names this dimension: when some layout
        has it (a dense model has no experts), and it is always named, or it varied, or the layouts differ
        from its default."""
        present = [v for v in values if not _blank(v)]
        if not present:
            return False
        if self.always or len(set(present)) > 1:
            return True
        return self.default is not None and present[0] != self.default


def _count(prefix: str) -> Callable[[Any], str]:
    return lambda v: f"{prefix}{v}"


def _unless_one(prefix: str) -> Callable[[Any], str]:
    return lambda v: f"_{prefix}{v}" if v is not None and v > 1 else ""


def _flag(token: str) -> Callable[[Any], str]:
    return lambda v: token if v else ""


def _ckpt_words(v: int) -> str:
    return f"{v} checkpointed layers per stage" if v else "no activation checkpointing"


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("seq_length", "seq_lengths", int, None, False, "seq", "model", lambda v: f"_s{v}" if v is not None else "",
              lambda v: f"{v} tokens per sequence", "use sequence lengths the model's positions hold",
              doc=("sequence lengths searched; each at most the model's max_position_embeddings unless its config has"
                   " rope_scaling")),
    # an adapter method is named with its rank (trial_id)
    Dimension("method", "methods", str, "full", False, "method", "model", lambda v: "",
              lambda v: f"{v} fine-tuning" if v == "full" else v.upper() if v == "qlora" else "LoRA",
              "use TP=1 for lora and qlora, and the torch engine with ZeRO 0-1 for qlora",
              choices=METHODS, regime=True,
              doc=("full | lora | qlora; null = every one the target runs (lora with peft installed, qlora with "
                   "bitsandbytes, in 16-bit precision, on a GPU preset)")),
    Dimension("tp", "tensor_parallel_sizes", int, 1, True, "TP", "tp", _count("tp"), lambda v: f"TP={v}",
              "use TP values that divide the (key/value) head count and fit in one node", regime=True,
              doc="TP sizes searched; null = the family's table for the size"),
    Dimension("sequence_parallel", "sequence_parallel", bool, False, False, "SP", "tp", _flag("sp"),
              lambda v: "sequence parallel" if v else "no sequence parallelism",
              "use sequence_parallel=[false], or TP > 1 on the torch engine", added=True, choices=(False, True),
              doc=(("with TP, norms on sequence shards (torch engine, PP 1, Llama-style layers); null = wherever it "
                   "runs"))),
    Dimension("pp", "pipeline_parallel_sizes", int, 1, True, "PP", "pp", _count("pp"), lambda v: f"PP={v}",
              "use PP values that divide the layer count (T5/mT5: 1, or an even PP whose half divides the layers "
              "per stack)", regime=True,
              doc="PP sizes searched; null = the family's table for the size"),
    Dimension("virtual_stages", "virtual_pipeline_sizes", int, 1, False, "VP", "pp", _unless_one("vp"),
              lambda v: f"interleaved over {v} virtual stages" if v > 1 else "no interleaving",
              "use virtual stages that divide the layers per pipeline stage (num_layers / PP), 1 without a "
              "pipeline or for T5/mT5",
              doc=(("model chunks per pipeline rank (interleaved 1F1B when > 1); null = 1, and with PP > 2 also 2 and "
                   "num_layers / PP (NeMo's choice)"))),
    # a mixture of experts names its EP, 1 included; a dense model has none (None)
    Dimension("ep", "expert_parallel_sizes", int, 1, True, "EP", "pp", lambda v: f"_ep{v}" if v is not None else "",
              lambda v: f"EP={v}", "use expert-parallel sizes dividing the experts and the data-parallel ranks",
              doc=(("EP, experts split over EP of the data-parallel ranks (EP divides the experts and DP; torch "
                   "engine, ZeRO 0/2/3); null = 1 and the powers of two dividing the experts within a node"))),
    Dimension("cp", "context_parallel_sizes", int, 1, False, "CP", "pp", _unless_one("cp"), lambda v: f"CP={v}",
              "use context_parallel_sizes=[1], or sizes leaving each rank whole attention chunks", added=True,
              doc=(("CP, each sequence split over CP ranks (ring attention; torch, PP 1, Llama-style attention, "
                   "sequence divisible by 2 x CP); null = 1 and the powers of two leaving each rank >= 8192 tokens "
                   "within a node"))),
    Dimension("mbs", "micro_batch_sizes", int, 1, True, "MBS", "mbs", _count("mbs"), lambda v: f"MBS={v}",
              "use a global_batch_size (and micro_batch_sizes) with GBS % (MBS*DP) == 0",
              doc="micro-batch sizes searched; null = the family's table"),
    Dimension("act_ckpt_layers", "act_ckpt_layers", int, 0, True, "ckpt", "ac", _count("ac"), _ckpt_words,
              "use values between 0 and the layers per pipeline stage (num_layers / PP; T5/mT5: 2 x num_layers / "
              "PP)", least=0,
              doc="layers per pipeline stage recomputed"),
    Dimension("engine", "engines", str, "torch", True, "engine", "saver", lambda v: ENGINE_CODES[v],
              lambda v: f"{v} engine", "use engines=[torch]", choices=ENGINES, regime=True,
              doc="trial engines, torch | deepspeed; null = [torch]"),
    Dimension("zero_stage", "zero_stages", int, 3, True, "ZeRO", "saver", lambda v: f"_z{v}", lambda v: f"ZeRO-{v}",
              "choose a ZeRO stage the engine runs at this TP/PP (hp_tool/sharding.py)", choices=ZERO_STAGES,
              doc=("ZeRO stages 0-3 (0 DDP, 1 optimizer, 2 + gradients, 3 + parameters sharded); null = one per "
                   "layout: the lightest that fits on the fewest trial nodes")),
    Dimension("offload", "offload", str, "none", False, "offload", "saver", lambda v: f"_{OFFLOAD_CODES[v]}",
              lambda v: f"offload {v}" if v != "none" else "no offload",
              "choose an offload the engine runs (hp_tool/sharding.py), or give gpu.host_ram_gib", choices=OFFLOADS,
              regime=True,
              doc=("none | optimizer | optimizer_and_params (to host RAM); null = none, and offload only for layouts "
                   "that fit no other way")),
    Dimension("optimizer", "optimizers", str, "adamw", False, "optimizer", "saver", lambda v: OPTIMIZER_CODES[v],
              lambda v: f"{v} optimizer", "use adamw with offload, or the other optimizers without it",
              choices=OPTIMIZERS,
              doc="adamw | sgd | sgd_momentum | adamw_8bit (CUDA); null = [adamw]"),
    Dimension("master_weights", "master_weights", str, "fp32", False, "master", "saver",
              lambda v: "_bf16w" if v == "bf16" else "",
              lambda v: "bf16 weights and optimizer states (no fp32 master)" if v == "bf16" else "fp32 master weights",
              "use master_weights=[fp32], or bf16 with the torch engine, precision bf16 and no offload", added=True,
              choices=MASTER_WEIGHTS,
              doc=(("what holds the trained weights: fp32 (mixed precision's fp32 masters) | bf16 (weights, gradients "
                   "and optimizer moments in bf16, no fp32 master: torchtune's dtype=bf16; torch engine, precision "
                   "bf16, a GPU); null = [fp32]"))),
    Dimension("act_ckpt_mode", "act_ckpt_modes", str, "full", False, "ckpt mode", "saver",
              lambda v: "_sac" if v == "selective" else "",
              lambda v: "selective checkpointing (per op)" if v == "selective" else "whole-layer checkpointing",
              "use act_ckpt_modes=[full], or selective with the torch engine and checkpointed layers", added=True,
              choices=ACT_CKPT_MODES,
              doc=(("how checkpointed layers are recomputed: full (whole) | selective (torchtitan's per-op policy, "
                   "keeping every second matmul's and the attention's outputs; torch engine, no CP or activation "
                   "offload); null = full, and selective too where a layout checkpoints every layer of its stage"))),
    Dimension("loss", "losses", str, "full", False, "loss", "saver", lambda v: "_lchunk" if v == "chunked" else "",
              lambda v: "chunked loss" if v == "chunked" else "whole-logits loss",
              "use losses=[full], or chunked on the last pipeline stage's engine that runs it", added=True,
              choices=LOSSES,
              doc=(("full (whole logits) | chunked (output projection and cross-entropy over chunks of tokens; TP 1, "
                   "torch); null = chunked from 8192 tokens where it runs"))),
    Dimension("activation_offload", "activation_offload", bool, False, False, "act offload", "saver", _flag("_aoff"),
              lambda v: "activations offloaded to host RAM" if v else "activations on the GPU",
              "use activation_offload=[false], or the torch engine with a host RAM figure", added=True,
              choices=(False, True),
              doc=(("saved activations in host RAM (torch); null = [false], and [false, true] from 16384 tokens when "
                   "gpu.host_ram_gib is set"))),
    Dimension("compile", "compile", bool, False, False, "compile", "saver", _flag("_compiled"),
              lambda v: "torch.compile" if v else "eager",
              "use compile=[false], or the torch engine", added=True, choices=(False, True), regime=True,
              doc=(("the layers under torch.compile (the torch engine at TP 1): null = compiled wherever the engine "
                   "compiles the layout's layers on a GPU, eager elsewhere (DeepSpeed, TP > 1, CPU processes; the "
                   "reason in plan.csv's note); [false, true] searches both"))),
    Dimension("fp8", "fp8", bool, False, False, "fp8", "saver", _flag("_fp8"),
              lambda v: "fp8 linears" if v else "bf16 linears",
              "use fp8=[false], or a GPU with fp8 tensor cores (H100, H200, L4, L40S) with the torch engine (no sequence "
              "parallel) training full in bf16", added=True, choices=(False, True), regime=True,
              doc=(("the layers' linears in Float8 (torchao): null = [false]; [false, true] searches both where the "
                   "GPU has fp8 tensor cores (gpu.peak_tflops.fp8), the torch engine training full in bf16 (at TP > 1"
                   " without sequence parallel)"))),
)

BY_NAME = {d.name: d for d in DIMENSIONS}
BY_KEY = {d.key: d for d in DIMENSIONS}
# the dimensions a regime of the adaptive search is keyed by besides TP and PP (``Dimension.regime``)
RECIPE_REGIME = tuple(d for d in DIMENSIONS if d.regime and d.name not in ("tp", "pp"))
REGIME_COLUMNS = ("tp", "pp", *(d.column for d in RECIPE_REGIME))  # the table columns ``regime_of`` reads


def regime_recipe(values: Mapping[str, Any]) -> tuple:
    """A layout's regime beyond its TP and PP: ((dimension, value), ...) of ``RECIPE_REGIME``, from its values by
    name (a layout's fields); a dimension it does not set runs its default."""
    return tuple((d.name, values.get(d.name, d.default)) for d in RECIPE_REGIME)


def regime_of(values: Mapping[str, Any]) -> tuple:
    """A layout's regime from its values by name (a layout's fields, a plan or result row): (TP, PP, *recipe), as
    ``adaptive.Option.regime`` holds it; the one key the adaptive search and the collector's calibration use."""
    return (int(values["tp"]), int(values["pp"]), *regime_recipe(values))


def regime_words_of(regime: tuple) -> str:
    """``regime_words`` of a ``regime_of`` key."""
    return regime_words(regime[0], regime[1], regime[2:])


def regime_words(tp: int, pp: int, recipe: Iterable[tuple[str, Any]]) -> str:
    """A regime in words, its recipe's dimensions named where not at their defaults: "TP=2, PP=1, LoRA,
    deepspeed engine"."""
    return ", ".join([f"TP={tp}", f"PP={pp}", *(BY_NAME[name].words(value) for name, value in recipe
                                               if value != BY_NAME[name].default)])


def layout_headers(dims: Optional[Iterable[Dimension]] = None) -> tuple[tuple[str, str], ...]:
    """(column, printed header) of these dimensions (default: the table's) in table order, the data-parallel size
    (what the GPUs leave, never searched) after PP."""
    out: list[tuple[str, str]] = []
    for d in DIMENSIONS if dims is None else dims:
        out += [(d.column, d.header), ("dp", "DP")] if d.name == "pp" else [(d.column, d.header)]
    return tuple(out)


def layout_columns(dims: Optional[Iterable[Dimension]] = None) -> tuple[str, ...]:
    """The columns of these dimensions in table order, DP after PP."""
    return tuple(column for column, _ in layout_headers(dims))


# the CSV types of the dimensions' columns (dp an integer)
INT_COLUMNS = tuple(d.column for d in DIMENSIONS if d.kind is int) + ("dp",)
BOOL_COLUMNS = tuple(d.column for d in DIMENSIONS if d.kind is bool)
TEXT_COLUMNS = tuple(d.column for d in DIMENSIONS if d.kind is str)


def fingerprint_defaults(section: str = "parallel") -> dict[str, Any]:
    """The fields of a spec section added after specs were first written, with the value a layout without
    them runs: a spec without them keeps its fingerprint."""
    return {d.name: d.default for d in DIMENSIONS if d.added and d.spec == section}


_TOKENS: dict[tuple[str, Any], str] = {}  # (dimension, value) -> its trial-id token: a plan names tens of thousands


def trial_id(family: str, size_label: str, values: Mapping[str, Any], lora_rank: int = 0) -> str:
    """The one place a trial id is built; every file name derives from it. ``values``: dimension name ->
    value; one left out runs its default (``seq_length`` and ``ep`` left out are not named: a
    pretraining search's one sequence length, a dense model's experts). E.g.
    gpt3_5b_tp2_pp1_mbs4_ac0_torch_z3_noff; llama_6.74b_s2048_lora16_tp1_pp1_mbs4_ac32_ds_z3_offopt;
    mixtral_46.7b_s4096_tp1_pp1_ep8_mbs1_...; llama_8.03b_s32768_tp2sp_pp1_cp2_mbs1_ac32_torch_z3_noff_lchunk_aoff;
    an adapter method adds its name and rank after the sequence length."""
    parts = dict.fromkeys(SLOTS, "")
    tokens = _TOKENS
    for d in DIMENSIONS:
        name = d.name
        value = values.get(name, None if name == "ep" else d.default)
        if name == "method" and value != "full":
            parts[d.slot] += f"_{value}{lora_rank}"
            continue
        try:
            token = tokens[name, value]
        except KeyError:
            token = tokens[name, value] = d.token(value)
        if token:
            parts[d.slot] += token
    return (f"{family}_{size_label}{parts['model']}_{parts['tp']}_{parts['pp']}_{parts['mbs']}_{parts['ac']}_"
            f"{parts['saver']}")


def varied(rows: Iterable[Mapping[str, Any]], also: Iterable[str] = ()) -> list[Dimension]:
    """The dimensions a set of rows (plan or result rows, by column) names: those always named, those any
    row sets to something other than the default, and those named in ``also``."""
    rows, also = list(rows), set(also)
    return [d for d in DIMENSIONS if d.name in also or d.shown(r.get(d.column) for r in rows)]


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)  # NaN


def named_value(column: str, row: Mapping[str, Any]) -> Any:
    """The value a table or sentence names for ``column`` of ``row``: None where the row has none, and for a
    checkpointing mode without checkpointed layers (it means nothing there)."""
    value = row.get(column)
    if _blank(value) or (column == "act_ckpt_mode" and not row.get("act_ckpt_layers")):
        return None
    return value


def searched(rows: Iterable[Mapping[str, Any]], finetune: bool) -> list[Dimension]:
    """The dimensions a search's tables and sentences name: those always named and every one that varied among
    its candidates that could exist (not invalid); a fine-tuning search also names its sequence length and
    method, what a fine-tuning table is read by."""
    return varied((r for r in rows if r.get("plan_status") != INVALID), also=("seq_length", "method") if finetune else ())


def layout_words(row: Mapping[str, Any], shown: Optional[Iterable[Dimension]] = None) -> str:
    """A layout in words from its row (by column), every dimension of ``shown`` (default: those always named
    and those this row sets to something other than the default) named, DP after PP; e.g. "4096 tokens per
    sequence, LoRA rank 16, TP=1, PP=1, DP=8, MBS=2, 32 checkpointed layers per stage, torch engine, ZeRO-3"."""
    dims = list(shown) if shown is not None else varied([row])
    out = []
    for d in dims:
        value = named_value(d.column, row)
        if value is None:
            continue
        if d.name == "method" and value != "full" and not _blank(row.get("lora_rank")):
            out.append(f"{d.words(value)} rank {int(row['lora_rank'])}")
        else:
            out.append(d.words(value))
        if d.name == "pp" and not _blank(row.get("dp")):
            out.append(f"DP={row['dp']}")
    return ", ".join(out)


def cell(column: str, row: Mapping[str, Any]) -> str:
    """A printed table's cell of a dimension's column (or DP's) in ``row``: blank where it names nothing
    (``named_value``)."""
    value = named_value(column, row)
    if value is None:
        return ""
    if column in BY_NAME and BY_NAME[column].kind is bool:
        return "yes" if value else "no"
    return str(value)
