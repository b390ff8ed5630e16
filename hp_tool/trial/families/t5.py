"""T5 and mT5 on the trial engine: transformers' ``T5ForConditionalGeneration`` and
``MT5ForConditionalGeneration`` (each its own config and model class), gated-GeLU FFN, relative position
buckets in each stack's first block, head tied to the shared embedding. The stage itself (both stacks,
position tables carried between stages) is :mod:`hp_tool.trial.encdec`'s."""

from __future__ import annotations

from torch import nn
from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

from hp_tool.families.t5 import RELATIVE_ATTENTION_BUCKETS
from hp_tool.contracts.spec import ModelSpec
from hp_tool.trial.causal import DecoderHooks
from hp_tool.trial.encdec import MAX_DISTANCE, EncDecParts, cut_encdec_stage, encdec_fake_batch
from hp_tool.trial.families.base import TorchFamily, TPStyle, register

# Per block: self-attention (and the decoder's cross-attention) q/k/v by columns and o by rows, both
# gated-FFN inputs by columns and the output by rows; a stack's relative-position embedding ([buckets,
# heads]) by columns as q is, so each rank holds its own heads' biases.
_ATTENTION = (("SelfAttention.q", "SelfAttention.k", "SelfAttention.v"), ("SelfAttention.o",))
_CROSS = (("EncDecAttention.q", "EncDecAttention.k", "EncDecAttention.v"), ("EncDecAttention.o",))
_FFN = (("DenseReluDense.wi_0", "DenseReluDense.wi_1"), ("DenseReluDense.wo",))
BIAS_PATH = "layer.0.SelfAttention.relative_attention_bias"  # a stack's first block's position table


def _block_plan(parts: tuple) -> dict[str, TPStyle]:
    """The plan of a block made of ``parts`` (its ``layer.<i>`` sub-layers): columns first, then rows."""
    return {f"layer.{i}.{name}": style for side, style in enumerate(("colwise", "rowwise"))
            for i, part in enumerate(parts) for name in part[side]}


ENCODER_PLAN = _block_plan((_ATTENTION, _FFN))
DECODER_PLAN = _block_plan((_ATTENTION, _CROSS, _FFN))


def layer_plan(block: nn.Module) -> dict[str, TPStyle]:
    """The TP plan of one T5 block: the decoder's has cross-attention; a stack's first block also splits
    the relative-position table."""
    plan = dict(DECODER_PLAN if block.is_decoder else ENCODER_PLAN)
    if block.layer[0].SelfAttention.has_relative_attention_bias:
        plan[BIAS_PATH] = "colwise"  # Shard(1) of [buckets, heads]: this rank's heads, as q's
    return plan


def shard_heads(block: nn.Module, tp: int) -> None:
    """T5's attention reshapes with ``n_heads`` and sizes the cross-attention's zero bias with
    ``inner_dim``: each TP rank holds heads/tp of them."""
    for module in block.modules():
        if hasattr(module, "n_heads") and hasattr(module, "inner_dim"):
            module.n_heads //= tp
            module.inner_dim //= tp


def cut_stage(model: ModelSpec, full: nn.Module, pp: int, stage: int, hooks: DecoderHooks):
    """This stage of a T5/mT5 model on meta: the encoder's blocks then the decoder's, the shared embedding,
    each stack's final norm, the head (``hooks``, a decoder-only stage's, do not apply: T5's record keeps
    the defaults)."""
    parts = EncDecParts(list(full.encoder.block) + list(full.decoder.block), full.shared,
                        full.encoder.final_layer_norm, full.decoder.final_layer_norm, full.lm_head, BIAS_PATH)
    return cut_encdec_stage(model, full.config, parts, pp, stage)


def _config_builder(config_cls: type):
    """The ``TorchFamily.config`` of a family whose config class is ``config_cls`` (T5Config, MT5Config)."""

    def config(model: ModelSpec):
        """The transformers config for a T5/mT5 spec: dropout off, eager attention (relative bias added to
        the scores), no KV cache, tied head, T5 v1.1's gated GeLU (tanh)."""
        return config_cls(
            vocab_size=model.vocab_size, d_model=model.hidden_size, d_kv=model.kv_channels or
            model.hidden_size // model.num_attention_heads, d_ff=model.ffn_hidden_size,
            num_layers=model.num_layers, num_decoder_layers=model.num_layers, num_heads=model.num_attention_heads,
            relative_attention_num_buckets=RELATIVE_ATTENTION_BUCKETS, relative_attention_max_distance=MAX_DISTANCE,
            dropout_rate=0.0, feed_forward_proj="gated-gelu_pytorch_tanh", tie_word_embeddings=True,
            use_cache=False, attn_implementation="eager",
        )

    return config


def _encdec_family(name: str, config_cls: type, model_class: type) -> TorchFamily:
    """One encoder-decoder family: the encoder on the first PP/2 stages, the decoder on the rest."""
    # no sequence or context parallelism for T5's blocks (the planner's record refuses both)
    return TorchFamily(name=name, config=_config_builder(config_cls), model_class=model_class,
                       cut_stage=cut_stage, layer_plan=layer_plan, shard_heads=shard_heads, sequence_plan=None,
                       attention=None, fake_batch=encdec_fake_batch, stacks=2, stack_starts=lambda pp: (0, pp // 2))


register(_encdec_family("t5", T5Config, T5ForConditionalGeneration))
register(_encdec_family("mt5", MT5Config, MT5ForConditionalGeneration))
