"""A Hugging Face model as the fine-tuning search's input: its ``config.json`` found, read with
``transformers.AutoConfig``, checked, and turned into hp_tool's ``Shape``.

``model.hf_config`` names, in this order of lookup:
  - a local directory holding ``config.json`` (a checkpoint), or a ``config.json`` file;
  - a config shipped with hp_tool (``hp_tool/hf_configs/<name>/config.json``: the published models'
    numbers, so the named presets never need a network);
  - a hub id (``meta-llama/Llama-2-7b-hf``), resolved from the local Hugging Face cache only.

Every shape fact (layers, hidden, heads, kv heads, head dim, FFN, vocabulary, tied embeddings, q/k/v biases,
RoPE and its scaling) comes from the config. The sizes (``SIZE_KEYS``, ``FFN_KEYS``, ``EXPERT_KEYS``) must be in
the file itself: transformers would fill a missing one with its class default (Llama's 4096 hidden, 32 layers),
which plans some other model. This is the one file planning reads; everything it raises (transformers' own
errors included) is a ``ConfigError`` naming ``search_config.model.hf_config`` (or the sequence length), before
anything is written.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from hp_tool.errors import ConfigError, require
from hp_tool.fsutil import atomic_write_json
from hp_tool.families import family, hf_model_types
from hp_tool.families.shape import Shape

KEY = "search_config.model.hf_config"
SHIPPED = Path(__file__).parent / "hf_configs"

# config.json keys of the sizes every supported model_type is planned from; each must be in the file
SIZE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings")
# the FFN's widths: intermediate_size, but Qwen2-MoE's routed and shared experts have their own
FFN_KEYS = {"qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
            "qwen3_moe": ("moe_intermediate_size",)}
# a mixture of experts' routing; a tuple names one key and its alias (Mixtral's num_local_experts, num_experts)
EXPERT_KEYS = {"mixtral": (("num_local_experts", "num_experts"), "num_experts_per_tok"),
               "qwen2_moe": ("num_experts", "num_experts_per_tok"), "qwen3_moe": ("num_experts", "num_experts_per_tok")}
MAY_BE_ZERO = ("shared_expert_intermediate_size",)  # 0: no shared expert
# keys a config may leave out (transformers' default is what the trial builds too), positive where given
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim")


# the Hugging Face repository each shipped config was copied from (hf_configs/README.md): the checkpoint a server
# loads for it; tiny and tiny_moe are hp_tool's own shapes, with no checkpoint
SHIPPED_REPOS = {
    "llama2_7b": "meta-llama/Llama-2-7b-hf", "llama2_13b": "meta-llama/Llama-2-13b-hf",
    "llama2_70b": "meta-llama/Llama-2-70b-hf", "llama3_8b": "meta-llama/Meta-Llama-3-8B",
    "llama3_1_8b": "meta-llama/Llama-3.1-8B", "mistral_7b": "mistralai/Mistral-7B-v0.1",
    "qwen2_5_7b": "Qwen/Qwen2.5-7B", "qwen3_8b": "Qwen/Qwen3-8B", "qwen3_0_6b": "Qwen/Qwen3-0.6B",
    "phi3_mini_4k": "microsoft/Phi-3-mini-4k-instruct", "gemma2_9b": "google/gemma-2-9b",
    "gemma3_1b": "google/gemma-3-1b-pt", "gemma3_12b": "google/gemma-3-12b-pt", "qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B",
    "mixtral_8x7b": "mistralai/Mixtral-8x7B-v0.1", "mixtral_8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "qwen1_5_moe_a2_7b": "Qwen/Qwen1.5-MoE-A2.7B",
}


def checkpoint_of(hf: "HFModel") -> Optional[str]:
    """The checkpoint a server loads for this config: a shipped config's Hugging Face repository, a hub id as given,
    the folder of a local config.json (a checkpoint saved with it); None for hp_tool's own shapes."""
    path = Path(hf.path)
    if path.is_relative_to(SHIPPED):
        return SHIPPED_REPOS.get(path.parent.name)
    if hf.source.count("/") == 1 and not Path(hf.source).exists():
        return hf.source
    return str(path.parent)


def shipped_configs() -> list[str]:
    """Names of the configs shipped with hp_tool (``model.hf_config=<name>``)."""
    return sorted(p.parent.name for p in SHIPPED.glob("*/config.json"))


@dataclass(frozen=True)
class HFModel:
    """What hp_tool reads from a Hugging Face config: the raw ``config.json`` (the trial builds exactly this
    architecture from it) and the shape facts: the sizes from the file itself, the optional keys (kv heads,
    head dim, tied embeddings, ...) with transformers' defaults filled in, as the trial's model has them."""

    source: str  # the model.hf_config value
    path: str  # the config.json read
    config: dict[str, Any]  # its contents
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    max_positions: int  # max_position_embeddings
    rope_scaling: Optional[dict]  # None: plain RoPE
    sliding_window: Optional[int] = None  # attention window in tokens (Mistral); None: full causal attention
    # a mixture of experts: routed experts per layer (ffn_hidden_size is one expert's width), experts per
    # token, a shared expert's width (Qwen2-MoE); 0 for a dense model
    num_experts: int = 0
    top_k: int = 0
    shared_expert_ffn: int = 0

    def shape(self, seq_length: int, expert_imbalance: float = 1.0) -> Shape:
        """The model at ``seq_length`` tokens per sequence (kv_channels only where the head dim is not
        hidden / heads); a mixture of experts planned at ``expert_imbalance``."""
        kv_channels = None if self.head_dim * self.num_attention_heads == self.hidden_size else self.head_dim
        return Shape(self.model_type, self.num_layers, self.hidden_size, self.num_attention_heads,
                     self.num_kv_heads, self.ffn_hidden_size, self.vocab_size, seq_length, kv_channels,
                     qkv_bias=self.qkv_bias, tied_embeddings=self.tied_embeddings, pretrained=True,
                     num_experts=self.num_experts, top_k=self.top_k, shared_expert_ffn=self.shared_expert_ffn,
                     expert_imbalance=expert_imbalance if self.num_experts else 1.0)

    def check_seq_length(self, seq: int, key: str) -> None:
        """A sequence above ``max_position_embeddings`` without RoPE scaling is refused: those positions
        were never trained, so a run there measures a model that does not exist."""
        require(seq <= self.max_positions or self.rope_scaling is not None, key, seq,
                f"is above the model's max_position_embeddings={self.max_positions} and its config has no "
                "rope_scaling (positions beyond it were never trained)",
                f"use sequence lengths up to {self.max_positions}, or a config with rope_scaling")
        require(self.sliding_window is None or seq <= self.sliding_window or family(self.model_type).trial.runs_windows,
                key, seq,
                f"is above the model's sliding attention window of {self.sliding_window} tokens, which the trials "
                "do not model (they run full causal attention, which costs more and computes other numbers)",
                f"use sequence lengths up to {self.sliding_window}")


def model_name(value: str) -> str:
    """The model ``model.hf_config`` names, as one folder name: a model directory's name (a config.json's
    folder), a shipped config's name, or a hub id's last part; characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``_``. Never raises: the config itself is checked by load_hf_model."""
    given = Path(value).expanduser()
    if given.is_file():
        given = given.resolve()
        part = given.parent.name if given.name == "config.json" else given.stem
    elif given.is_dir():
        part = given.resolve().name
    else:  # a shipped name, a hub id (owner/name), or a path that does not exist (refused when loaded)
        part = value.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", part).strip("._-") or "model"


def config_path(value: str) -> Path:
    """The ``config.json`` that ``model.hf_config`` names (see the module docstring)."""
    given = Path(value).expanduser()
    if given.is_dir():
        path = given / "config.json"
        require(path.is_file(), KEY, value, "the directory has no config.json",
                "give a Hugging Face model directory (save_pretrained writes config.json), or the file itself")
        return path
    if given.is_file():
        return given
    shipped = SHIPPED / value / "config.json"
    if shipped.is_file():
        return shipped
    if value.count("/") == 1 and not value.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(value, "config.json")
        if isinstance(cached, str):
            return Path(cached)
        raise ConfigError(KEY, value, "this hub id is not in the local Hugging Face cache (hp_tool never "
                          "downloads)", f"download it first: huggingface-cli download {value} config.json "
                          "(or the whole checkpoint), or give a local directory")
    raise ConfigError(KEY, value, "no such directory or file, shipped config or hub id",
                      f"give a local model directory, a config.json, a hub id in the local cache, or one of "
                      f"{shipped_configs()}")


@lru_cache(maxsize=32)
def load_hf_model(value: str) -> HFModel:
    """Read and check the config ``model.hf_config`` names."""
    require(bool(value), KEY, value, "the fine-tuning search needs the model's Hugging Face config",
            f"set {KEY}=<model directory, config.json or hub id>, or use a named preset ({shipped_configs()})")
    path = config_path(value)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(KEY, value, f"{path} is not a readable JSON config ({exc})",
                          "point at the model's config.json as save_pretrained writes it") from exc
    supported = list(hf_model_types())
    require(isinstance(raw, dict) and raw.get("model_type") in supported, KEY, value,
            f"model_type {raw.get('model_type') if isinstance(raw, dict) else None!r} is not supported",
            f"use a config of a supported model_type: {supported}")
    _check_sizes(raw, value, path)
    facts = family(raw["model_type"])
    for flag in facts.trial.hf_unmodelled:
        require(not raw.get(flag), KEY, value, f"{flag}=true describes layers hp_tool does not model for "
                f"{raw['model_type']}", "use a config without it (the published models of this type have none)")
    filled = _filled_facts(raw, value, path)
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_scaling")
    return HFModel(
        source=value, path=str(path), config=raw, model_type=raw["model_type"],
        num_layers=raw["num_hidden_layers"], hidden_size=raw["hidden_size"], num_attention_heads=heads,
        vocab_size=raw["vocab_size"], max_positions=raw["max_position_embeddings"],
        rope_scaling=rope if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) != "default" else None,
        **filled,
    )


# the facts transformers fills in (``_transformers_facts``) are kept per config and transformers version in this
# folder ($HP_TOOL_CACHE, default ~/.cache/hp_tool): reading a config with transformers imports torch and its
# distributed tensors, seconds of a dry run that the same config.json answers the same way every time
CACHE_ENV = "HP_TOOL_CACHE"


def cache_dir() -> Path:
    """Where hp_tool keeps what it derives once per input ($HP_TOOL_CACHE, default ~/.cache/hp_tool)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hp_tool")


def _filled_facts(raw: dict, value: str, path: Path) -> dict[str, Any]:
    """``_transformers_facts`` of the config, from the cache when transformers (this version) has read the same
    config before with this code; a config it refuses is never kept, so it is refused again."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    key = hashlib.sha256(json.dumps([raw, version, _CODE_DIGEST], sort_keys=True).encode()).hexdigest()[:32]
    cached = cache_dir() / "hf_facts" / f"{key}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    filled = _transformers_facts(raw, value, path)
    try:
        atomic_write_json(cached, filled)
    except OSError:  # a read-only home: read it with transformers every time
        pass
    return filled


def _transformers_facts(raw: dict, value: str, path: Path) -> dict[str, Any]:
    """The shape facts a config may leave to transformers' defaults for its model_type (kv heads, head dim,
    tied embeddings, q/k/v biases, the sliding window, the experts' routing), as ``AutoConfig`` reads them and
    the trial's model has them; transformers' own errors as a ``ConfigError``."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(**raw)
    except Exception as exc:  # noqa: BLE001 - its strict-dataclass validators raise their own types
        raise ConfigError(KEY, value, f"transformers cannot read {path}: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}",
                          "check the config.json against the model's published one") from exc
    facts = family(raw["model_type"])
    heads = raw["num_attention_heads"]
    head_dim = getattr(cfg, "head_dim", None) or raw["hidden_size"] // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if raw.get("num_key_value_heads") is None:  # transformers' default for this model_type: checked the same
        _check_kv_heads(raw, value, path, kv_heads)
    experts = _experts(cfg, value) if facts.arch.moe else {}
    return dict(
        num_kv_heads=kv_heads, head_dim=head_dim, ffn_hidden_size=experts.get("ffn", cfg.intermediate_size),
        tied_embeddings=bool(cfg.tie_word_embeddings), qkv_bias=bool(facts.trial.hf_qkv_bias(cfg)),
        # transformers sets it only where it is used (Qwen2-MoE's 0 without use_sliding_window: none)
        sliding_window=getattr(cfg, "sliding_window", None) or None,
        num_experts=experts.get("num_experts", 0), top_k=experts.get("top_k", 0),
        shared_expert_ffn=experts.get("shared", 0),
    )


def _size_keys(model_type: str) -> tuple:
    """The keys (or alternatives of one key) the model's sizes are read from, for this model_type."""
    return SIZE_KEYS + FFN_KEYS.get(model_type, ("intermediate_size",)) + EXPERT_KEYS.get(model_type, ())


def _is_size(number: Any, least: int = 1) -> bool:
    return isinstance(number, int) and not isinstance(number, bool) and number >= least


def _check_sizes(raw: dict, value: str, path: Path) -> None:
    """Before transformers reads the config: every size key in the file as a positive integer, and the
    heads dividing the hidden size where no head_dim says otherwise (transformers' validators would raise
    their own errors, or it would plan its defaults)."""
    model_type = raw["model_type"]
    for names in _size_keys(model_type):
        names = names if isinstance(names, tuple) else (names,)
        given = [n for n in names if raw.get(n) is not None]
        either = " or ".join(f'"{n}"' for n in names)
        require(bool(given), KEY, value,
                f"{path} has no {either}, so transformers would fill in its {model_type} default (the size of some "
                "other model)", f"add {either} to the config.json with the model's own value (save_pretrained writes "
                "it; the model's published config.json has it)")
        least = 0 if names[0] in MAY_BE_ZERO else 1
        _require_size(raw, given[0], value, path, least)
    for name in OPTIONAL_SIZE_KEYS:
        if raw.get(name) is not None:
            _require_size(raw, name, value, path)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    require(raw.get("head_dim") is not None or hidden % heads == 0, KEY, value,
            f'{path}: "num_attention_heads"={heads} does not divide "hidden_size"={hidden} (each head is '
            "hidden_size / num_attention_heads wide when the config has no head_dim)",
            f"use a num_attention_heads that divides {hidden} (the model's published config.json has one)")
    if raw.get("num_key_value_heads") is not None:
        _check_kv_heads(raw, value, path, raw["num_key_value_heads"])


def _require_size(raw: dict, name: str, value: str, path: Path, least: int = 1) -> None:
    number = raw[name]
    require(_is_size(number, least), KEY, value,
            f'{path}: "{name}"={number!r} is not a {"non-negative" if least == 0 else "positive"} integer',
            f'set "{name}" to the model\'s own size (an integer, as the published config.json has it)')


def _check_kv_heads(raw: dict, value: str, path: Path, kv_heads: int) -> None:
    """Grouped-query attention: every key/value head serves the same number of query heads."""
    heads = raw["num_attention_heads"]
    origin = "" if raw.get("num_key_value_heads") is not None else \
        f" (transformers' {raw['model_type']} default: the file has none)"
    require(_is_size(kv_heads) and heads % kv_heads == 0, KEY, value,
            f'{path}: "num_key_value_heads"={kv_heads!r}{origin} does not divide "num_attention_heads"={heads}',
            f'set "num_key_value_heads" to a divisor of {heads} (equal to it for multi-head attention)')


def _experts(cfg: Any, value: str) -> dict[str, int]:
    """A mixture of experts' routing as transformers names it: Mixtral's ``num_local_experts`` (aliased
    ``num_experts``) of ``intermediate_size``; Qwen2-MoE's ``num_experts`` of ``moe_intermediate_size`` with a
    ``shared_expert_intermediate_size``; ``num_experts_per_tok`` for both. Layers without experts (Qwen's
    ``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused: hp_tool models every layer as an MoE layer."""
    experts, top_k = getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "num_experts_per_tok", 0) or 0
    require(experts > 0 and 0 < top_k <= experts, KEY, value,
            f"a mixture of experts needs 1 <= num_experts_per_tok ({top_k}) <= its experts ({experts})",
            "check num_experts_per_tok and num_local_experts / num_experts against the published config")
    require(not getattr(cfg, "mlp_only_layers", None) and getattr(cfg, "decoder_sparse_step", 1) == 1, KEY, value,
            "has dense layers among its expert layers (mlp_only_layers or decoder_sparse_step > 1), which hp_tool "
            "does not model", "use a config whose every layer routes to experts (the published Qwen MoE models do)")
    return {"num_experts": experts, "top_k": top_k,
            "ffn": getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
            "shared": getattr(cfg, "shared_expert_intermediate_size", 0) or 0}


_CODE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # this code's own: a change reads anew
