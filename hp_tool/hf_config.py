"""A Hugging Face model as the fine-tuning search's input: its ``config.json`` found, read with
``transformers.AutoConfig``, checked, and turned into hp_tool's ``Shape``.

``model.hf_config`` names, in this order of lookup:
  - a local directory holding ``config.json`` (a checkpoint), or a ``config.json`` file;
  - a config shipped with hp_tool (``hp_tool/hf_configs/<name>/config.json``: the published models'
    numbers, so the named presets never need a network);
  - a hub id (``meta-llama/Llama-2-7b-hf``), resolved from the local Hugging Face cache only.

Every shape fact (layers, hidden, heads, kv heads, head dim, FFN, vocabulary, tied embeddings, q/k/v biases,
RoPE and its scaling) comes from the config. This is the one file planning reads; everything it raises is a
``ConfigError`` naming ``search_config.model.hf_config`` (or the sequence length), before anything is
written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from hp_tool.errors import ConfigError, require
from hp_tool.families import family, hf_model_types
from hp_tool.families.shape import Shape

KEY = "search_config.model.hf_config"
SHIPPED = Path(__file__).parent / "hf_configs"


def shipped_configs() -> list[str]:
    """Names of the configs shipped with hp_tool (``model.hf_config=<name>``)."""
    return sorted(p.parent.name for p in SHIPPED.glob("*/config.json"))


@dataclass(frozen=True)
class HFModel:
    """What hp_tool reads from a Hugging Face config: the raw ``config.json`` (the trial builds exactly this
    architecture from it) and the shape facts, with transformers' defaults filled in."""

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
        require(self.sliding_window is None or seq <= self.sliding_window, key, seq,
                f"is above the model's sliding attention window of {self.sliding_window} tokens, which the trials "
                "do not model (they run full causal attention, which costs more and computes other numbers)",
                f"use sequence lengths up to {self.sliding_window}")


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
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(**raw)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(KEY, value, f"transformers cannot read {path}: {exc}",
                          "check the config.json against the model's published one") from exc
    facts = family(raw["model_type"])
    for flag in facts.hf_unmodelled:
        require(not raw.get(flag), KEY, value, f"{flag}=true describes layers hp_tool does not model for "
                f"{raw['model_type']}", "use a config without it (the published models of this type have none)")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = raw.get("rope_scaling")
    experts = _experts(cfg, value) if facts.moe else {}
    return HFModel(
        source=value, path=str(path), config=raw, model_type=raw["model_type"],
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
        ffn_hidden_size=experts.get("ffn", cfg.intermediate_size), vocab_size=cfg.vocab_size,
        tied_embeddings=bool(cfg.tie_word_embeddings), qkv_bias=facts.hf_qkv_bias(cfg),
        max_positions=cfg.max_position_embeddings,
        rope_scaling=rope if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) != "default" else None,
        # transformers sets it only where it is used (Qwen2-MoE's 0 without use_sliding_window: none)
        sliding_window=getattr(cfg, "sliding_window", None) or None,
        num_experts=experts.get("num_experts", 0), top_k=experts.get("top_k", 0),
        shared_expert_ffn=experts.get("shared", 0),
    )


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
