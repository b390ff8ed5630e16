"""LoRA's dropout in the memory model: peft runs each adapter as ``lora_A(dropout(x))``, so with dropout above 0
every adapter keeps its own dropped-out input and the dropout's mask, while the frozen base keeps none of the
inputs (hp_tool/families/methods.py ``adapter_input_bytes``). The term itself (pure), and the analytic peak
against the trace for Llama-2 7B at 2048 tokens."""

import dataclasses

import pytest

from hp_tool.architectures import count_parameters
from hp_tool.base_config import ModelChoice, model_spec
from hp_tool.config import LoraSettings
from hp_tool.contracts.spec import LoraSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec, TrialSpec, section_values
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.recipe import Adapters
from hp_tool.estimate.memory import estimate_memory, layer_activation_bytes, stage_activation_bytes
from hp_tool.families.methods import activation_delta_bytes, adapter_input_bytes
from hp_tool.families.shape import Shape

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
H, F = 4096, 11008  # Llama-2 7B's hidden and FFN widths
LLAMA2_7B = Shape("llama", 32, H, 32, 32, F, 32000, 2048)
GPU = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
               inter_node_bandwidth_gbps=25, memory_overhead_gib=0.0)
CPU = dataclasses.replace(GPU, device_is_host=True)
PRECISION = {GPU: "bf16", CPU: "fp32"}  # what each computes in


def lora(dropout: float, targets=ALL) -> Adapters:
    return Adapters(16, 32.0, dropout, targets)


def fsdp(dropout: float, hw: Hardware, method: str = "lora", **change) -> Layout:
    """FSDP2 over 8 GPUs, 2 sequences a micro-batch, training ``method`` with rank-16 adapters on every linear."""
    return Layout.of(**{"tp": 1, "pp": 1, "dp": 8, "mbs": 2, "act_ckpt_layers": 0, "zero_stage": 3,
                        "global_batch_size": 16, "precision": PRECISION[hw], "method": method, "lora": lora(dropout),
                        **change})


# per token and layer: what the adapted linears read (q, k, v, gate, up: hidden; o: hidden; down: FFN), and what
# the frozen base frees of them (the two norms' outputs and down's input; o's input is the attention's output,
# which SDPA keeps for its own backward)
READ, FREED = 6 * H + F, 2 * H + F


@pytest.mark.parametrize("p, mask, expected", [
    (2, 1, 3 * READ - 2 * FREED),  # a GPU in bf16 (fp32 adapters too: their input is never cast): copy + bool mask
    (4, 4, 8 * READ - 4 * FREED),  # a CPU in fp32: the dropped-out input and the fp32 noise torch keeps
])
def test_dropout_term_is_each_adapters_copy_and_mask_less_the_freed_inputs(p, mask, expected):
    assert adapter_input_bytes(LLAMA2_7B, lora(0.05), 1, p, mask) == expected
    assert adapter_input_bytes(LLAMA2_7B, lora(0.3), 1, p, mask) == expected  # the rate does not change the bytes


def test_dropout_0_keeps_the_inputs_once_as_full_training_does():
    # fp32 adapters under bf16 autocast too: A reads the bf16 input as it is (tests/test_adapter_dispatch.py)
    assert adapter_input_bytes(LLAMA2_7B, lora(0.0), 1, 2, 1) == 0
    # q and v only: the MLP's inputs (its norm's output, down's input) are kept by nothing
    assert adapter_input_bytes(LLAMA2_7B, lora(0.0, ("q_proj", "v_proj")), 1, 2) == -2 * (H + F)
    # with dropout q and v each keep a copy and a mask, and nothing keeps the attention norm's output
    assert adapter_input_bytes(LLAMA2_7B, lora(0.05, ("q_proj", "v_proj")), 1, 2) == 2 * 3 * H - 2 * (2 * H + F)


def test_the_term_is_in_each_layer_of_lora_and_qlora_but_not_full_training():
    tokens = 2 * 2048
    for method in ("lora", "qlora"):
        delta = layer_activation_bytes(LLAMA2_7B, fsdp(0.05, GPU, method), GPU) - \
            layer_activation_bytes(LLAMA2_7B, fsdp(0.0, GPU, method), GPU)
        assert delta == tokens * (3 * READ - 2 * FREED)
    assert activation_delta_bytes(LLAMA2_7B, None, 4, 1, False, 2) == 0


def test_memory_model_counts_a_byte_mask_on_a_gpu_and_none_in_checkpointed_layers():
    tokens = 2 * 2048
    for hw, per_token in ((GPU, 3 * READ - 2 * FREED), (CPU, 8 * READ - 4 * FREED)):
        grown = layer_activation_bytes(LLAMA2_7B, fsdp(0.05, hw), hw) - layer_activation_bytes(LLAMA2_7B, fsdp(0.0, hw), hw)
        assert grown == tokens * per_token
    # every layer checkpointed: each keeps its input whatever the dropout; only the one layer recomputed in
    # backward holds the adapters' copies and masks
    (stored, buffer), (stored0, buffer0) = (stage_activation_bytes(LLAMA2_7B, fsdp(p, GPU, act_ckpt_layers=32), GPU, 0)
                                            for p in (0.05, 0.0))
    assert stored == stored0 and buffer - buffer0 == tokens * (3 * READ - 2 * FREED)


def test_the_planner_and_the_trial_spec_carry_the_same_dropout():
    choice = ModelChoice(LLAMA2_7B, 6.7, count_parameters(LLAMA2_7B), 2e-5, False, "6.74b", seq_lengths=(2048,),
                         methods=("lora",), lora=LoraSettings(rank=16, dropout=0.1))
    layout = Layout(Layout.of().degrees, choice.recipe("lora", "bf16"))
    spec = model_spec(choice.at(2048), choice.num_parameters, None, **section_values(layout, "model"))
    assert layout.lora.dropout == spec.lora.dropout == 0.1 and spec.adapters == layout.lora
    assert spec.shape() == choice.at(2048)
    assert Adapters().dropout == LoraSettings().dropout  # the same default


# -- against the trace --------------------------------------------------------------------------------------------

def traced_spec(mbs: int, dropout: float, precision: str, **parallel) -> TrialSpec:
    """Llama-2 7B (32 layers, 2048 tokens) with LoRA r16 on all 7 linears, one rank or the data-parallel layout
    ``parallel`` gives."""
    adapters = LoraSpec(16, 32.0, dropout, list(ALL))
    par = ParallelSpec(tp=1, pp=1, dp=parallel.get("dp", 1), mbs=mbs, act_ckpt_layers=0,
                       zero_stage=parallel.get("zero_stage", 0))
    model = model_spec(LLAMA2_7B, count_parameters(LLAMA2_7B), None, "lora", adapters)
    return TrialSpec(trial_id="lora_dropout", model=model,
                     parallel=par, training=TrainingSpec(global_batch_size=mbs * par.dp, precision=precision),
                     resources=ResourcesSpec(num_nodes=1, gpus_per_node=par.dp),
                     run=RunSpec(max_steps=3, warmup_steps=1, stable_cv=0.0))


def _lora_cell(dropout: float, device: str, parallel: dict, name: str, matrix: bool = False):
    return pytest.param(device, parallel, (1, 8), dropout, id=f"{dropout}-{name}",
                        marks=pytest.mark.matrix if matrix else ())


# The covering set in the default run: each rank kind once (a CPU rank, one GPU, FSDP2 over GPUs), dropout on where
# its copies and masks differ by device (the CPU's fp32 noise, FSDP2's bool mask over bf16 weights) and off on one
# GPU (fp32 adapters under autocast each keep their own bf16 copy of their input: the 3-10% it was under); the
# other three cells are the matrix tier's.
@pytest.mark.e2e
@pytest.mark.parametrize("device, parallel, micro_batches, dropout", [
    _lora_cell(0.0, "cpu", {}, "cpu", matrix=True), _lora_cell(0.0, "cuda", {}, "gpu"),
    # FSDP2 at 1 and 8 (the trace extrapolates from 3 and 4 layers: from 1 and 2 it erred high at 1, because under
    # LoRA the first layer's input needs no gradient and the 1- to 2-layer increment is not a middle layer's)
    _lora_cell(0.0, "cuda", {"dp": 2, "zero_stage": 3}, "gpu-fsdp2", matrix=True),
    _lora_cell(0.05, "cpu", {}, "cpu"), _lora_cell(0.05, "cuda", {}, "gpu", matrix=True),
    _lora_cell(0.05, "cuda", {"dp": 2, "zero_stage": 3}, "gpu-fsdp2")])
def test_analytic_lora_peak_is_within_5_percent_of_the_trace(device, parallel, micro_batches, dropout):
    """Deliverable: LoRA at dropout 0 and 0.05, 1-8 sequences a micro-batch, within 5% of the trace (it was 21-35%
    under at dropout 0.05 on CPU, 7-20% on one GPU, 18-24% under FSDP2, and 3-10% under at dropout 0 on one GPU,
    where fp32 adapters under autocast each keep their own bf16 copy of their input). All 32 layers: the trace, as the
    memory check runs it, extrapolates them from 3- and 4-layer builds (tests/test_memory_check.py), so the
    whole depth costs what 7 layers do (2-5 s a trace on a CPU core), and the fixed parts (logits, embedding)
    weigh what they do in the real model. "cuda": a bf16 GPU traced on fake CPU tensors, with the engine's
    dtypes and CUDA's dropout (a bool mask)."""
    from hp_tool.trial.memterms import target_hardware, target_layout
    from trace_cache import traced_peak_bytes

    for mbs in micro_batches:
        spec = traced_spec(mbs, dropout, "bf16", **parallel)
        traced = traced_peak_bytes(spec, device)
        estimate = estimate_memory(spec.model.shape(), target_layout(spec, device), target_hardware(device))
        analytic = (estimate.total_gib - estimate.overhead_gib) * 2**30
        assert analytic == pytest.approx(traced, rel=0.05), (mbs, analytic / 2**30, traced / 2**30)
