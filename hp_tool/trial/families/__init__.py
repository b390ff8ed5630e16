"""The torch half of the model-family registry: one module per family, each registering a
:class:`~hp_tool.trial.families.base.TorchFamily` (config, model class, stage cut, TP and sequence-parallel
plans, the attention module context parallelism splits, the stage's forward hooks, head counts, the
tracer's fake inputs, stacks). Every module in this folder is imported here, so a new family is one file;
the engine asks ``torch_family(spec.model.family)``, never compares family names and never names a
family's modules itself.

    base.py    the record, ``register``, ``torch_family`` (unknown names fail naming the known ones)
    gpt3.py    GPT-3 as transformers' OPT: learned positions, LayerNorm, GELU MLP with biases, tied head
    llama.py   Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head; ``decoder_family`` for
               models with its module layout (its plans, and stage hooks a family may set)
    mistral.py Mistral (Llama's layout, sliding-window attention), from its Hugging Face config
    qwen2.py   Qwen2 / Qwen2.5 (Llama's layout, q/k/v biases), from its Hugging Face config
    qwen3.py   Qwen3 (Llama's layout, per-head q and k norms), from its Hugging Face config
    phi3.py    Phi-3 / Phi-4 (fused q/k/v and gate/up projections; no TP plan), from its Hugging Face config
    gemma.py   Gemma-2 and Gemma-3 (four norms a layer, scaled embeddings, soft caps, alternating sliding
               windows; Gemma-2's attention on the eager kernel), from their Hugging Face configs
    moe.py     mixtures of experts: moe and mixtral (transformers' Mixtral), qwen2_moe (a shared expert), qwen3_moe;
               TP on attention only, transformers' expert-parallel plan
    t5.py      T5 and mT5 (each its own config and model class): encoder and decoder stacks
"""

from __future__ import annotations

import importlib
import pkgutil

from hp_tool.trial.families.base import TorchFamily, known_families, register, torch_family

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":  # each family module registers itself on import
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["TorchFamily", "known_families", "register", "torch_family"]
