"""The trial's model: a transformers model built from a spec's shape, cut into one pipeline stage.

The whole ``OPTForCausalLM`` (GPT-3 family) or ``LlamaForCausalLM`` is built on the meta device, which
allocates no memory whatever its size; this rank's pipeline stage keeps only its own layers (plus the
embeddings on the first stage and the final norm and head on the last) and the rest is dropped before
anything is materialised. Weights are filled later by :mod:`hp_tool.trial.weights`, after the tensor and
data-parallel wrappers have decided which shard each rank holds.

Layers are kept under their global index (``layers.7``), so a parameter's name is the same whatever the
layout; weight initialisation relies on that to make every layout the same model.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hp_tool.families import family, family_names

ENGINE_FAMILIES = family_names()
ENCODER_DECODER = tuple(n for n in ENGINE_FAMILIES if family(n).encoder_decoder)
from hp_tool.errors import require
from hp_tool.contracts.spec import ModelSpec

log = logging.getLogger(__name__)


def hf_config(model: ModelSpec):
    """The transformers config for a spec's shape: dropout off, SDPA attention, no KV cache."""
    require(model.family in ENGINE_FAMILIES, "model.family", model.family,
            "the trial engine has no model class for this family",
            f"use one of {list(ENGINE_FAMILIES)}")
    if model.family in ENCODER_DECODER:
        from hp_tool.trial.encdec import t5_config

        return t5_config(model)
    if model.family == "gpt3":
        from transformers import OPTConfig

        # GPT-3 = OPT's layout: learned positions, pre-LayerNorm, separate q/k/v with biases, GELU,
        # input and output embeddings tied. Dropout is off so every layout computes the same numbers.
        return OPTConfig(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
            ffn_dim=model.ffn_hidden_size, max_position_embeddings=model.seq_length,
            word_embed_proj_dim=model.hidden_size, do_layer_norm_before=True,
            activation_function="gelu", enable_bias=True, dropout=0.0, attention_dropout=0.0,
            layerdrop=0.0, tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
            pad_token_id=None,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_kv_heads, intermediate_size=model.ffn_hidden_size,
        max_position_embeddings=model.seq_length, rms_norm_eps=1e-5, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global indices of the transformer layers on pipeline ``stage`` (layers split evenly)."""
    per_stage = num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


class StageModule(nn.Module):
    """What every pipeline stage module shares: it is first when it holds the embedding (``embed_tokens``),
    last when it holds the head (``lm_head``); a tied head is re-tied after materialisation; by default
    the first ``act_ckpt_layers`` of ``layers`` are recomputed and no module is called outside its layer."""

    embed_tokens: Optional[nn.Module]
    lm_head: Optional[nn.Module]
    layers: nn.ModuleDict
    tied: bool

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

    def checkpoint_keys(self, act_ckpt_layers: int) -> list[str]:
        """Keys of the layers to recompute: the stage's first ``act_ckpt_layers``."""
        return list(self.layers.keys())[:act_ckpt_layers]

    def bias_modules(self) -> list[nn.Module]:
        """Modules called outside their layer's forward (none here; see EncDecStage)."""
        return []


class CausalLMStage(StageModule):
    """One pipeline stage of a causal LM: [embeddings] -> layers -> [final norm -> head].

    Input: token ids ``[batch, seq]`` on the first stage, hidden states ``[batch, seq, hidden]`` on
    the others. Output: logits ``[batch, seq, vocab]`` on the last stage, hidden states otherwise.
    """

    def __init__(self, family: str, config, layers: dict[int, nn.Module],
                 embed_tokens: Optional[nn.Module], embed_positions: Optional[nn.Module],
                 norm: Optional[nn.Module], lm_head: Optional[nn.Module]):
        super().__init__()
        self.family = family
        self.config = config
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb: Optional[nn.Module] = None
        self.tied = bool(getattr(config, "tie_word_embeddings", False))

    def reset_buffers(self, device: torch.device) -> None:
        """Rebuild non-parameter buffers (RoPE frequencies) on ``device`` after materialisation."""
        if self.family == "llama":
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            self.rotary_emb = LlamaRotaryEmbedding(self.config).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        position_ids = torch.arange(seq, device=x.device).unsqueeze(0)
        h = x
        if self.embed_tokens is not None:
            h = self.embed_tokens(x)
            if self.embed_positions is not None:
                h = h + self.embed_positions(None, 0, position_ids=position_ids)
        extra = {}
        if self.rotary_emb is not None:
            extra["position_embeddings"] = self.rotary_emb(h, position_ids)
        for layer in self.layers.values():
            # No mask: SDPA then runs causal attention (is_causal) with its fastest kernel.
            h = layer(h, attention_mask=None, position_ids=position_ids, **extra)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


def build_full_model_on_meta(model: ModelSpec) -> nn.Module:
    """The whole transformers model on the meta device: no memory, whatever the size."""
    config = hf_config(model)
    with torch.device("meta"):
        if model.family == "gpt3":
            from transformers import OPTForCausalLM

            return OPTForCausalLM(config)
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(config)


def build_stage(model: ModelSpec, pp: int, stage: int) -> StageModule:
    """Pipeline stage ``stage`` of ``pp`` on the meta device; the other stages' modules are dropped.
    A CausalLMStage, or for T5/mT5 an :class:`hp_tool.trial.encdec.EncDecStage`."""
    if model.family in ENCODER_DECODER:
        from hp_tool.trial.encdec import build_encdec_stage

        return build_encdec_stage(model, pp, stage)
    full = build_full_model_on_meta(model)
    config = full.config
    first, last = stage == 0, stage == pp - 1
    if model.family == "gpt3":
        body = full.model.decoder
        tokens, positions, norm = body.embed_tokens, body.embed_positions, body.final_layer_norm
    else:
        body = full.model
        tokens, positions, norm = body.embed_tokens, None, body.norm
    layers = {i: body.layers[i] for i in stage_layers(model.num_layers, pp, stage)}
    lm_head = full.lm_head if last else None
    if lm_head is not None and config.tie_word_embeddings and not first:
        # The tied head lives apart from the embedding on another stage: give it its own weight
        # (kept equal to the embedding by identical init and summed gradients, see optim.py).
        lm_head.weight = nn.Parameter(torch.empty_like(lm_head.weight))
    return CausalLMStage(model.family, config, layers,
                         tokens if first else None, positions if first else None,
                         norm if last else None, lm_head)


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


def build_rank_stages(model: ModelSpec, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[StageModule]:
    """The stage modules pipeline rank ``pp_rank`` runs, on meta: its one stage, or with ``virtual_stages``
    v > 1 its v chunks, virtual stages ``pp_rank + k·pp`` of ``pp·v``."""
    return [build_stage(model, pp * virtual_stages, pp_rank + k * pp) for k in range(virtual_stages)]


_CHUNK_PREFIX = re.compile(r"^chunks\.\d+\.")


def canonical_name(name: str, tied: bool) -> str:
    """A parameter's layout-independent name: wrapper and chunk prefixes removed, a tied head named as the
    embedding."""
    name = _CHUNK_PREFIX.sub("", name.replace("_checkpoint_wrapped_module.", "").replace("module.", ""))
    if tied and name == "lm_head.weight":
        return "embed_tokens.weight"
    return name


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def make_loss_fn(tp_mesh=None):
    """The loss for this layout: with tensor parallelism the head's logits arrive sharded along the
    vocabulary ([batch, seq, vocab/tp] per rank) and the cross-entropy runs on the shards (DTensor's
    ``loss_parallel``: a max, a sum of exponentials and the target's logit, each all-reduced), so no rank
    ever holds the whole logits. Forward and backward must run inside ``loss_parallel_context``."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return loss_fn

    def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        sharded = DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False)
        return loss_fn(sharded, labels).to_local()

    return vocab_parallel_loss


def loss_parallel_context(tp_mesh=None):
    """``loss_parallel()`` when the logits are vocabulary-sharded, else a no-op context."""
    import contextlib

    if tp_mesh is None or tp_mesh.size() == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
