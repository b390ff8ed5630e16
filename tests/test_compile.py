"""torch.compile as a searched recipe choice (train_settings.compile): priced by the linears' efficiency under
compile (speed.FUSED_ELEMENTWISE of the layers' element-wise bytes), invalid with its reason on DeepSpeed and at TP > 1; a trial compiles each layer (after
checkpointing, before FSDP2) and trains as the eager one does."""

import dataclasses

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.planner import make_plan
from hp_tool.sharding import compile_problem
from trial_helpers import read_metrics, read_result, tiny_spec, torchrun, write_spec

TS = "search_config.train_settings"


def test_compiled_layouts_are_planned_faster_and_deepspeed_ones_invalid_with_the_reason(tmp_path):
    cfg, name = compose(["search_config=finetune/llama3_8b", "gpu=h100_80gb", "dry_run=true", f"{TS}.compile=[false,true]",
                         f"{TS}.methods=[full]", f"{TS}.seq_lengths=[4096]", f"{TS}.engines=[torch,deepspeed]"])
    cands = make_plan(to_app_config(cfg), name, tmp_path / "plan").candidates
    pairs = {}
    for c in cands:
        if c.step_time_s is not None:
            pairs.setdefault(c.full.replace(compile=False), {})[c.full.compile] = c
    both = [p for p in pairs.values() if len(p) == 2]
    assert len(both) > 100
    for p in both:  # only the element-wise traffic changes: never slower, and the matmuls' time stays
        eager, compiled = p[False].compute_time_s, p[True].compute_time_s
        assert compiled < eager < 1.5 * compiled
        assert p[True].memory_gib == p[False].memory_gib
    assert "compiled" in next(c for c in cands if c.full.compile and c.rank).trial_id
    assert any(c.full.compile and c.engine == "deepspeed" and c.reason_key == f"{TS}.compile" and
               "deepspeed engine does not compile" in c.reason for c in cands)


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
        proc = torchrun(write_spec(spec, tmp_path / f"spec{compiled}"), out, 2, env={"TORCH_LOGS": "dynamo"},
                        timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert read_result(out)["status"] == "ok"
        runs[compiled] = [m["loss"] for m in read_metrics(out)], "torchdynamo start tracing" in proc.stderr
    assert runs[True][1] and not runs[False][1]
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
