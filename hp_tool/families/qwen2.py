"""Qwen2 and Qwen2.5 (Hugging Face ``model_type`` qwen2): Llama's architecture with biases on the q, k and v
projections (none on o or the MLP), tied embeddings in the small sizes (``tie_word_embeddings``). Fine-tuned
from its Hugging Face config, never sized from a budget."""

from hp_tool.families.llama import hf_variant

FAMILY = hf_variant("qwen2", "Qwen2 / Qwen2.5: Llama's layers with q, k, v biases (from a Hugging Face config)",
                    qkv_bias=True)
