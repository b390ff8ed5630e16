"""torch.compile as a searched recipe choice (train_settings.compile): priced by the linears' efficiency under
compile (speed.FUSED_ELEMENTWISE of the layers' element-wise bytes) and a compiled layer's smaller activations (the
family's fused-norm and compiled records, counted here on the engine's compiled layer), invalid with its reason on
DeepSpeed and at TP > 1; a trial compiles each layer (after checkpointing, before FSDP2) and trains as the eager one
does."""

import dataclasses

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.estimate.layout import GIB, stage_layers
from hp_tool.estimate.memory import layer_activation_bytes
from hp_tool.planner import make_plan
from hp_tool.sharding import compile_problem
from trial_helpers import read_metrics, read_result, tiny_spec, torchrun, write_spec

TS = "search_config.train_settings"


def test_compiled_layouts_are_planned_faster_and_smaller_and_deepspeed_ones_invalid_with_the_reason(tmp_path):
    cfg, name = compose(["search_config=finetune/llama3_8b", "gpu=h100_80gb", "dry_run=true", f"{TS}.compile=[false,true]",
                         f"{TS}.methods=[full]", f"{TS}.seq_lengths=[4096]", f"{TS}.engines=[torch,deepspeed]"])
    plan = make_plan(to_app_config(cfg), name, tmp_path / "plan")
    cands, hw = plan.candidates, plan.cluster.hw
    pairs = {}
    for c in cands:
        if c.step_time_s is not None:
            pairs.setdefault(c.full.replace(compile=False), {})[c.full.compile] = c
    both = [p for p in pairs.values() if len(p) == 2]
    assert len(both) > 50  # the layouts that fit in both forms (one over GPU memory is not timed)
    for p in both:  # only the element-wise traffic changes: never slower, and the matmuls' time stays
        eager, compiled = p[False].compute_time_s, p[True].compute_time_s
        assert compiled < eager < 1.5 * compiled
        # a compiled layer keeps less (its norms fused, SwiGLU's SiLU recomputed): never more memory, and each layer
        # held whole (not checkpointed) keeps its saving
        saved = p[False].memory_gib - p[True].memory_gib
        shape, eager_layout = p[False].shape, p[False].trial_layout()
        layer = layer_activation_bytes(shape, eager_layout, hw) - layer_activation_bytes(shape, p[True].trial_layout(), hw)
        per_stage, recomputed = stage_layers(shape, eager_layout)
        held = per_stage - recomputed
        assert layer > 0 and saved * GIB >= held * layer * 0.999 and saved >= 0
    assert "compiled" in next(c for c in cands if c.full.compile and c.rank).trial_id
    assert any(c.full.compile and c.engine == "deepspeed" and c.reason_key == f"{TS}.compile" and
               "deepspeed engine does not compile" in c.reason for c in cands)


def test_a_compiled_candidates_trace_of_its_eager_layers_is_taken_down_to_what_its_compiled_layers_keep(tmp_path):
    """The memory check traces a compiled layout's layers eager (they keep more); the planner takes off what the
    compiled layers do not keep, the analytic model's difference, so a compiled candidate is judged on its own peak.
    A stub tracer stands in for the fake-tensor trace (the same figure for every candidate)."""
    from hp_tool.memory_check import TraceOutcome

    cfg, name = compose(["search_config=finetune/llama3_8b", "gpu=h100_80gb", "dry_run=true", f"{TS}.compile=[false,true]",
                         f"{TS}.methods=[full]", f"{TS}.seq_lengths=[4096]", f"{TS}.engines=[torch]",
                         f"{TS}.limit_search_runs=400"])
    plan = make_plan(to_app_config(cfg), name, tmp_path / "plan",
                     tracer=lambda specs: [TraceOutcome(20.0) for _ in specs])
    traced = {}
    for c in plan.candidates:
        if c.memory_check == "traced":
            traced.setdefault(c.full.replace(compile=False), {})[c.full.compile] = c
    both = [p for p in traced.values() if len(p) == 2]
    assert len(both) > 10 and any(p[False].memory_gib > p[True].memory_gib for p in both)
    for p in both:
        assert p[False].traced_memory_gib - p[True].traced_memory_gib == \
            pytest.approx(p[False].memory_gib - p[True].memory_gib, abs=1e-9)


def test_compile_is_refused_on_deepspeed_and_with_tp():
    assert compile_problem(False, "deepspeed", 2) is None and compile_problem(True, "torch", 1) is None
    assert "deepspeed engine does not compile" in compile_problem(True, "deepspeed", 1)
    assert "TP=2" in compile_problem(True, "torch", 2)


@pytest.mark.e2e
def test_a_compiled_trial_compiles_its_layers_and_trains_as_the_eager_one(tmp_path):
    """2 CPU processes, FSDP2 with half the layers checkpointed: dynamo traces the layers (its log says so), the
    first build phase holds the compile, and the losses equal the eager trial's within 1e-5 (inductor's fused
    kernels round differently)."""
    runs = {}
    for compiled in (False, True):
        spec = tiny_spec("llama", dp=2, zero_stage=3, act_ckpt=2, max_steps=2)
        spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, compile=compiled),
                                   trial_id=spec.trial_id + ("_compiled" if compiled else ""))
        out = tmp_path / f"out{compiled}"
        # dynamo's log (TORCH_LOGS=dynamo) in the ranks forked from the warm process, set up there as torch's
        # import would have
        proc = torchrun(write_spec(spec, tmp_path / f"spec{compiled}"), out, 2, timeout=300, torch_logs="dynamo")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert read_result(out)["status"] == "ok"
        runs[compiled] = [m["loss"] for m in read_metrics(out)], "torchdynamo start tracing" in proc.stderr
    assert runs[True][1] and not runs[False][1]
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)


def _saved_bytes_per_layer_token(name: str, ffn: int, compiled: bool, method: str = "full") -> float:
    """Bytes the engine's stage of a tiny ``name`` model (bf16, as a GPU trial) keeps for backward per layer and token
    (a 4- less a 2-layer stage): every tensor autograd saves, once, the parameters left out."""
    import torch

    from bench_helpers import benchmark
    from hp_tool.trial.parallel import compile_layers

    host, counter = benchmark("host_overhead"), benchmark("elementwise_bytes")
    saved = []
    for layers in (2, 4):
        torch._dynamo.reset()  # each stage compiles afresh (dynamo's recompile limit is per code object)
        model = counter._widened(host.tiny_model(name, layers, method), ffn)
        stage = host._stage(model, torch.device("cpu")).to(torch.bfloat16)
        inputs = host._inputs(model, torch.device("cpu"))
        if compiled:
            compile_layers(stage)
        params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        seen, total = set(), [0]

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in seen and key not in params and t.numel() > 1:
                seen.add(key)
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autocast("cpu", torch.bfloat16):
            host._forward(stage, inputs).float().sum().backward()  # compiles (the warm-up step)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = host._forward(stage, inputs)
            out.float().sum().backward()
        saved.append(total[0])
    return (saved[1] - saved[0]) / 2 / model.seq_length


@pytest.mark.e2e
@pytest.mark.parametrize("name,method", [
    # the covering set (default run): each family's code path once (Qwen3's record adds its per-head norms to
    # Llama's, which it calls), each method once (LoRA's frozen norms; full through Qwen3); Llama's full layer is
    # the matrix tier (-m matrix): each cell compiles 4 stages under Inductor
    ("llama", "lora"), ("qwen3", "full"),
    pytest.param("llama", "full", marks=pytest.mark.matrix)])
def test_a_compiled_layer_keeps_what_the_familys_records_take_off_the_eager_bytes(name, method):
    """A layer under torch.compile (the engine's compile_layers, bf16 on CPU; Inductor's partitioner decides what
    to save, on any device) keeps fewer bytes than the eager layer: per token, at hidden 64 and two FFN widths, the
    difference is the family's fused-norm and compiled records (Llama: 8 bytes a hidden unit, the norms' fp32 copies,
    and 2 an FFN unit, SwiGLU's SiLU output recomputed; with LoRA's frozen norms, which keep no normalised value
    eager, 4 a hidden unit; Qwen3: its per-head norms' copies besides) within 10%."""
    from hp_tool.families.registry import LayerAt, family
    from hp_tool.families.shape import Shape

    facts = family(name)
    for ffn in (128, 256):
        counted = _saved_bytes_per_layer_token(name, ffn, False, method) - \
            _saved_bytes_per_layer_token(name, ffn, True, method)
        shape = Shape(name, 4, 64, 4, 2, ffn, 256, 16, kv_channels=16)
        at = LayerAt(mbs=1, tp=1, sequence_parallel=False, bytes_per_value=2, frozen_norms=method != "full")
        record = (facts.memory.fused_norm_saving(shape, at) + facts.memory.compiled_saving(shape, at)) / 16
        assert counted == pytest.approx(record, rel=0.1), (ffn, counted, record)


GRAPH_BREAK_COVERING = {("llama", "lora"), ("gpt3", "full"), ("t5", "full"), ("mixtral", "full"), ("gemma3_text", "full")}


def _graph_break_cases():
    from hp_tool.families.registry import family_names

    for name in family_names():
        for method in ("full", "lora"):
            if method == "lora" and name in ("gpt3", "t5", "mt5"):  # their layers name no adapted linears
                continue
            marks = () if (name, method) in GRAPH_BREAK_COVERING else pytest.mark.matrix
            yield pytest.param(name, method, marks=marks, id=f"{name}-{method}")


@pytest.mark.parametrize("name,method", list(_graph_break_cases()))
def test_a_compiled_layer_of_every_family_runs_as_one_graph_without_breaks(name, method):
    """Dynamo's view of the engine's layers (each wrapped as compile_layers wraps it; the eager backend, so only
    the capture is checked, not Inductor's code): no graph break in any layer's forward, and the layers share
    their graph (at most one recompile: under an adapter method the first layer's input needs no gradient)."""
    import torch
    from torch._dynamo.utils import counters

    from bench_helpers import benchmark

    host = benchmark("host_overhead")
    model = host.tiny_model(name, 2, method)
    stage = host._stage(model, torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    for key, layer in list(stage.layers.items()):
        stage.layers[key] = torch.compile(layer, backend="eager")
    host._forward(stage, host._inputs(model, torch.device("cpu"))).float().sum().backward()
    assert dict(counters["graph_break"]) == {}
    assert 1 <= counters["stats"]["unique_graphs"] <= (2 if method != "full" or name in ("t5", "mt5") else 1)
