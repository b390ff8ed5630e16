"""Qwen2 and Qwen2.5 (Hugging Face ``model_type`` qwen2): Llama's architecture with biases on the q, k and v
projections (none on o or the MLP), tied embeddings in the small sizes (``tie_word_embeddings``). Fine-tuned
from its Hugging Face config (hp_tool/hf_config.py), never sized from a budget."""

from __future__ import annotations

import dataclasses

from hp_tool.families import llama

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="qwen2",
    description="Qwen2 / Qwen2.5: Llama's layers with q, k, v biases (from a Hugging Face config)",
    planner=False,
    hf_unmodelled=(),
    hf_qkv_bias=lambda config: True,
)
