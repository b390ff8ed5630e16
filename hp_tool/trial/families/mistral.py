"""Mistral on the trial engine: transformers' Mistral, Llama's module layout with sliding-window attention
(built from the spec's Hugging Face config; see ``llama.decoder_family``)."""

from __future__ import annotations

from transformers import MistralConfig, MistralForCausalLM
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding

from hp_tool.trial.families.base import register
from hp_tool.trial.families.llama import decoder_family

register(decoder_family("mistral", MistralConfig, MistralForCausalLM, MistralRotaryEmbedding))
