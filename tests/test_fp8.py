"""fp8 linears as a searched recipe choice (train_settings.fp8): planned on GPUs with fp8 tensor cores, faster
than the same bf16 layout there, invalid with its reason elsewhere; a trial converts the layers' linears to
torchao's Float8Linear (on CPU processes torch emulates the scaled matmuls: the conversion is checked, not its
speed)."""

import dataclasses

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.speed import estimate_step_time, fp8_cast_s
from hp_tool.hf_config import load_hf_model
from hp_tool.planner import make_plan
from hp_tool.sharding import fp8_problem
from trial_helpers import read_metrics, read_result, tiny_spec, torchrun, write_spec

TS = "search_config.train_settings"


def h100() -> Hardware:
    """An H100 SXM node as the h100_80gb preset gives it (8 GPUs, its peaks and memory bandwidth)."""
    return Hardware(gpus_per_node=8, gpu_memory_gib=79.2, peak_tflops=989, intra_node_bandwidth_gbps=450,
                    inter_node_bandwidth_gbps=50, memory_overhead_gib=3.0, memory_bandwidth_gbps=3350, fp8_peak_tflops=1979,
                    max_efficiency=0.63, tokens_half=128, attention_efficiency=0.17)


def plan(tmp_path, gpu: str):
    cfg, name = compose(["search_config=finetune/llama3_8b", f"gpu={gpu}", "dry_run=true", f"{TS}.fp8=[false,true]",
                         f"{TS}.methods=[full]", f"{TS}.seq_lengths=[4096]", f"{TS}.engines=[torch,deepspeed]"])
    return make_plan(to_app_config(cfg), name, tmp_path / gpu)


def test_fp8_rows_are_faster_on_h100_and_invalid_with_the_reason_on_a100(tmp_path):
    h100 = plan(tmp_path, "h100_80gb").candidates
    pairs = {}
    for c in h100:
        if c.step_time_s is not None:
            pairs.setdefault(c.full.replace(fp8=False), {})[c.full.fp8] = c.step_time_s
    both = [p for p in pairs.values() if len(p) == 2]
    assert len(both) > 100
    faster = sorted(p[False] / p[True] for p in both)
    assert faster[len(faster) // 2] > 1.2  # the median fp8 layout is faster than the same bf16 one
    assert any(c.full.fp8 and c.rank == 1 for c in h100)  # the pick trains its linears in fp8
    refused = {c.reason for c in h100 if c.full.fp8 and c.status == "invalid" and c.reason_key == f"{TS}.fp8"}
    assert any("deepspeed engine does not convert" in r for r in refused)
    a100 = plan(tmp_path, "a100_80gb").candidates
    assert not any(c.full.fp8 and c.status != "invalid" for c in a100)
    assert any(c.full.fp8 and "gpu=a100_80gb has no fp8 tensor cores" in c.reason for c in a100)


@pytest.mark.parametrize("change, reason", [
    (dict(engine="deepspeed"), "deepspeed engine does not convert"), (dict(tp=2, sp=True), "sequence parallelism"),
    (dict(precision="fp16"), "not fp16"), (dict(method="lora"), "lora's frozen base"),
    (dict(family="t5"), "does not list for t5"), (dict(peak=None), "no fp8 tensor cores")])
def test_each_rule_of_fp8_names_its_reason(change, reason):
    args = dict(family="llama", fp8=True, engine="torch", tp=1, method="full", precision="bf16", peak=1979.0, sp=False)
    args.update(change)
    assert reason in fp8_problem(args["family"], args["fp8"], args["engine"], args["tp"], args["method"],
                                 args["precision"], args["peak"], "a_gpu", args["sp"])
    assert fp8_problem("llama", True, "torch", 2, "full", "bf16", 1979.0, "a_gpu") is None  # TP: torchao's styles
    assert fp8_problem("llama", False, "deepspeed", 8, "lora", "fp16", None, "a_gpu") is None  # bf16 linears: none


def test_llama3_8b_on_h100_plans_fp8_rows_split_over_tp_with_torchaos_styles(tmp_path):
    """llama/llama3_8b (TP 1-4) on h100_80gb with fp8 searched: fp8 rows at TP 2 are valid and estimated, those with
    sequence parallelism refused with the reason; the engine's TP plan for a Float8 layer is torchao's styles."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from hp_tool.trial.families import torch_family
    from hp_tool.trial.parallel import layer_tp_plan

    cfg, name = compose(["search_config=llama/llama3_8b", "gpu=h100_80gb", "dry_run=true", f"{TS}.fp8=[false,true]",
                         f"{TS}.sequence_parallel=[false,true]"])
    cands = make_plan(to_app_config(cfg), name, tmp_path / "plan").candidates
    tp2 = [c for c in cands if c.full.fp8 and c.tp == 2]
    assert any(c.status != "invalid" and c.step_time_s is not None for c in tp2 if not c.full.sequence_parallel)
    assert all(c.status == "invalid" and "sequence parallelism" in c.reason for c in tp2 if c.full.sequence_parallel)
    spec = tiny_spec("llama")
    from hp_tool.trial.models import build_stage
    layer = next(iter(build_stage(spec.model, 1, 0).layers.values()))
    styles = {type(style) for style in layer_tp_plan(torch_family("llama"), layer, float8=True).values()}
    assert styles == {Float8ColwiseParallel, Float8RowwiseParallel}


def test_the_casts_cost_memory_traffic_that_a_small_micro_batch_does_not_hide():
    """Per linear per micro-batch the input, output gradient and weight are scanned, cast and transposed: at
    one 512-token sequence the weights' casts make fp8 no faster than bf16, at 8 x 4096 tokens it is faster."""
    shape = load_hf_model("llama3_8b").shape(512)
    small = Layout.of(dp=8, mbs=1, global_batch_size=8, act_ckpt_layers=0, fp8=True)
    assert fp8_cast_s(shape, small, h100()) > 0 and fp8_cast_s(shape, small.replace(fp8=False), h100()) == 0
    t = {f: estimate_step_time(shape, small.replace(fp8=f), h100(), 1).total_s for f in (False, True)}
    long = load_hf_model("llama3_8b").shape(4096)
    big = Layout.of(dp=8, mbs=8, global_batch_size=64, act_ckpt_layers=32)
    u = {f: estimate_step_time(long, big.replace(fp8=f), h100(), 1).total_s for f in (False, True)}
    assert u[False] / u[True] > t[False] / t[True] and u[False] / u[True] > 1.3


@pytest.mark.e2e
@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 1)])
def test_a_trial_with_fp8_linears_trains_close_to_and_not_the_same_as_without(tmp_path, tp, dp):
    """2 CPU processes, under FSDP2 or split over TP (torchao's Float8 parallel styles): the fp8 trial runs ok, its
    first loss within 1% of the same trial's without fp8 and not equal to it (the linears did run through the
    scaled fp8 matmuls)."""
    losses = {}
    for fp8 in (False, True):
        spec = tiny_spec("llama", tp=tp, dp=dp, zero_stage=3, max_steps=2)
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, fp8=fp8),
                                   trial_id=spec.trial_id + ("_fp8" if fp8 else ""))
        out = tmp_path / f"out{fp8}"
        proc = torchrun(write_spec(spec, tmp_path / f"spec{fp8}"), out, 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert read_result(out)["status"] == "ok"
        losses[fp8] = read_metrics(out)[0]["loss"]
    assert losses[True] == pytest.approx(losses[False], rel=0.01) and losses[True] != losses[False]


@pytest.mark.parametrize("edit, key, fix", [
    ({"parallel": {"engine": "deepspeed"}}, "model.fp8", "use fp8 false, or the torch engine"),
    ({"parallel": {"engine": "deepspeed", "compile": True}, "model": {"fp8": False}}, "parallel.compile",
     "use compile false"),
])
def test_a_hand_edited_spec_the_engine_cannot_run_is_refused_naming_the_key_and_the_fix(tmp_path, edit, key, fix):
    """A spec read back by a trial passes the layout's own rules (``layout.RULES``), fp8's and compile's among
    them: a torch fp8 trial's spec edited to DeepSpeed (which converts no linear to Float8), or one compiled on
    DeepSpeed, is refused as it loads, naming the key, the value and the fix; before any process starts."""
    import yaml

    from hp_tool.contracts.spec import load_spec
    from hp_tool.errors import ConfigError

    spec = tiny_spec("llama")
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, fp8=True))
    path = write_spec(spec, tmp_path)
    assert load_spec(path).layout().fp8  # as planned: it loads
    text = yaml.safe_load(path.read_text())
    for section, values in edit.items():
        text[section].update(values)
    path.write_text(yaml.safe_dump(text))
    with pytest.raises(ConfigError) as refused:
        load_spec(path)
    assert refused.value.key == key and fix in refused.value.fix
