"""GPU memory traffic of an eager layer's element-wise work: the bytes its operators other than matmuls and attention
read and write, by family, against the records the step-time model prices (hp_tool/estimate/speed.py
``elementwise_s``).

    python benchmarks/elementwise_bytes.py [--families llama,gpt3,...]

An eager layer runs its norms (with their fp32 casts), rotary embeddings, activations, residual adds and casts as
separate kernels, each reading its inputs from GPU memory and writing its output back; they are bound by memory
bandwidth, not FLOPs, and the matmul efficiency does not price them. This script counts them on the trial engine's
own stage of each family in bf16 (bf16 weights under bf16 autocast, as a GPU trial runs): a dispatch mode adds up the bytes of every tensor each aten operator takes and
returns, matmuls (mm, addmm, bmm), attention kernels, views and single values left out, over a 4- and a 2-layer
tiny stage (the difference is the layers'), forward, backward, and what a checkpointed layer's backward adds (its
recompute). Bytes per token are linear in the layer's widths; two stages with the feed-forward width 128 and 256
(hidden 64) separate them: bytes per token = a x hidden + b x ffn (a mixture of experts: ffn x the tokens' top_k
experts). Against the family's ``Family.time.layer_bytes`` ((a, b) for forward, backward, recompute) and LoRA's
``ADAPTER_BYTES`` per adapted linear's input and output features; tests/test_elementwise_bytes.py holds the
records to ``BYTES_TOLERANCE``. A T5 layer is the mean of an encoder and a decoder layer.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from benchmarks.host_overhead import _forward, _inputs, _stage, tiny_model  # noqa: E402
from hp_tool.contracts.spec import ModelSpec  # noqa: E402
from hp_tool.families.methods import linear_shapes  # noqa: E402
from hp_tool.estimate.speed import ADAPTER_BYTES, elementwise_ffn  # noqa: E402
from hp_tool.families.registry import family, family_names  # noqa: E402

BYTES_TOLERANCE = 0.1
# operators whose traffic is not element-wise: the matmuls (the FLOPs priced at the matmul efficiency), attention
# kernels (priced apart), and per-model work (embedding, loss) outside the layers
NOT_ELEMENTWISE = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product", "_flash_attention", "_efficient_attention",
                   "embedding", "nll_loss", "_log_softmax")
VIEWS = ("_unsafe_view", "detach", "alias", "lift_fresh")
FFN = (128, 256)  # the two feed-forward widths at hidden 64
SEQ = (16, 32)  # two micro-batch lengths: what an adapter moves per token against per micro-batch


class _Bytes(TorchDispatchMode):
    """Bytes read and written by the element-wise operators dispatched under it."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name in VIEWS or name.startswith(NOT_ELEMENTWISE):
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor) and t.numel() > 1]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _widened(model: ModelSpec, ffn: int) -> ModelSpec:
    fields = dict(model.__dict__, ffn_hidden_size=ffn)
    if model.hf_config:
        config = dict(model.hf_config)
        for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if config.get(key):
                config[key] = ffn if key == "intermediate_size" else ffn // 2
        fields["hf_config"] = config
    return ModelSpec(**fields)


def stage_bytes(model: ModelSpec, checkpointed: bool) -> tuple[int, int]:
    """(forward, backward) element-wise bytes of the engine's stage of ``model`` in bf16 for one micro-batch, its
    weights held as a GPU trial holds them: bf16 (FSDP2's compute dtype) under full training; an adapter method's
    frozen base in bf16 and its adapters fp32 (hp_tool/trial/weights.py ``hold_in``)."""
    device = torch.device("cpu")
    stage, inputs = _stage(model, device, checkpointed), _inputs(model, device)
    for param in stage.parameters():
        if model.method == "full" or not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    count = _Bytes()
    with torch.autocast("cpu", torch.bfloat16), count:  # as a GPU trial: bf16 autocast
        out = _forward(stage, inputs)
        forward = count.bytes
        out.float().sum().backward()
    return forward, count.bytes - forward


def _per_layer_token(name: str, method: str, ffn: int, checkpointed: bool, seq: int) -> tuple[float, float]:
    small, large = (_widened(tiny_model(name, layers, method, seq), ffn) for layers in (2, 4))
    (f2, b2), (f4, b4) = stage_bytes(small, checkpointed), stage_bytes(large, checkpointed)
    per = (large.shape().pipeline_layers - small.shape().pipeline_layers) * small.seq_length
    return (f4 - f2) / per, (b4 - b2) / per


def pass_bytes(name: str, method: str = "full", ffn: int = FFN[0], seq: int = SEQ[0]) -> tuple[float, float, float]:
    """(forward, backward, recompute) element-wise bytes per token of one layer of family ``name`` at hidden 64,
    feed-forward width ``ffn`` and ``seq`` tokens a micro-batch."""
    forward, backward = _per_layer_token(name, method, ffn, False, seq)
    _, checkpointed = _per_layer_token(name, method, ffn, True, seq)
    return forward, backward, checkpointed - backward


def _ffn_width(name: str, ffn: int) -> float:
    """The feed-forward width a token's element-wise work runs over at ``ffn`` (``speed.elementwise_ffn``)."""
    return elementwise_ffn(_widened(tiny_model(name, 2), ffn).shape())


def layer_bytes(name: str) -> tuple[tuple[float, float], ...]:
    """((hidden, ffn) coefficients of the bytes per token) of one layer's forward, backward and recompute, full
    training: from the counts at two feed-forward widths."""
    hidden = tiny_model(name, 2).hidden_size
    (w1, w2) = (_ffn_width(name, f) for f in FFN)
    low, high = pass_bytes(name, ffn=FFN[0]), pass_bytes(name, ffn=FFN[1])
    out = []
    for a, b in zip(low, high):
        per_ffn = (b - a) / (w2 - w1)
        out.append(((a - per_ffn * w1) / hidden, per_ffn))
    return tuple(out)


def adapter_bytes(name: str = "llama") -> tuple[float, float, float]:
    """(forward, backward, recompute) bytes per token LoRA adds per input and output feature of an adapted linear
    (every linear of ``name``'s layer adapted, dropout 0). What an adapter moves per micro-batch whatever its
    tokens (the casts of fp32 A and B to bf16 and of their gradients back: about 17 x rank bytes per feature,
    under 3% of the per-token bytes at rank 16 and 2048 tokens) is separated out by counting at two micro-batch
    lengths (bytes per token = a + b / tokens); the per-token part, a, is returned."""
    features = sum(i + o for i, o in linear_shapes(tiny_model(name, 2).shape()).values())
    per_seq = []
    for seq in SEQ:
        full, lora = pass_bytes(name, seq=seq), pass_bytes(name, "lora", seq=seq)
        per_seq.append([(a - f) / features for f, a in zip(full, lora)])
    ratio = SEQ[1] / SEQ[0]
    return tuple((ratio * b - a) / (ratio - 1) for a, b in zip(*per_seq))


def within(counted: float, record: float, scale: float) -> bool:
    """A record within ``BYTES_TOLERANCE`` of the count, relative to the pass's bytes (``scale``)."""
    return abs(counted - record) <= BYTES_TOLERANCE * scale


def mismatches(name: str, counted: tuple[tuple[float, float], ...]) -> list[str]:
    """Where family ``name``'s ``layer_bytes`` record is not within ``BYTES_TOLERANCE`` of ``counted``: each pass's
    bytes per token at the tiny stage's widths, and its ffn coefficient (relative to the pass's bytes per ffn
    column); [] when the record holds."""
    hidden, ffn = tiny_model(name, 2).hidden_size, _ffn_width(name, FFN[0])
    out = []
    for what, c, r in zip(("forward", "backward", "recompute"), counted, family(name).time.layer_bytes):
        total = c[0] * hidden + c[1] * ffn
        if not within(total, r[0] * hidden + r[1] * ffn, total):
            out.append(f"{name} {what}: the record says {r}, the engine's layer moves {c[0]:.0f} x hidden + "
                       f"{c[1]:.1f} x ffn")
        if not within(c[1], r[1], total / ffn):
            out.append(f"{name} {what}: ffn bytes {r[1]} recorded, {c[1]:.1f} counted")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(family_names()))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print("Element-wise bytes per token of one layer, bf16, counted on the engine's stage: a x hidden + b x ffn "
          "(counted / the family's record)\n")
    print("| family | forward a, b | backward a, b | recompute a, b | within 10% |")
    print("|---|---|---|---|---|")
    ok = True
    for name in args.families.split(","):
        counted, record = layer_bytes(name), family(name).time.layer_bytes
        good = not mismatches(name, counted)
        ok &= good
        cells = " | ".join(f"{c[0]:.0f}, {c[1]:.1f} / {r[0]:g}, {r[1]:g}" for c, r in zip(counted, record))
        print(f"| {name} | {cells} | {'yes' if good else 'NO'} |")
    counted = adapter_bytes()
    print(f"\nLoRA per adapted linear's input and output feature (Llama, every linear): forward, backward, recompute "
          f"{', '.join(f'{c:.1f}' for c in counted)} (ADAPTER_BYTES {ADAPTER_BYTES})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
