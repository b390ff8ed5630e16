"""What every pipeline stage module shares, whatever its family: the base class the engine, the weight
initialisation and the parallel wrappers rely on, a rank's chunks under interleaved 1F1B, and the
layout-independent parameter names.

Family-specific stages (:mod:`hp_tool.trial.causal`, :mod:`hp_tool.trial.encdec`) derive from
``StageModule``; the family records (:mod:`hp_tool.trial.families`) build them.

A stage names its parts the same for every family, whatever the transformers model calls them (T5's shared
embedding is the stage's ``embed_tokens`` too): ``embed_tokens``, ``layers.<global index>``, the final norm
and ``lm_head``. These are the canonical, layout-independent parameter names the weight initialisation
seeds by and a family's ``hf_key`` maps to checkpoint keys.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

EMBEDDING = "embed_tokens"  # the stage's input embedding, by name
HEAD = "lm_head"  # the stage's output head, by name


class StageModule(nn.Module):
    """What every pipeline stage module shares: it is first when it holds the embedding (``embed_tokens``),
    last when it holds the head (``lm_head``); a tied head is re-tied after materialisation; by default
    the first ``act_ckpt_layers`` of ``layers`` are recomputed and no module is called outside its layer.
    ``family`` names its record in :mod:`hp_tool.trial.families` (TP plan, head counts)."""

    family: str
    embed_tokens: Optional[nn.Module]
    lm_head: Optional[nn.Module]
    layers: nn.ModuleDict
    tied: bool
    logit_softcap: Optional[float] = None  # c of the head's soft cap c·tanh(logits / c) (causal.DecoderHooks)

    @property
    def is_first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def retie(self) -> None:
        """Share the head's weight with the embedding again (``to_empty`` gives each its own tensor)."""
        if self.tied and self.is_first and self.is_last and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_buffers(self, device: torch.device) -> None:
        """Rebuild non-parameter buffers on ``device`` after materialisation (none by default)."""

    def checkpoint_keys(self, act_ckpt_layers: int) -> list[str]:
        """Keys of the layers to recompute: the stage's first ``act_ckpt_layers``."""
        return list(self.layers.keys())[:act_ckpt_layers]

    def bias_modules(self) -> list[nn.Module]:
        """Modules called outside their layer's forward (none here; see EncDecStage)."""
        return []


class InterleavedStages(nn.Module):
    """The model chunks one pipeline rank runs under interleaved 1F1B: chunk k is virtual stage
    rank + k·PP of PP·v, each a stage module of its own (``build_stage`` over PP·v stages), so the rank's
    first chunk holds the embedding on rank 0 and its last the head on rank PP - 1. The optimizer, the
    gradient clipping, the weight initialisation and the memory tracker see one module; the schedule gets
    ``chunks``."""

    def __init__(self, chunks: list[StageModule]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.tied = chunks[0].tied

    @property
    def family(self) -> str:
        return self.chunks[0].family

    @property
    def embed_tokens(self) -> Optional[nn.Module]:
        return self.chunks[0].embed_tokens

    @property
    def lm_head(self) -> Optional[nn.Module]:
        return self.chunks[-1].lm_head

    @property
    def is_first(self) -> bool:
        return self.chunks[0].is_first

    @property
    def is_last(self) -> bool:
        return self.chunks[-1].is_last

    def retie(self) -> None:
        for chunk in self.chunks:
            chunk.retie()

    def reset_buffers(self, device: torch.device) -> None:
        for chunk in self.chunks:
            chunk.reset_buffers(device)


_CHUNK_PREFIX = re.compile(r"^chunks\.\d+\.")


def canonical_name(name: str, tied: bool) -> str:
    """A parameter's layout-independent name: wrapper and chunk prefixes removed, a tied head named as the
    embedding."""
    name = _CHUNK_PREFIX.sub("", name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                             .replace("module.", "")
                             .replace(".base_layer.", "."))
    if tied and name == f"{HEAD}.weight":
        return f"{EMBEDDING}.weight"
    return name
