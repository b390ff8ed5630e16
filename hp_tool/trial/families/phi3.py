"""Phi-3 / Phi-4 on the trial engine: transformers' Phi3, Llama's module layout with q, k and v fused into
``self_attn.qkv_proj`` and the MLP's gate and up into ``mlp.gate_up_proj`` (built from the spec's Hugging Face
config; see ``llama.decoder_family``). No TP plan: the planner refuses TP for the family (hp_tool/families/phi3.py),
as a column split of a fused projection would hand a rank parts of q, k and v that are not its heads. The
residual and embedding dropouts are off, as every trial's dropout is (every layout computes the same numbers)."""

from __future__ import annotations

from transformers import Phi3Config, Phi3ForCausalLM
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from hp_tool.trial.families.base import register
from hp_tool.trial.families.llama import decoder_family


def family_sizes(model) -> dict:
    """Dropouts off; without a Hugging Face config, no padding token (Phi3Config's default, 32000, is a row of a
    published vocabulary, not of a smaller one)."""
    return {"resid_pdrop": 0.0, "embd_pdrop": 0.0, **({} if model.hf_config else {"pad_token_id": None})}


register(decoder_family("phi3", Phi3Config, Phi3ForCausalLM, Phi3RotaryEmbedding, family_sizes=family_sizes,
                        layer_plan={}))
