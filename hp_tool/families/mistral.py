"""Mistral (Hugging Face ``model_type`` mistral): Llama's architecture (grouped-query attention, SwiGLU,
RMSNorm, RoPE, no biases, untied head) with sliding-window attention, which changes neither parameters nor
matmul FLOPs at sequences up to the window. Fine-tuned from its Hugging Face config (hp_tool/hf_config.py),
never sized from a budget."""

from __future__ import annotations

import dataclasses

from hp_tool.families import llama

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="mistral",
    description="Mistral: Llama's layers with sliding-window attention (from a Hugging Face config)",
    planner=False,
    hf_unmodelled=(),
    hf_qkv_bias=lambda config: False,
)
