"""GPT-3 on the trial engine: transformers' OPT, which has GPT-3's layout (learned positions,
pre-LayerNorm, separate q/k/v with biases, GELU, input and output embeddings tied), with GPT-3's position table
of one row per position."""

from __future__ import annotations

from torch import nn
from transformers import OPTConfig, OPTForCausalLM
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

from hp_tool.contracts.spec import ModelSpec
from hp_tool.trial.causal import CausalParts, DecoderHooks, causal_fake_batch, cut_causal_stage
from hp_tool.trial.families.base import TorchFamily, TPStyle, register

# Megatron's split: q/k/v and the MLP's up projection by columns, the attention output and the MLP's down
# projection by rows, so each layer needs one all-reduce in forward and one in backward.
LAYER_PLAN: dict[str, TPStyle] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "fc1": "colwise", "self_attn.out_proj": "rowwise", "fc2": "rowwise",
}


def config(model: ModelSpec) -> OPTConfig:
    """OPT's config for a GPT-3 shape. Dropout is off so every layout computes the same numbers."""
    return OPTConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        ffn_dim=model.ffn_hidden_size, max_position_embeddings=model.seq_length,
        word_embed_proj_dim=model.hidden_size, do_layer_norm_before=True,
        activation_function="gelu", enable_bias=True, dropout=0.0, attention_dropout=0.0,
        layerdrop=0.0, tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
        pad_token_id=None,
    )


class GPT3Positions(OPTLearnedPositionalEmbedding):
    """GPT-3's learned positions: row ``p`` for position ``p``, ``seq_length`` rows. OPT's own table starts at
    row 2 (fairseq's padding offset) and so holds two rows no position reads: 2·h parameters the planner's
    count (``hp_tool.families.gpt3``) rightly leaves out (24,576 at 175B)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        nn.Embedding.__init__(self, num_embeddings, embedding_dim)
        self.offset = 0


class GPT3ForCausalLM(OPTForCausalLM):
    """transformers' OPT with :class:`GPT3Positions` in place of OPT's position table."""

    def __init__(self, config: OPTConfig):
        super().__init__(config)
        self.model.decoder.embed_positions = GPT3Positions(config.max_position_embeddings, config.hidden_size)


def cut_stage(model: ModelSpec, full: nn.Module, pp: int, stage: int, hooks: DecoderHooks):
    """This stage of an ``OPTForCausalLM`` on meta (its decoder holds embeddings, layers and final norm)."""
    body = full.model.decoder
    parts = CausalParts(body.layers, body.embed_tokens, body.embed_positions, body.final_layer_norm, full.lm_head)
    return cut_causal_stage(model, full.config, parts, pp, stage, hooks=hooks)


def shard_heads(layer: nn.Module, tp: int) -> None:
    """OPT's attention reshapes with ``num_heads``: each TP rank holds heads/tp of them."""
    for module in layer.modules():
        if hasattr(module, "num_heads") and hasattr(module, "out_proj"):
            module.num_heads //= tp


# No sequence-parallel plan (OPT's layer calls its MLP's linears itself, no module to gather the sequence at)
# and no context parallelism (learned positions): the planner's record refuses both for gpt3.
register(TorchFamily(name="gpt3", config=config, model_class=GPT3ForCausalLM, cut_stage=cut_stage,
                     layer_plan=lambda layer: LAYER_PLAN, shard_heads=shard_heads, sequence_plan=None, attention=None,
                     fake_batch=causal_fake_batch))
