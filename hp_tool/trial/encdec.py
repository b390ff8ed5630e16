"""An encoder-decoder model (T5, mT5: transformers' ``T5ForConditionalGeneration`` or
``MT5ForConditionalGeneration``, see :mod:`hp_tool.trial.families.t5`) cut into one pipeline stage.

The model is built whole on the meta device and this rank's stage keeps only its own blocks: the pipeline
splits the 2·L blocks (the encoder's L, then the decoder's L, indexed 0..2L-1 whatever the layout), so the
encoder takes the first PP/2 stages and the decoder the rest (architectures.pipeline_problem). The first
stage embeds both the encoder and the decoder tokens with the shared embedding; the last normalises the
decoder output and applies the head, tied to that embedding (its own copy on another stage, kept equal as
GPT's is).

Between stages travel, per micro-batch: the encoder's hidden states (its output, after its final norm,
once the encoder is done: every decoder stage's cross-attention reads it), the decoder's hidden states
(its embedded tokens until the decoder starts) and, inside a stack, the stack's relative-position table
``[buckets, heads]``: the bias weights of the stack's first block. Each stage turns the table into its
``[1, heads, q, k]`` position bias, so the bias costs a few kilobytes between stages and its gradient flows
back to that first block's weights through the pipeline.

Dropout is off; attention is transformers' eager T5 attention (relative bias added to the scores); the
gated FFN uses the tanh GeLU of ``torch.nn.functional.gelu`` (T5 v1.1's gated-GeLU, one fused kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.t5.modeling_t5 import T5Attention

from hp_tool.architectures import checkpointed_layer_counts, stage_layer_counts
from hp_tool.families.t5 import RELATIVE_ATTENTION_BUCKETS
from hp_tool.contracts.spec import ModelSpec, TrialSpec
from hp_tool.trial.stage import StageModule

MAX_DISTANCE = 128  # T5's relative_attention_max_distance


@dataclass(frozen=True)
class EncDecParts:
    """Where one family's transformers model keeps the modules a stage takes."""

    blocks: list[nn.Module]  # the encoder's blocks, then the decoder's
    embedding: nn.Module  # shared by both stacks, tied to the head
    encoder_norm: nn.Module
    decoder_norm: nn.Module
    head: nn.Module
    bias_path: str  # a stack's relative-position table, in the stack's first block


def position_bias(table: torch.Tensor, query: int, key: int, bidirectional: bool) -> torch.Tensor:
    """T5's ``[1, heads, query, key]`` relative position bias from a stack's ``[buckets, heads]`` table
    (transformers' own bucketing, so the numbers are the model's)."""
    context = torch.arange(query, dtype=torch.long, device=table.device)[:, None]
    memory = torch.arange(key, dtype=torch.long, device=table.device)[None, :]
    buckets = T5Attention._relative_position_bucket(memory - context, bidirectional=bidirectional,
                                                    num_buckets=table.shape[0], max_distance=MAX_DISTANCE)
    return F.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """Additive ``[1, 1, length, length]`` mask hiding later decoder positions."""
    mask = torch.full((length, length), torch.finfo(torch.float32).min, device=device).triu(1)
    return mask[None, None]


class EncDecStage(StageModule):
    """One pipeline stage of T5/mT5. Inputs: encoder and decoder token ids ``[batch, seq]`` on the first
    stage; otherwise what the previous stage sent (see the module docstring). Output: logits
    ``[batch, decoder seq, vocab]`` on the last stage, else the tensors for the next stage."""

    def __init__(self, family: str, config, model: ModelSpec, pp: int, stage: int, layers: dict[int, nn.Module],
                 embed_tokens: Optional[nn.Module], enc_norm: Optional[nn.Module], dec_norm: Optional[nn.Module],
                 lm_head: Optional[nn.Module], bias_path: str):
        super().__init__()
        self.family = family
        self.config = config
        self.num_layers = model.num_layers  # per stack
        self.seq_length, self.decoder_seq_length = model.seq_length, model.decoder_seq_length
        self.shape, self.pp, self.stage_index = model.shape(), pp, stage
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.enc_norm = enc_norm
        self.dec_norm = dec_norm
        self.lm_head = lm_head
        self.tied = True
        self._encoder_keys = [str(i) for i in layers if i < self.num_layers]
        self._decoder_keys = [str(i) for i in layers if i >= self.num_layers]
        # The stacks' first blocks own the relative-position tables (at ``bias_path`` in the block); found by
        # index, not registered again as submodules, so every parameter keeps one name.
        self._bias_blocks = [index for index in (0, self.num_layers) if index in layers]
        self.bias_path = bias_path

    def reset_buffers(self, device: torch.device) -> None:
        """No buffers: the position bias is computed from the tables in every forward."""

    def bias_modules(self) -> list[nn.Module]:
        """The relative-position embeddings this stage holds (FSDP2 shards each as its own unit, as the
        stage calls them outside their block)."""
        return [self._bias_module(index) for index in self._bias_blocks]

    def _bias_module(self, index: int) -> nn.Module:
        return _unwrapped(self.layers[str(index)]).get_submodule(self.bias_path)

    def _table(self, index: int) -> torch.Tensor:
        """The ``[buckets, heads on this TP rank]`` table of the stack whose first block is ``index``."""
        module = self._bias_module(index)
        return module(torch.arange(RELATIVE_ATTENTION_BUCKETS, device=module.weight.device))

    def checkpoint_keys(self, act_ckpt_layers: int) -> list[str]:
        """Keys of the layers to recompute: the first ones of each stack on this stage."""
        k_enc, k_dec = checkpointed_layer_counts(self.shape, self.pp, self.stage_index, act_ckpt_layers)
        return self._encoder_keys[:k_enc] + self._decoder_keys[:k_dec]

    def forward(self, *args: torch.Tensor):
        table: Optional[torch.Tensor] = None
        if self.is_first:
            enc_ids, dec_ids = args
            enc, dec = self.embed_tokens(enc_ids), self.embed_tokens(dec_ids)
        else:
            enc, dec = args[0].view_as(args[0]), args[1].view_as(args[1])  # pass-throughs get their own node
            table = args[2].view_as(args[2]) if len(args) > 2 else None
        encoder = [self.layers[key] for key in self._encoder_keys]  # checkpoint wrappers replace blocks
        decoder = [self.layers[key] for key in self._decoder_keys]
        if encoder:
            table = self._table(0) if table is None else table
            bias = position_bias(table, self.seq_length, self.seq_length, bidirectional=True)
            for layer in encoder:
                enc = layer(enc, position_bias=bias)[0]
            if self.enc_norm is not None:  # the encoder ends here: its output for every cross-attention
                enc, table = self.enc_norm(enc), None
        if decoder:
            t = self.decoder_seq_length
            table = self._table(self.num_layers) if table is None else table
            bias = position_bias(table, t, t, bidirectional=False)
            mask = causal_mask(t, dec.device)
            for layer in decoder:
                dec = layer(dec, attention_mask=mask, position_bias=bias, encoder_hidden_states=enc)[0]
        if self.is_last:
            dec = self.dec_norm(dec)
            if getattr(self.config, "scale_decoder_outputs", False):  # T5's tied head; mT5's model does not
                dec = dec * (self.config.d_model ** -0.5)
            return self.lm_head(dec)
        return (enc, dec) if table is None else (enc, dec, table)


def _unwrapped(module: nn.Module) -> nn.Module:
    """The block inside a checkpoint wrapper (or the block itself)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def cut_encdec_stage(model: ModelSpec, config, parts: EncDecParts, pp: int, stage: int) -> EncDecStage:
    """Pipeline stage ``stage`` of ``pp`` from a whole T5/mT5 model on meta (``parts``); the other stages'
    modules are dropped."""
    n_layers = model.num_layers
    n_enc, n_dec = stage_layer_counts(model.shape(), pp, stage)
    first_index = stage * (2 * n_layers // pp)
    layers = {i: parts.blocks[i] for i in range(first_index, first_index + n_enc + n_dec)}
    first, last = stage == 0, stage == pp - 1
    ends_encoder = (n_layers - 1) in layers
    head = parts.head if last else None
    if head is not None and not first:
        head.weight = nn.Parameter(torch.empty_like(head.weight))  # kept equal to the embedding
    return EncDecStage(model.family, config, model, pp, stage, layers, parts.embedding if first else None,
                       parts.encoder_norm if ends_encoder else None, parts.decoder_norm if last else None, head,
                       parts.bias_path)


def encdec_fake_batch(spec: TrialSpec, stage_index: int, dtype: Optional[torch.dtype]):
    """One micro-batch of a stage's inputs for the memory tracer, (inputs, labels): encoder and decoder
    token ids on the first stage, else what the previous stage sends (the encoder's and the decoder's hidden
    states, and the stack's position table unless the previous stage ended the encoder, see
    ``EncDecStage.forward``); ``dtype``: the compute dtype, None for fp32. Values do not matter: the tracer
    runs under fake tensors."""
    m, par = spec.model, spec.parallel
    mbs, target = par.mbs, m.decoder_seq_length
    labels = torch.randint(0, m.vocab_size, (mbs, target))
    if stage_index == 0:
        return (torch.randint(0, m.vocab_size, (mbs, m.seq_length)), labels), labels

    def hidden(length: int) -> torch.Tensor:
        return torch.empty(mbs, length, m.hidden_size, dtype=dtype or torch.float32, requires_grad=True)

    inputs = (hidden(m.seq_length), hidden(target))
    if stage_index != par.pp // 2:  # the stage before ended the encoder: no table follows
        table = torch.empty(RELATIVE_ATTENTION_BUCKETS, m.num_attention_heads // par.tp,
                            dtype=dtype or torch.float32, requires_grad=True)
        inputs += (table,)
    return inputs, labels
