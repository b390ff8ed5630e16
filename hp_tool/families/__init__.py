"""Model families: one file each, registered here. Pure, no torch.

    registry.py  the ``Family`` record and the lookup (``family(name)``, ``family_names()``)
    shape.py     ``Shape``, a family-neutral transformer shape, and NeMo's layer-count search
    decoder.py   formulas every decoder-only family shares (matmul FLOPs per layer)
    gpt3.py      GPT-3 (NeMo's sizes, learned positions, tied head)
    llama.py     Llama-style (grouped-query attention, SwiGLU, RMSNorm, RoPE, untied head)
    t5.py        T5 and mT5 (encoder-decoder, NeMo's sizes)
    mistral.py   Mistral (Llama's layers, sliding window), from a Hugging Face config only
    qwen2.py     Qwen2 / Qwen2.5 (Llama's layers with q, k, v biases), from a Hugging Face config only
    qwen3.py     Qwen3 (Llama's layers with per-head q and k norms), from a Hugging Face config only
    phi3.py      Phi-3 / Phi-4 (Llama's layers, fused q/k/v and gate/up projections), from a Hugging Face config only
    gemma.py     Gemma-2 and Gemma-3 (four norms a layer, soft caps, alternating sliding windows), from a Hugging
                 Face config only
    moe.py       mixtures of experts: ``moe`` (sized by active parameters), and from a Hugging Face config
                 only ``mixtral`` and ``qwen2_moe`` (a shared expert, q, k, v biases); ``qwen3_moe`` in qwen3.py

A new family is one file here that builds a ``Family``, one torch file in ``hp_tool/trial/families/`` and
its YAML presets under ``hp_tool/conf/search_config/``.
"""

from hp_tool.families import gemma, gpt3, llama, mistral, moe, phi3, qwen2, qwen3, t5  # noqa: I001 (registration)
from hp_tool.families.registry import Family, family, family_names, hf_model_types, register

MIXTRAL = moe.hf_moe_variant("mixtral", "Mixtral: Mistral's layers with top-2 of 8 experts (from a Hugging Face config)",
                             qkv_bias=False)
QWEN2_MOE = moe.hf_moe_variant(
    "qwen2_moe", "Qwen1.5/Qwen2-MoE: q, k, v biases, fine-grained routed experts and a gated shared expert (from a "
    "Hugging Face config)", qkv_bias=True).variant(
    layer_ops=(105, 203, 191), layer_tensors=(12, 13), layer_bytes=((179, 64), (412, 134), (163, 64)))

for _record in (gpt3.FAMILY, llama.FAMILY, t5.T5, t5.MT5, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, phi3.FAMILY,
                gemma.GEMMA2, gemma.GEMMA3, moe.FAMILY, MIXTRAL, QWEN2_MOE, qwen3.MOE):
    register(_record)

__all__ = ["Family", "family", "family_names", "hf_model_types"]
