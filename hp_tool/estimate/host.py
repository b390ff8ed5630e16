"""Host time of an eager step: the Python and dispatcher work that launches every operator. Pure arithmetic.

An eager step dispatches every operator of every layer from the host, forward, backward and the recomputed
forward of a checkpointed layer, each a few microseconds of Python, dispatcher and kernel launch (5-25 us in
PyTorch's own accounts). The GPU runs the kernels asynchronously behind it, so the step takes the longer of
the two: with large kernels (long sequences, large micro-batches) the GPU's time, with small ones the host's.
Fine-tuning a 7B model at 256 tokens a micro-batch dispatches about 200 operators a layer in 2-3 ms while
its GPU work takes a fraction of that, which is why published short-sequence runs reach a small share of
the tokens/s their FLOPs allow.

host = micro-batches x the busiest stage's layers x (forward + backward operators a layer, and a checkpointed
       layer's recompute) x ``HOST_SECONDS_PER_OP``

The operators are the family's record (``Family.time.layer_ops``: one layer's forward and backward in full training,
counted from the trial engine's own modules) plus ``ADAPTER_OPS`` per adapted linear under LoRA or QLoRA.
Both counts and the seconds per operator are measured by benchmarks/host_overhead.py and checked against the
engine in tests/test_host_overhead.py.

The engine's own Python hooks run on the same host thread, every micro-batch (``hook_s``): DeepSpeed's gradient
hook on each trained parameter tensor at ZeRO-2 and 3 (bucketing and partition bookkeeping), and at ZeRO-3 its
fetch and release hooks around every parameter-holding module in each pass (forward, backward, a checkpointed
layer's recompute), priced per tensor and per module-pass at the engine's measured seconds
(``EngineFacts.gradient_hook_s``, ``module_hook_s``) over the family's ``layer_tensors`` (LoRA: the adapters'
two modules and tensors per adapted linear, the frozen base's modules still hooked). DDP's and FSDP2's hooks run
per bucket and per layer and are left out, as are the embedding, head and loss (a few dozen operators a
micro-batch), the optimizer step (a handful of fused launches) and bitsandbytes' dequantisation launches. Under
torch.compile the layers run as a few fused kernels a layer and no floor is applied; on CPU processes the host
is the device, whose compute rate the CPU preset's efficiency prices already.
"""

from __future__ import annotations

from hp_tool.architectures import Shape
from hp_tool.engine_facts import engine_facts
from hp_tool.estimate.layout import Hardware, Layout, stage_layers

# Host seconds per operator of an eager layer: its Python module call, autograd and the dispatcher, the
# checkpoint's hooks, and the kernel's launch. benchmarks/host_overhead.py measures it on the tiny Llama stage's
# forward and backward, whose kernels cost nothing next to it, full and LoRA, with and without checkpointing: over
# all four 10.2, 10.2 and 8.6 us an operator in three runs on one core of a 2-core x86 cloud VM (7-13 us case by
# case; PyTorch's own accounts give 5-25 us on a GPU host, the launch included). Not yet measured on a GPU host
# (benchmarks/host_overhead.py --device cuda).
HOST_SECONDS_PER_OP = 10e-6
# operators LoRA adds per adapted linear as the engine runs it (A's matmul, B's matmul with the scaling and the sum
# folded in, the modules' calls; dropout's when it is on), forward, backward and a checkpointed layer's
# recompute: 9, 16 and 12 on the engine's Llama layer, every linear adapted
ADAPTER_OPS = (9, 16, 12)


def layer_pass_ops(shape: Shape, layout: Layout) -> tuple[float, float, float]:
    """(forward, backward, recompute) operators one layer dispatches for one micro-batch under the layout's
    method (``Family.time.layer_ops``, plus ``ADAPTER_OPS`` per adapted linear)."""
    ops = shape.facts.time.layer_ops
    if not layout.adapted:
        return ops
    adapted = len(layout.lora.target_modules)
    return tuple(n + adapted * extra for n, extra in zip(ops, ADAPTER_OPS))


def layer_hooked(shape: Shape, layout: Layout) -> tuple[float, float]:
    """(parameter-holding modules, trained parameter tensors) of one layer under the layout's method
    (``Family.time.layer_tensors``, q, k and v biases included; LoRA: the adapters' two per adapted linear are trained,
    the frozen base's modules still there)."""
    modules, tensors = shape.facts.time.layer_tensors
    tensors += 3 if shape.qkv_bias else 0
    if not layout.adapted:
        return modules, tensors
    adapted = 2 * len(layout.lora.target_modules)
    return modules + adapted, adapted


def hook_s(shape: Shape, layout: Layout) -> float:
    """Host seconds per optimizer step of the engine's own hooks on the busiest stage's layers (module docstring)."""
    per_tensor, per_module_pass = engine_facts(layout.engine).hook_seconds(layout.zero_stage)
    if not per_tensor and not per_module_pass:
        return 0.0
    modules, trained = layer_hooked(shape, layout)
    per_stage, recomputed = stage_layers(shape, layout)
    passes = 2 * per_stage + recomputed  # forward, backward, recompute
    return layout.num_microbatches * (per_stage * trained * per_tensor + passes * modules * per_module_pass)


def host_s(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Host seconds per optimizer step to dispatch the busiest stage's layers and run the engine's hooks on them
    (module docstring); 0 under torch.compile and where the device is the host."""
    if layout.compile or hw.device_is_host:
        return 0.0
    forward, backward, recompute = layer_pass_ops(shape, layout)
    per_stage, recomputed = stage_layers(shape, layout)
    ops = per_stage * (forward + backward) + recomputed * recompute
    return layout.num_microbatches * ops * HOST_SECONDS_PER_OP + hook_s(shape, layout)
