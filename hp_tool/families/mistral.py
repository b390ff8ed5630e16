"""Mistral (Hugging Face ``model_type`` mistral): Llama's architecture (grouped-query attention, SwiGLU,
RMSNorm, RoPE, no biases, untied head) with sliding-window attention, which changes neither parameters nor
matmul FLOPs at sequences up to the window (longer ones are refused, hp_tool/hf_config.py). Fine-tuned from
its Hugging Face config, never sized from a budget."""

from hp_tool.families.llama import hf_variant

FAMILY = hf_variant("mistral", "Mistral: Llama's layers with sliding-window attention (from a Hugging Face config)",
                    qkv_bias=False)
