"""Every parallel layout is the same model: its first losses match the single-process run (gloo, CPU).

Each launch is a real torchrun job of the trial engine; several checks share a launch to keep the
suite within a few minutes on two cores.
"""

from __future__ import annotations

import pytest

from hp_tool.contracts.result import METRIC_FIELDS, RESULT_FIELDS
from hp_tool.trial.train import run_trial
from trial_helpers import read_metrics, read_result, tiny_spec, torchrun, write_spec

REL_TOL = 1e-4
STEPS = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """First losses of the single-process run, per family (computed once)."""
    cache = {}

    def run(family: str) -> dict:
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"ref_{family}")
            spec = tiny_spec(family, max_steps=STEPS)
            result = run_trial(write_spec(spec, folder), str(folder / "out"))
            assert result["status"] == "ok", result["reason"]
            cache[family] = {"losses": result["first_losses"],
                             "grad_norms": [m["grad_norm"] for m in read_metrics(folder / "out")]}
        return cache[family]

    return run


def launch(tmp_path, family, **layout):
    spec = tiny_spec(family, max_steps=STEPS, **layout)
    out = tmp_path / "out"
    world = spec.parallel.tp * spec.parallel.pp * spec.parallel.dp
    proc = torchrun(write_spec(spec, tmp_path), out, world)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return spec, out, read_result(out)


@pytest.mark.e2e
@pytest.mark.parametrize("family, layout", [
    ("gpt3", {"pp": 2, "act_ckpt": 1}),
    ("llama", {"pp": 2}),
    ("gpt3", {"dp": 2, "zero_stage": 3}),
    ("gpt3", {"dp": 2, "zero_stage": 0}),
    ("llama", {"dp": 2, "zero_stage": 2}),
    # TP alone is in each of these: vocab-parallel embedding and head (tied for gpt3, untied for llama)
    ("gpt3", {"tp": 2, "dp": 2}),  # FSDP2 over vocabulary-sharded DTensors (2-D)
    ("llama", {"tp": 2, "dp": 2}),
    ("gpt3", {"tp": 2, "pp": 2}),
    ("llama", {"tp": 2, "pp": 2}),
    # interleaved 1F1B, one layer per chunk: the tied embedding (rank 0's first chunk) and head (rank 1's last)
    ("gpt3", {"pp": 2, "vp": 2}),
    ("llama", {"pp": 2, "vp": 2, "act_ckpt": 2, "dp": 2, "zero_stage": 3}),  # a chunk each, FSDP2 per chunk
    # memory savers: the torch engine's ZeRO-1 and FSDP2 offload, DeepSpeed's ZeRO stages, offload, AutoTP
    ("gpt3", {"dp": 2, "zero_stage": 1}),
    ("llama", {"dp": 2, "zero_stage": 3, "offload": "optimizer_and_params"}),
    ("gpt3", {"dp": 2, "engine": "deepspeed", "zero_stage": 1}),
    ("llama", {"dp": 2, "engine": "deepspeed", "zero_stage": 2}),
    ("gpt3", {"dp": 2, "engine": "deepspeed", "zero_stage": 3}),  # the tied embedding and head under ZeRO-3
    ("llama", {"dp": 2, "engine": "deepspeed", "zero_stage": 2, "offload": "optimizer"}),
    ("gpt3", {"dp": 2, "engine": "deepspeed", "zero_stage": 3, "offload": "optimizer_and_params", "act_ckpt": 2}),
    ("llama", {"tp": 2, "engine": "deepspeed", "zero_stage": 1}),  # AutoTP
    # encoder-decoder: head-sharded relative position tables, encoder on stage 0 and decoder on stage 1
    # with the encoder output and the position tables carried between them, FSDP2 and DDP
    ("t5", {"pp": 2, "act_ckpt": 1}),
    ("t5", {"dp": 2, "zero_stage": 3}),
    ("t5", {"tp": 2, "dp": 2}),
    ("mt5", {"pp": 2}),
    ("mt5", {"dp": 2, "zero_stage": 0, "act_ckpt": 3}),
    ("mt5", {"tp": 2, "dp": 2}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_layout_reproduces_single_process_losses(tmp_path, reference, family, layout):
    spec, out, result = launch(tmp_path, family, **layout)
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
def test_failure_on_one_rank_leaves_failed_status_without_hanging(tmp_path):
    spec = tiny_spec("gpt3", pp=2, max_steps=20)
    out = tmp_path / "out"
    env = {"HP_TOOL_TRIAL_FAIL_RANK": "1", "HP_TOOL_TRIAL_FAIL_STEP": "2"}
    proc = torchrun(write_spec(spec, tmp_path), out, 2, env=env, timeout=90)
    assert proc.returncode != 0
    result = read_result(out)
    assert result["status"] == "failed" and result["stop_reason"] is None
    # the failing rank, the phase it was in (the second step, the first one's time listed), the exception
    assert result["reason"].startswith("rank 1 in step 2 after ")
    assert "first optimizer step" in result["reason"].splitlines()[0]
    assert "RuntimeError: injected failure on rank 1 at step 2" in result["reason"].splitlines()[0]
    assert "Traceback" in result["reason"]
    assert len(read_metrics(out)) == 1  # step 1 finished, step 2 failed
