"""A transformer's shape, family-neutral, and NeMo's search for the layer count that gives a size. Pure.

Encoder-decoder families (T5, mT5): ``num_layers`` is the depth of each stack, ``seq_length`` the encoder's
length and ``decoder_seq_length`` the decoder's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Callable, Iterator, Optional

from hp_tool.families.registry import Family, family


@dataclass(frozen=True)
class Shape:
    """Transformer shape; kv_heads == heads unless grouped-query attention. Encoder-decoder: layers per
    stack, the encoder's sequence length and the decoder's (see the module docstring)."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    kv_channels: Optional[int] = None  # per-head width when it is not hidden / heads (T5: 64)
    decoder_seq_length: Optional[int] = None  # encoder-decoder only: the decoder's (target) length
    qkv_bias: bool = False  # q, k and v projections carry biases (Qwen2)
    tied_embeddings: Optional[bool] = None  # the head is the embedding's matrix; None: the family's rule
    pretrained: bool = False  # a published model (a Hugging Face config): the run loads and saves its checkpoint
    # mixture of experts (hp_tool/families/moe.py): every layer's MLP is num_experts experts of
    # ffn_hidden_size each, top_k of them run per token; 0 = a dense model
    num_experts: int = 0
    top_k: int = 0
    shared_expert_ffn: int = 0  # an always-active shared expert's FFN width (Qwen2-MoE); 0 = none
    # tokens the busiest expert receives over the mean (top_k·tokens/experts): the memory and step-time
    # models size expert activations and compute at it (train_settings.expert_imbalance)
    expert_imbalance: float = 1.0

    @property
    def tied_head(self) -> bool:
        """Whether the output projection is the input embedding's matrix (a Hugging Face config's
        ``tie_word_embeddings``, else the family's rule)."""
        return self.facts.arch.tied_head if self.tied_embeddings is None else self.tied_embeddings

    @cached_property
    def facts(self) -> Family:
        """The family's record (hp_tool/families/); cached, as the planner asks it millions of times."""
        return family(self.family)

    def __getstate__(self) -> dict:
        """The fields only: the cached record holds functions, and a pickle carries the family's name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (routed experts in every layer's MLP)."""
        return self.num_experts > 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_dim(self) -> int:
        """Width of the attention's query (and output projection input): heads x head dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and the value) projection: kv heads x head dim."""
        return self.num_kv_heads * self.head_dim

    @cached_property
    def encoder_decoder(self) -> bool:
        return self.facts.arch.encoder_decoder

    @property
    def gated_mlp(self) -> bool:
        return self.facts.arch.gated_mlp

    @cached_property
    def pipeline_layers(self) -> int:
        """Layers the pipeline splits: both stacks for an encoder-decoder."""
        return 2 * self.num_layers if self.encoder_decoder else self.num_layers

    @property
    def target_length(self) -> int:
        """Tokens per sample the output head and the loss see (the decoder's for an encoder-decoder)."""
        return self.decoder_seq_length if self.encoder_decoder else self.seq_length


def _layer_candidates() -> Iterator[tuple[list[int], int]]:
    """(layer counts to try, number of 1% margin steps), in NeMo's order of preference."""
    yield [2**p for p in range(1, 10)], 10
    yield list(range(16, 201, 16)), 6
    yield list(range(2, 201, 2)), 6
    yield list(range(5, 201, 5)), 6
    yield list(range(1, 200)), 10


def num_layers_for(size_b: float, parameters: Callable[[int], float], what: str) -> int:
    """First layer count whose ``parameters(layers)`` is within the margin of ``size_b`` billions."""
    target = size_b * 1e9
    for layer_counts, margin_steps in _layer_candidates():
        for step in range(1, margin_steps + 1):
            margin = step / 100
            for layers in layer_counts:
                if abs(parameters(layers) - target) < margin * target:
                    return layers
    raise ValueError(f"no layer count gives {size_b}B parameters for {what}")
