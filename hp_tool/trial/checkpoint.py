"""A Hugging Face checkpoint's weights into the trial's model, and the trial's model back out as one.

Loading reads tensors by name from the checkpoint's safetensors files (``model.safetensors``, or the shards
that ``model.safetensors.index.json`` lists), one whole tensor at a time, and each rank keeps its own shard
(``hp_tool.trial.weights.init_weights`` with this as the source): meta-device init + per-tensor load, so a
process holds at most one full tensor of host memory beyond its shards (the largest: the embedding).
A parameter's layout-independent name (``layers.3.self_attn.q_proj.weight``) maps to the checkpoint's key
by the family's ``hf_key`` (``hp_tool.trial.families``); a tensor a published checkpoint stores in parts (a
mixture of experts' per-expert projections, ``TorchFamily.hf_parts``) is fused as transformers fuses it.

Saving gathers the full state dict (every shard, every pipeline stage), cast to the config's dtype, on
rank 0 (2 bytes per parameter of host RAM for a 16-bit model), which writes ``model.safetensors`` and
``config.json`` in the format ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional

import torch

from hp_tool.contracts.spec import ModelSpec
from hp_tool.errors import ConfigError, require
from hp_tool.trial.families import torch_family
from hp_tool.trial.families.base import StoredParts
from hp_tool.trial.methods import is_adapter
from hp_tool.trial.models import build_full_model_on_meta
from hp_tool.trial.stage import HEAD

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointReader:
    """Lazy, by-name access to a Hugging Face checkpoint's tensors (safetensors only)."""

    def __init__(self, folder: str | Path, key: str = "model.checkpoint"):
        self.folder = Path(folder).expanduser()
        self.key = key
        index, single = self.folder / INDEX, self.folder / SINGLE
        if index.is_file():
            self.files = {name: self.folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            self.files = {name: single for name in self._keys(single)}
        else:
            raise ConfigError(key, str(folder), f"has no {SINGLE} or {INDEX}",
                              "give a Hugging Face model directory saved with safetensors (save_pretrained)")

    @staticmethod
    def _keys(path: Path) -> list[str]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            return list(fh.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name`` (read from the file's header, no data)."""
        from safetensors import safe_open

        with safe_open(str(self._file(name)), framework="pt") as fh:
            return tuple(fh.get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (its own dtype), on the CPU."""
        from safetensors import safe_open

        with safe_open(str(self._file(name)), framework="pt") as fh:
            return fh.get_tensor(name)

    def _file(self, name: str) -> Path:
        require(name in self.files, self.key, str(self.folder), f"has no tensor {name!r}",
                "give the checkpoint of the model the config describes")
        return self.files[name]

    @cached_property
    def names(self) -> set[str]:
        return set(self.files)

    def parts_of(self, name: str, parts: Optional[StoredParts]) -> Optional[StoredParts]:
        """How ``name`` is stored: None whole (or missing), else its parts (``TorchFamily.hf_parts``) when the
        file has them all."""
        if name in self.names or parts is None:
            return None
        return parts if all(k in self.names for group in parts.groups for k in group) else None

    def fused_shape(self, name: str, parts: Optional[StoredParts]) -> Optional[tuple[int, ...]]:
        """The shape of ``name`` whole or fused from its parts; None when the file has neither."""
        stored = self.parts_of(name, parts)
        if stored is None:
            return self.shape(name) if name in self.names else None
        shapes = [[self.shape(k) for k in group] for group in stored.groups]
        slices = [(sum(s[0] for s in group),) + group[0][1:] for group in shapes]
        return ((len(slices),) if stored.stacked else ()) + slices[0]

    def fused_tensor(self, name: str, parts: Optional[StoredParts]) -> torch.Tensor:
        """Tensor ``name`` as stored, or fused from its parts as transformers does while loading."""
        stored = self.parts_of(name, parts)
        if stored is None:
            return self.tensor(name)
        slices = [torch.cat([self.tensor(k) for k in group]) for group in stored.groups]
        return torch.stack(slices) if stored.stacked else slices[0]


def check_checkpoint(model: ModelSpec, folder: str | Path, key: str = "model.checkpoint") -> None:
    """Every parameter of the model the spec describes is in the checkpoint at its shape; raises a
    ConfigError naming the first that is missing or differs (a checkpoint of another model)."""
    reader = CheckpointReader(folder, key)
    whole = build_full_model_on_meta(model)
    hf_parts = torch_family(model.family).hf_parts
    head = whole.get_output_embeddings()
    for name, param in whole.named_parameters():
        shape = reader.fused_shape(name, hf_parts(model, name))
        if shape is None and whole.config.tie_word_embeddings and head is not None and param is head.weight:
            continue  # tied: the embedding's matrix
        require(shape is not None, key, str(folder), f"has no tensor {name!r}",
                "give the checkpoint of the model model.hf_config describes")
        require(shape == tuple(param.shape), key, str(folder),
                f"{name} is {list(shape)} in the checkpoint but {list(param.shape)} in its config",
                "give the checkpoint and the config.json of the same model")


def weight_source(model: ModelSpec) -> Optional[Callable[[str, torch.Size], torch.Tensor]]:
    """``(canonical name, shape) -> full fp32 tensor`` from the spec's checkpoint; None without one."""
    if not model.checkpoint:
        return None
    hf_key = torch_family(model.family).hf_key
    require(hf_key is not None, "model.checkpoint", model.checkpoint,
            f"loading a checkpoint is not supported for the {model.family} family",
            "fine-tune a Hugging Face model (search_config=finetune/...), or remove model.checkpoint")
    reader = CheckpointReader(model.checkpoint)
    hf_parts = torch_family(model.family).hf_parts

    def source(name: str, shape: torch.Size) -> torch.Tensor:
        value = reader.fused_tensor(hf_key(name), hf_parts(model, hf_key(name)))
        require(tuple(value.shape) == tuple(shape), "model.checkpoint", model.checkpoint,
                f"{hf_key(name)} is {list(value.shape)} in the checkpoint but {list(shape)} in the model",
                "give the checkpoint and the config.json of the same model")
        return value.float()

    return source


def save_adapter(state: dict[str, torch.Tensor], model: ModelSpec, folder: str | Path, hf_key) -> Path:
    """Write a LoRA run's adapters in peft's format (``adapter_model.safetensors`` and
    ``adapter_config.json``), which ``PeftModel.from_pretrained(<the base model>, folder)`` loads."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors = {f"base_model.model.{hf_key(name.replace('.default.', '.'))}": t.contiguous()
               for name, t in sorted(state.items()) if is_adapter(name)}
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    lora = model.lora
    LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
               bias="none", task_type="CAUSAL_LM", base_model_name_or_path=model.checkpoint).save_pretrained(str(out))
    return out


def save_dtype(model: ModelSpec) -> torch.dtype:
    """The dtype a fine-tuned model is saved in: its config's (``torch_dtype``), fp32 without one."""
    named = str((model.hf_config or {}).get("torch_dtype") or (model.hf_config or {}).get("dtype"))
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(named, torch.float32)


def split_parts(key: str, tensor: torch.Tensor, parts: Optional[StoredParts]) -> dict[str, torch.Tensor]:
    """``key``'s tensor as a published checkpoint stores it: whole, or split into its parts (the inverse of
    ``CheckpointReader.fused_tensor``: one slice per expert, each cut evenly into its group's parts)."""
    if parts is None:
        return {key: tensor.contiguous()}
    slices = list(tensor) if parts.stacked else [tensor]
    return {k: piece.contiguous() for group, whole in zip(parts.groups, slices, strict=True)
            for k, piece in zip(group, whole.chunk(len(group)), strict=True)}


def save_checkpoint(state: dict[str, torch.Tensor], model: ModelSpec, folder: str | Path) -> Path:
    """Write ``state`` (canonical names -> full tensors in ``save_dtype``, :meth:`Engine.full_state_dict`)
    as a Hugging Face checkpoint: ``model.safetensors`` and ``config.json``, tensors named and laid out as the
    model's published checkpoints (a mixture of experts' per-expert projections, as ``save_pretrained``
    writes them and other tools read them). A tied head is the embedding's matrix and is not stored twice."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    hf_key = torch_family(model.family).hf_key
    require(hf_key is not None and model.hf_config is not None, "run.save_dir", str(folder),
            f"saving a Hugging Face checkpoint needs a model from a Hugging Face config, not {model.family}",
            "fine-tune a Hugging Face model (search_config=finetune/...), or remove run.save_dir")
    if model.method != "full":
        return save_adapter(state, model, folder, hf_key)
    config = AutoConfig.for_model(**model.hf_config)
    hf_parts = torch_family(model.family).hf_parts
    tensors = {}
    for name, t in sorted(state.items()):
        tensors.update(split_parts(hf_key(name), t, hf_parts(model, hf_key(name))))
    if config.tie_word_embeddings:
        tensors.pop(hf_key(f"{HEAD}.weight"), None)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
    config.save_pretrained(out)
    return out
