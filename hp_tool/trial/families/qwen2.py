"""Qwen2 / Qwen2.5 on the trial engine: transformers' Qwen2, Llama's module layout with q, k and v biases
(built from the spec's Hugging Face config; see ``llama.decoder_family``). Under TP the biases split with
their projections' columns."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from hp_tool.trial.families.base import register
from hp_tool.trial.families.llama import decoder_family

register(decoder_family("qwen2", Qwen2Config, Qwen2ForCausalLM, Qwen2RotaryEmbedding))
