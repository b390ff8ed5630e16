"""Every parallel layout is the same model: its first losses match the single-process run (gloo, CPU).

Each launch is a real torchrun job of the trial engine (``trial_helpers.launched``: once per session, so a
layout tests/test_memtrace.py also measures, at the same steps and warm-up, is launched once for both).

The default run keeps a covering set of the layout x family product: each parallelism once per engine and each
family's code path once (the first cells of the parametrize list, each saying what it covers); the other
cells are the matrix tier (``-m matrix``)."""

from __future__ import annotations

import pytest

from hp_tool.contracts.result import METRIC_FIELDS, RESULT_FIELDS
from trial_helpers import launched, read_metrics, read_result, tiny_spec, torchrun, write_spec

REL_TOL = 1e-4
STEPS = 3
WARMUP = 2  # untimed steps: test_memtrace's, so the layouts both files run are launched once


def layout_spec(family: str, **layout):
    return tiny_spec(family, max_steps=STEPS, warmup_steps=WARMUP, **layout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """First losses of the single-process run, per family (computed once)."""
    def run(family: str) -> dict:
        launch = launched(tmp_path_factory, layout_spec(family))
        result = launch.result()
        assert result["status"] == "ok", result["reason"]
        return {"losses": result["first_losses"], "grad_norms": [m["grad_norm"] for m in launch.metrics()]}

    return run


def launch(tmp_path_factory, family, **layout):
    run = launched(tmp_path_factory, layout_spec(family, **layout))
    assert run.returncode == 0, run.stderr[-4000:]
    return run.spec, run.out, run.result()


def matrix(family, layout):
    return pytest.param(family, layout, marks=pytest.mark.matrix)


@pytest.mark.e2e
@pytest.mark.parametrize("family, layout", [
    # the covering set (default run). The torch engine: 1F1B with checkpointing, interleaved 1F1B (the tied
    # embedding on rank 0's first chunk, the head on rank 1's last), DDP, ZeRO-1, ZeRO-2, FSDP2 and its offload,
    # TP (vocab-parallel embedding and head: tied for gpt3 in pipeline stages, untied for llama over FSDP2 in 2-D,
    # so TP alone is in both). DeepSpeed: AutoTP with ZeRO-1, ZeRO-2, ZeRO-3 with the tied embedding and head,
    # offload and DeepSpeed's checkpointing. T5 (head-sharded relative position tables; encoder on stage 0,
    # decoder on stage 1 with the encoder output and the tables carried between them), mT5's code path (its
    # vocabulary) with DDP.
    ("gpt3", {"pp": 2, "act_ckpt": 1}),
    ("llama", {"pp": 2}),
    ("gpt3", {"pp": 2, "vp": 2}),
    ("gpt3", {"dp": 2, "zero_stage": 0}),
    ("gpt3", {"dp": 2, "zero_stage": 1}),
    ("llama", {"dp": 2, "zero_stage": 2}),
    ("gpt3", {"dp": 2, "zero_stage": 3}),
    ("llama", {"dp": 2, "zero_stage": 3, "offload": "optimizer_and_params"}),
    ("gpt3", {"tp": 2, "pp": 2}),
    ("llama", {"tp": 2, "dp": 2}),  # FSDP2 over vocabulary-sharded DTensors (2-D)
    ("llama", {"tp": 2, "engine": "deepspeed", "zero_stage": 1}),  # AutoTP
    ("llama", {"dp": 2, "engine": "deepspeed", "zero_stage": 2}),
    ("gpt3", {"dp": 2, "engine": "deepspeed", "zero_stage": 3, "offload": "optimizer_and_params", "act_ckpt": 2}),
    ("t5", {"pp": 2, "act_ckpt": 1}),
    ("t5", {"tp": 2, "dp": 2}),
    ("mt5", {"dp": 2, "zero_stage": 0, "act_ckpt": 3}),
    # the matrix tier: the same parallelisms in the other families and combinations
    matrix("gpt3", {"tp": 2, "dp": 2}),
    matrix("llama", {"tp": 2, "pp": 2}),
    ("llama", {"pp": 2, "vp": 2, "act_ckpt": 2, "dp": 2, "zero_stage": 3}),  # interleaved 1F1B, FSDP2 per chunk
    matrix("gpt3", {"dp": 2, "engine": "deepspeed", "zero_stage": 1}),
    matrix("gpt3", {"dp": 2, "engine": "deepspeed", "zero_stage": 3}),  # the tied embedding and head under ZeRO-3
    matrix("llama", {"dp": 2, "engine": "deepspeed", "zero_stage": 2, "offload": "optimizer"}),
    matrix("t5", {"dp": 2, "zero_stage": 3}),
    matrix("mt5", {"pp": 2}),
    matrix("mt5", {"tp": 2, "dp": 2}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_layout_reproduces_single_process_losses(tmp_path_factory, reference, family, layout):
    spec, out, result = launch(tmp_path_factory, family, **layout)
    assert result["status"] == "ok" and result["stop_reason"] == "max_steps"
    assert result["world_size"] == spec.parallel.tp * spec.parallel.pp * spec.parallel.dp
    assert result["backend"] == "gloo" and result["device"] == "cpu"
    assert list(result) == list(RESULT_FIELDS)
    ref = reference(family)
    assert result["first_losses"] == pytest.approx(ref["losses"], rel=REL_TOL)
    metrics = read_metrics(out)  # rank 0 alone writes one line per step
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(set(m) == set(METRIC_FIELDS) for m in metrics)
    assert [m["loss"] for m in metrics] == pytest.approx(ref["losses"], rel=REL_TOL)
    # the same gradient norm, so clipping acts the same (AdamW's first losses hardly show a wrong norm)
    assert [m["grad_norm"] for m in metrics] == pytest.approx(ref["grad_norms"], rel=REL_TOL)


@pytest.mark.e2e
def test_failure_on_one_rank_leaves_failed_status_without_hanging(tmp_path, monkeypatch):
    """The ranks forked as a local job's tasks are (trial_helpers.torchrun, the launch's environment handed on):
    no torchrun agent ends rank 0 when rank 1 fails, the engine alone must leave without hanging."""
    spec = tiny_spec("gpt3", pp=2, max_steps=20)
    out = tmp_path / "out"
    monkeypatch.setenv("HP_TOOL_TRIAL_FAIL_RANK", "1")
    monkeypatch.setenv("HP_TOOL_TRIAL_FAIL_STEP", "2")
    proc = torchrun(write_spec(spec, tmp_path), out, 2, timeout=90)
    assert proc.returncode != 0
    result = read_result(out)
    assert result["status"] == "failed" and result["stop_reason"] is None
    # the failing rank, the phase it was in (the second step, the first one's time listed), the exception
    assert result["reason"].startswith("rank 1 in step 2 after ")
    assert "first optimizer step" in result["reason"].splitlines()[0]
    assert "RuntimeError: injected failure on rank 1 at step 2" in result["reason"].splitlines()[0]
    assert "Traceback" in result["reason"]
    assert len(read_metrics(out)) == 1  # step 1 finished, step 2 failed
