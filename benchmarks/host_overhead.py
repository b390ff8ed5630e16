"""Host time of an eager step: the operators one layer dispatches, by family, and the seconds each costs.

    python benchmarks/host_overhead.py [--families llama,gpt3,...] [--device cpu|cuda] [--repeats 30]

An eager step launches every operator of every layer from Python; where the kernels are small (short sequences,
micro-batch 1) the host's dispatch, not the GPU, sets the step time (hp_tool/estimate/host.py). This script
measures what that model takes as given:

1. the aten operators one layer of the trial engine's own stage dispatches in forward and in backward, full
   training, counted with a dispatch mode on a tiny stage of each family (2 and 4 layers: the difference is
   the layers'), against the family's record (``Family.time.layer_ops``), and what LoRA adds per adapted linear
   (``ADAPTER_OPS``);
2. the host seconds per operator: the tiny Llama stage's forward and backward timed on ``--device`` with
   tensors so small that the kernels cost nothing next to their dispatch (2 against 10 layers, one thread,
   fastest of ``--repeats``), full and LoRA, with and without activation checkpointing (the engine's
   ``checkpoint_wrapper``), against the model's ``HOST_SECONDS_PER_OP`` x the operators dispatched. On a GPU
   each operator is also a kernel launch, which this measures there (``--device cuda``).

3. the engine's own hooks (``--engines``, DeepSpeed at ZeRO-2 and 3): a DeepSpeed micro-batch (forward,
   ``backward``, ``step`` off the accumulation boundary) of the tiny Llama stage on one CPU rank against the same
   stage's plain forward and backward, 2 against 10 layers, full and LoRA, with and without checkpointing: the host
   seconds DeepSpeed adds per layer, against the model's (``EngineFacts.gradient_hook_s`` per trained tensor and
   ``module_hook_s`` per module and pass over the family's ``layer_tensors``, ``hp_tool.estimate.host.hook_s``),
   and the constants the full, uncheckpointed runs give (ZeRO-2: its seconds per trained tensor; ZeRO-3: beyond
   that, per module and pass). The parameter-holding modules and tensors of a layer are counted against the
   family's ``layer_tensors``.

Prints a table per part and whether each record is within the tolerance tests/test_host_overhead.py holds it to.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hp_tool.contracts.spec import LoraSpec, ModelSpec  # noqa: E402
from hp_tool.engine_facts import engine_facts  # noqa: E402
from hp_tool.estimate.host import ADAPTER_OPS, HOST_SECONDS_PER_OP, hook_s, layer_hooked  # noqa: E402
from hp_tool.estimate.layout import Layout  # noqa: E402
from hp_tool.families.methods import linear_shapes  # noqa: E402
from hp_tool.families.registry import family, family_names  # noqa: E402
from hp_tool.trial.dist import DistEnv, init_distributed  # noqa: E402
from hp_tool.trial.models import build_stage  # noqa: E402
from hp_tool.trial.parallel import apply_activation_checkpointing  # noqa: E402

OPS_TOLERANCE = 0.10  # a family's record within 10% of the count
TINY = dict(hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=256, seq_length=16)
# families built from a Hugging Face config, as a fine-tuning trial builds them: transformers' config of the
# tiny shape (heads of 16 over 64, Gemma's and Qwen3's heads given as they publish them apart from the width)
HF = {"mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=16), "phi3": dict(pad_token_id=None, bos_token_id=None,
                                                                         eos_token_id=None),
      "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8), "gemma3_text": dict(head_dim=16,
                                                                                                 sliding_window=8),
      "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
      "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64),
      "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16)}


def tiny_model(name: str, layers: int, method: str = "full", seq: Optional[int] = None) -> ModelSpec:
    """A tiny ``layers``-layer model of family ``name`` (from transformers' config where the family reads one),
    ``seq`` tokens a sequence (default ``TINY``'s)."""
    spec = dict(TINY, num_layers=layers, seq_length=seq or TINY["seq_length"])
    if name in HF:
        from transformers import AutoConfig

        config = AutoConfig.for_model(name, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                      max_position_embeddings=64, **HF[name]).to_dict()
        experts = config.get("num_local_experts", config.get("num_experts", 0)) or 0
        spec.update(qkv_bias=name in ("qwen2", "qwen2_moe"), hf_config=config, kv_channels=config.get("head_dim"),
                    num_experts=experts, top_k=config.get("num_experts_per_tok", 0) if experts else 0,
                    shared_expert_ffn_hidden_size=config.get("shared_expert_intermediate_size", 0) or 0,
                    tied_embeddings=config.get("tie_word_embeddings"))
    elif name in ("t5", "mt5"):
        spec.update(num_kv_heads=4, kv_channels=16, decoder_seq_length=16)
    elif name == "moe":
        spec.update(num_experts=4, top_k=2)
    elif name == "gpt3":
        spec.update(num_kv_heads=4, ffn_hidden_size=256)
    model = ModelSpec(family=name, **spec)
    if method != "full":
        targets = list(linear_shapes(model.shape()))
        model = ModelSpec(**{**model.__dict__, "method": method,
                             "lora": LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=targets)})
    return model


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _stage(model: ModelSpec, device: torch.device, checkpointed: bool = False):
    """The engine's stage of ``model`` on ``device``, every layer under its activation checkpointing with
    ``checkpointed``."""
    torch.manual_seed(0)
    stage = build_stage(model, 1, 0)
    stage.to_empty(device=device)
    stage.retie()
    stage.reset_buffers(device)
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0.0, 0.02)
    if checkpointed:
        apply_activation_checkpointing(stage, model.shape().pipeline_layers)
    return stage


def _inputs(model: ModelSpec, device: torch.device):
    x = torch.randint(0, model.vocab_size, (1, model.seq_length), device=device)
    if model.decoder_seq_length:
        return (x, torch.randint(0, model.vocab_size, (1, model.decoder_seq_length), device=device))
    return (x,)


def _forward(stage, inputs) -> torch.Tensor:
    out = stage(*inputs)
    return out[0] if isinstance(out, tuple) else out


def _step(stage, inputs) -> None:
    _forward(stage, inputs).float().sum().backward()


def stage_ops(model: ModelSpec, checkpointed: bool = False) -> tuple[int, int]:
    """(forward, backward) aten operators the engine's stage of ``model`` dispatches for one micro-batch, every
    layer under the engine's activation checkpointing with ``checkpointed`` (its recompute in the backward's)."""
    device = torch.device("cpu")
    stage, inputs = _stage(model, device, checkpointed), _inputs(model, device)
    count = _Count()
    with count:
        out = _forward(stage, inputs)
        forward = count.ops
        out.float().sum().backward()
    return forward, count.ops - forward


def _per_layer(name: str, method: str, checkpointed: bool) -> tuple[float, float]:
    small, large = tiny_model(name, 2, method), tiny_model(name, 4, method)
    (f2, b2), (f4, b4) = stage_ops(small, checkpointed), stage_ops(large, checkpointed)
    added = large.shape().pipeline_layers - small.shape().pipeline_layers
    return (f4 - f2) / added, (b4 - b2) / added


def layer_ops(name: str, method: str = "full") -> tuple[float, float, float]:
    """(forward, backward, recompute) operators of one layer of family ``name`` (T5: the mean of an encoder and
    a decoder layer), counted as the difference between a 4- and a 2-layer stage over the layers it adds;
    recompute: what the backward of a checkpointed layer dispatches beyond a plain one's (its forward again and
    the checkpoint's own bookkeeping)."""
    forward, backward = _per_layer(name, method, False)
    _, checkpointed = _per_layer(name, method, True)
    return forward, backward, checkpointed - backward


def adapter_ops(name: str = "llama") -> tuple[float, float, float]:
    """(forward, backward, recompute) operators LoRA adds per adapted linear (every linear of ``name``'s layer)."""
    full, lora = layer_ops(name), layer_ops(name, "lora")
    linears = len(linear_shapes(tiny_model(name, 2).shape()))
    return tuple((a - f) / linears for f, a in zip(full, lora))


def layer_seconds(device: torch.device, repeats: int, method: str = "full",
                  checkpointed: bool = False) -> tuple[float, float]:
    """(seconds, operators) of one tiny Llama layer's forward and backward on ``device``, every layer checkpointed
    with ``checkpointed`` (its recomputed forward included): 8 more layers' time and operators."""
    torch.set_num_threads(1)
    times, ops = {}, {}
    for layers in (2, 10):
        model = tiny_model("llama", layers, method)
        stage, inputs = _stage(model, device, checkpointed), _inputs(model, device)
        for _ in range(3):
            _step(stage, inputs)
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            _step(stage, inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        times[layers] = min(samples)  # the fastest: other load on the machine only slows a step
        count = _Count()
        with count:
            _step(stage, inputs)
        ops[layers] = count.ops
    return (times[10] - times[2]) / 8, (ops[10] - ops[2]) / 8


def layer_tensors(name: str, method: str = "full") -> tuple[float, float]:
    """(modules holding parameters, trained parameter tensors) of one layer of the engine's stage of family ``name``
    (T5: the mean of an encoder and a decoder layer), counted as the difference between a 4- and a 2-layer stage."""
    counts = {}
    for layers in (2, 4):
        model = tiny_model(name, layers, method)
        stage = build_stage(model, 1, 0)  # on meta: only the modules and their parameters are counted
        modules = sum(1 for m in stage.modules() if next(m.parameters(recurse=False), None) is not None)
        trained = sum(1 for p in stage.parameters() if p.requires_grad)
        counts[layers] = (model.shape().pipeline_layers, modules, trained)
    (l2, m2, t2), (l4, m4, t4) = counts[2], counts[4]
    return (m4 - m2) / (l4 - l2), (t4 - t2) / (l4 - l2)


ACCUMULATION = 4  # micro-batches per DeepSpeed step; the boundary's (reduction, optimizer step) is not timed


def _hook_layout(model: ModelSpec, zero: int, checkpointed: bool) -> Layout:
    layers = model.shape().pipeline_layers
    return Layout.of(tp=1, pp=1, dp=1, mbs=1, global_batch_size=1, engine="deepspeed", zero_stage=zero,
                     act_ckpt_layers=layers if checkpointed else 0, method=model.method, lora=model.adapters)


def _fastest(run, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return min(samples)  # the fastest: other load on the machine only slows a step


def deepspeed_hook_seconds(zero: int, method: str, checkpointed: bool, repeats: int) -> float:
    """Host seconds DeepSpeed at ``zero`` adds to one tiny Llama layer's micro-batch on one CPU rank: (its micro-batch
    less the stage's plain forward and backward) with 10 layers less that with 2, over the 8 layers."""
    import deepspeed  # optional dependency

    torch.set_num_threads(1)
    device = torch.device("cpu")
    init_distributed(DistEnv(), device, solo_group=True)
    extra = {}
    for layers in (2, 10):
        model = tiny_model("llama", layers, method)
        inputs = _inputs(model, device)
        stage = _stage(model, device, checkpointed)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATION,
                  "train_batch_size": ACCUMULATION, "zero_optimization": {"stage": zero}, "gradient_clipping": 1.0}
        trained = [p for p in stage.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=stage, optimizer=torch.optim.AdamW(trained, lr=1e-4), config=config,
                                          dist_init_required=False)

        def micro() -> None:
            engine.backward(_forward(engine, inputs).float().sum())
            engine.step()

        for _ in range(2 * ACCUMULATION):
            micro()
        samples = []
        for _ in range(repeats):
            for i in range(ACCUMULATION):
                start = time.perf_counter()
                micro()
                if i < ACCUMULATION - 1:
                    samples.append(time.perf_counter() - start)
        plain = _stage(model, device, checkpointed)
        extra[layers] = min(samples) - _fastest(lambda: _step(plain, inputs), repeats)
    return (extra[10] - extra[2]) / 8


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(family_names()))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--engines", default="deepspeed", help="the engines' hooks to time (deepspeed, or none)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    print("Operators one layer dispatches, counted on the engine's stage (counted / the family's record)\n")
    print("| family | forward | backward | recompute | within 10% |")
    print("|---|---|---|---|---|")
    ok = True
    for name in args.families.split(","):
        counted, record = layer_ops(name), family(name).time.layer_ops
        within = all(abs(c - r) <= OPS_TOLERANCE * c for c, r in zip(counted, record))
        ok &= within
        cells = " | ".join(f"{c:.0f} / {r}" for c, r in zip(counted, record))
        print(f"| {name} | {cells} | {'yes' if within else 'NO'} |")
    counted = adapter_ops()
    print(f"\nLoRA per adapted linear (Llama, every linear): forward, backward, recompute "
          f"{', '.join(f'{c:.1f}' for c in counted)} (ADAPTER_OPS {ADAPTER_OPS})")
    device = torch.device(args.device)
    print(f"\nHost time of a tiny Llama layer's forward and backward on {args.device} (1 thread; HOST_SECONDS_PER_OP "
          f"{HOST_SECONDS_PER_OP * 1e6:.1f} us; the model: operators x it)\n")
    print("| method | checkpointed | operators | measured ms | us per operator | the model's ms | model / measured |")
    print("|---|---|---|---|---|---|---|")
    total_s = total_ops = 0.0
    for method in ("full", "lora"):
        for checkpointed in (False, True):
            seconds, ops = layer_seconds(device, args.repeats, method, checkpointed)
            total_s, total_ops = total_s + seconds, total_ops + ops
            model = ops * HOST_SECONDS_PER_OP  # the counted operators: layer_ops and ADAPTER_OPS are their records
            print(f"| {method} | {'yes' if checkpointed else 'no'} | {ops:.0f} | {seconds * 1e3:.2f} | "
                  f"{seconds / ops * 1e6:.1f} | {model * 1e3:.2f} | {model / seconds:.2f} |")
    print(f"\nAll four: {total_s / total_ops * 1e6:.1f} us per operator (HOST_SECONDS_PER_OP "
          f"{HOST_SECONDS_PER_OP * 1e6:.1f} us)")

    print("\nModules holding parameters and trained tensors of one layer (counted / the family's record, full; "
          "q, k, v biases in the tensors)\n")
    print("| family | modules | tensors | equal |")
    print("|---|---|---|---|")
    for name in args.families.split(","):
        counted = layer_tensors(name)
        record = layer_hooked(tiny_model(name, 2).shape(), _hook_layout(tiny_model(name, 2), 2, False))
        same = all(abs(c - r) <= TENSORS_TOLERANCE for c, r in zip(counted, record))
        ok &= same
        print(f"| {name} | {counted[0]:g} / {record[0]:g} | {counted[1]:g} / {record[1]:g} | {'yes' if same else 'NO'} |")
    if args.engines == "deepspeed":
        print_hooks(args.repeats)
    return 0 if ok else 1


TENSORS_TOLERANCE = 0.5  # a T5 layer's count is the mean of its stacks'


def print_hooks(repeats: int) -> None:
    """Part 3: DeepSpeed's hooks per layer, measured against the model, and the constants the full runs give."""
    facts = engine_facts("deepspeed")
    print(f"\nDeepSpeed's hooks on one CPU rank: host ms a tiny Llama layer's micro-batch adds (gradient_hook_s "
          f"{dict(facts.gradient_hook_s)}, module_hook_s {dict(facts.module_hook_s)})\n")
    print("| ZeRO | method | checkpointed | modules, trained tensors | measured ms | the model's ms | model / measured |")
    print("|---|---|---|---|---|---|---|")
    measured = {}
    for zero in (2, 3):
        for method in ("full", "lora"):
            for checkpointed in (False, True):
                seconds = deepspeed_hook_seconds(zero, method, checkpointed, repeats)
                measured[zero, method, checkpointed] = seconds
                model = tiny_model("llama", 1, method)
                layout = _hook_layout(model, zero, checkpointed)
                predicted = hook_s(model.shape(), layout)  # one layer, one micro-batch
                modules, trained = layer_hooked(model.shape(), layout)
                print(f"| {zero} | {method} | {'yes' if checkpointed else 'no'} | {modules:g}, {trained:g} | "
                      f"{seconds * 1e3:.2f} | {predicted * 1e3:.2f} | {predicted / seconds:.2f} |")
    modules, trained = family("llama").time.layer_tensors
    per_tensor = measured[2, "full", False] / trained
    per_module_pass = (measured[3, "full", False] - trained * per_tensor) / (2 * modules)
    print(f"\nFrom the full, uncheckpointed layers: {per_tensor * 1e6:.0f} us per trained tensor (ZeRO-2), "
          f"{per_module_pass * 1e6:.0f} us per module and pass beyond it (ZeRO-3)")


if __name__ == "__main__":
    sys.exit(main())
