"""A decoder-only causal LM cut into one pipeline stage (GPT-3 as OPT, Llama; see :mod:`hp_tool.trial.families`).

The whole transformers model is built on the meta device, which allocates no memory whatever its size;
this rank's pipeline stage keeps only its own layers (plus the embeddings on the first stage and the final
norm and head on the last) and the rest is dropped before anything is materialised. Weights are filled
later by :mod:`hp_tool.trial.weights`, after the tensor and data-parallel wrappers have decided which shard
each rank holds.

Layers are kept under their global index (``layers.7``), so a parameter's name is the same whatever the
layout; weight initialisation relies on that to make every layout the same model.

What a family computes beyond calling its modules is its ``DecoderHooks`` (the family record's
``stage_hooks``): a scale on the token embeddings (Gemma), a soft cap on the final logits (Gemma-2), a
sliding attention window per layer (families that alternate sliding and global attention), the rotary table a
layer reads (Gemma-3's local and global RoPE). Llama's defaults add nothing, so its stage runs the modules as
transformers' model does. A family whose attention runs transformers' eager kernel (Gemma-2: SDPA cannot
soft-cap the scores) gets an additive mask for every layer, as transformers' model builds it for that kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from hp_tool.contracts.spec import ModelSpec, TrialSpec
from hp_tool.trial.context_parallel import token_positions
from hp_tool.trial.stage import StageModule


@dataclass(frozen=True)
class DecoderHooks:
    """What a family's decoder stage computes beyond calling its modules, each read from the transformers
    config once, when the stage is cut. The defaults (Llama's) add nothing."""

    embed_scale: Callable[[Any], Optional[float]] = lambda config: None
    """The factor the token embeddings are multiplied by, in their dtype (Gemma: ``sqrt(hidden_size)``);
    None: none."""
    logit_softcap: Callable[[Any], Optional[float]] = lambda config: None
    """``c`` of the soft cap ``c * tanh(logits / c)`` on the final logits (Gemma-2's
    ``final_logit_softcapping``); None: none."""
    attention_window: Callable[[Any, int], Optional[int]] = lambda config, layer: None
    """``(config, global layer index)`` -> that layer's sliding attention window in tokens (a query attends to
    itself and the window - 1 tokens before it); None: causal attention over the whole sequence."""
    rope_layer_type: Callable[[Any, int], Optional[str]] = lambda config, layer: None
    """``(config, global layer index)`` -> the layer type the rotary embedding is called with for that layer
    (Gemma-3's ``sliding_attention`` layers rotate with a local base, its ``full_attention`` ones with the global);
    None: one rotary table for every layer, called without a type."""


def soft_capped(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap * tanh(logits / cap)``; the logits themselves when ``cap`` is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def window_mask(positions: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """The ``[1, 1, q, k]`` boolean mask (True: attends) of causal attention over the last ``window`` tokens
    (None: over every earlier token), for tokens at global ``positions``."""
    behind = positions[:, None] - positions[None, :]
    allowed = behind >= 0
    return (allowed & (behind < window) if window is not None else allowed)[None, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the eager kernel adds it to the scores: 0 where a query attends, the dtype's lowest
    value elsewhere (transformers' eager masks)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                     torch.finfo(dtype).min)


@dataclass(frozen=True)
class CausalParts:
    """Where one family's transformers model keeps the modules a stage takes (learned positions: OPT only)."""

    layers: nn.ModuleList
    embedding: nn.Module
    positions: Optional[nn.Module]
    final_norm: nn.Module
    head: nn.Module


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global indices of the transformer layers on pipeline ``stage`` (layers split evenly)."""
    per_stage = num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


class CausalLMStage(StageModule):
    """One pipeline stage of a causal LM: [embeddings] -> layers -> [final norm -> head].

    Input: token ids ``[batch, seq]`` on the first stage, hidden states ``[batch, seq, hidden]`` on
    the others. Output: logits ``[batch, seq, vocab]`` on the last stage, hidden states otherwise.
    ``rotary`` builds the rotary position embedding from the config (Llama), None for learned positions.
    ``hooks``: the family's (``DecoderHooks``).
    ``cp_group``: with context parallelism the ranks splitting each sequence (the input is this rank's two
    chunks of it; :mod:`hp_tool.trial.context_parallel`), else None.
    """

    def __init__(self, family: str, config, layers: dict[int, nn.Module],
                 embed_tokens: Optional[nn.Module], embed_positions: Optional[nn.Module],
                 norm: Optional[nn.Module], lm_head: Optional[nn.Module],
                 rotary: Optional[Callable[[object], nn.Module]] = None, hooks: DecoderHooks = DecoderHooks()):
        super().__init__()
        self.family = family
        self.config = config
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb: Optional[nn.Module] = None
        self._rotary = rotary
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        # the chunked loss applies the head itself, a chunk of tokens at a time: the stage returns hidden states
        self.head_in_loss = False
        self.cp_group = None  # set by context_parallel.apply_context_parallel
        self.embed_scale = hooks.embed_scale(config)
        self.logit_softcap = hooks.logit_softcap(config)
        self.windows = {str(i): hooks.attention_window(config, i) for i in layers}  # by layer key
        self.rope_types = {str(i): hooks.rope_layer_type(config, i) for i in layers}  # by layer key
        # transformers' eager kernel adds its mask and applies none of its own: every layer needs one
        self.eager = getattr(config, "_attn_implementation", None) == "eager"

    def reset_buffers(self, device: torch.device) -> None:
        """Rebuild non-parameter buffers (RoPE frequencies) on ``device`` after materialisation."""
        if self._rotary is not None:
            self.rotary_emb = self._rotary(self.config).to(device)

    def attention_masks(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Optional[torch.Tensor]]:
        """Each layer's attention mask for tokens at global ``positions``: None for causal attention over the
        whole sequence (SDPA then runs causal attention, ``is_causal``, with its fastest kernel), and for a
        window that spans the whole sequence; else the window's mask, one per distinct window. The eager
        kernel gets every layer's mask, additive in the scores' ``dtype``."""
        whole = positions.shape[0] * (dist.get_world_size(self.cp_group) if self.cp_group is not None else 1)
        spans = {key: window if window is not None and window < whole else None for key, window in self.windows.items()}
        if self.eager:
            masks = {window: additive_mask(window_mask(positions, window), dtype) for window in set(spans.values())}
        else:
            masks = {window: window_mask(positions, window) for window in set(spans.values()) if window is not None}
        return {key: masks.get(window) for key, window in spans.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = token_positions(self.cp_group, x.shape[1], x.device)
        position_ids = positions.unsqueeze(0)
        h = x
        if self.embed_tokens is not None:
            h = self.embed_tokens(x)
            if self.embed_scale is not None:
                h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
            if self.embed_positions is not None:
                h = h + self.embed_positions(None, 0, position_ids=position_ids)
        rotations = {}
        if self.rotary_emb is not None:
            rotations = {kind: self.rotary_emb(h, position_ids, *([kind] if kind is not None else []))
                         for kind in set(self.rope_types.values())}
        masks = self.attention_masks(positions, h.dtype)
        for key, layer in self.layers.items():
            extra = {"position_embeddings": rotations[self.rope_types[key]]} if rotations else {}
            h = layer(h, attention_mask=masks[key], position_ids=position_ids, **extra)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None and not self.head_in_loss:
            h = soft_capped(self.lm_head(h), self.logit_softcap)
        return h


def cut_causal_stage(model: ModelSpec, config, parts: CausalParts, pp: int, stage: int,
                     rotary: Optional[Callable[[object], nn.Module]] = None,
                     hooks: DecoderHooks = DecoderHooks()) -> CausalLMStage:
    """Pipeline stage ``stage`` of ``pp`` from a whole model on meta (``parts``); the other stages' modules
    are dropped. ``hooks``: the family's (``TorchFamily.stage_hooks``)."""
    first, last = stage == 0, stage == pp - 1
    layers = {i: parts.layers[i] for i in stage_layers(model.num_layers, pp, stage)}
    head = parts.head if last else None
    if head is not None and config.tie_word_embeddings and not first:
        # The tied head lives apart from the embedding on another stage: give it its own weight
        # (kept equal to the embedding by identical init and summed gradients, see optim.py).
        head.weight = nn.Parameter(torch.empty_like(head.weight))
    return CausalLMStage(model.family, config, layers, parts.embedding if first else None,
                         parts.positions if first else None, parts.final_norm if last else None, head, rotary, hooks)


def causal_fake_batch(spec: TrialSpec, stage_index: int, dtype: Optional[torch.dtype]):
    """One micro-batch of a stage's inputs for the memory tracer, (inputs, labels): token ids on the first
    stage, else the hidden states ``[mbs, seq, hidden]`` the previous stage sends (``dtype``: the compute
    dtype, None for fp32); with context parallelism ``seq`` is the rank's ``seq_length / cp`` tokens. Values
    do not matter: the tracer runs under fake tensors."""
    m, mbs = spec.model, spec.parallel.mbs
    seq = m.seq_length // spec.parallel.cp  # a context-parallel rank's share of each sequence
    labels = torch.randint(0, m.vocab_size, (mbs, seq))
    if stage_index == 0:
        return (torch.randint(0, m.vocab_size, (mbs, seq)),), labels
    hidden = torch.empty(mbs, seq, m.hidden_size, dtype=dtype or torch.float32, requires_grad=True)
    return (hidden,), labels
