"""Qwen3 on the trial engine: transformers' Qwen3, Llama's module layout with an RMSNorm over each head of q and
k (``self_attn.q_norm``, ``k_norm``; built from the spec's Hugging Face config, see ``llama.decoder_family``).
The norms act on one head at a time, so under TP they stay whole beside the heads each rank holds."""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from hp_tool.trial.families.base import register
from hp_tool.trial.families.llama import decoder_family

register(decoder_family("qwen3", Qwen3Config, Qwen3ForCausalLM, Qwen3RotaryEmbedding))
