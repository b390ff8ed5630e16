"""Inference worker: greedy KV-cache generation equals recomputation, and TP=2 / PP=2 (2 CPU ranks as torchrun
starts them, forked from the warm process) generate the same tokens as TP=1 with the same seed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from hp_tool.inference.grid import InferenceJobConfig, dump_job_config
from hp_tool.inference.report import RESULT_FIELDS
from hp_tool.trial.inference_worker import build_server, generate, make_prompt, run_inference
from hp_tool.trial.dist import DistEnv
from hp_tool.contracts.spec import ModelSpec
from trial_helpers import torchrun_module

TINY = ModelSpec("gpt3", 4, 64, 4, 4, 256, 512, 128, init_method_std=0.08)
LLAMA_TINY = ModelSpec("llama", 4, 64, 4, 2, 176, 512, 128, init_method_std=0.2)  # GQA: 2 kv heads


def job_config(tmp_path: Path, tp: int = 1, pp: int = 1, batch: int = 2, model: ModelSpec = TINY) -> Path:
    cid = f"{model.family}_tiny_tp{tp}_pp{pp}_bs{batch}"
    cfg = InferenceJobConfig(cid, model, tp, pp, batch, 16, 8, 0, 0, str(tmp_path / cid), warmup=1, repeats=3,
                             precision="fp32")
    return dump_job_config(cfg, tmp_path / f"{cid}.yaml")


def load(path: Path) -> dict:
    return json.loads((path.parent / path.stem / "result.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    path = job_config(tmp_path_factory.mktemp("tp1"))
    run_inference(path)
    return load(path)


@pytest.mark.e2e
def test_single_process_result(single):
    assert list(single) == list(RESULT_FIELDS)
    assert single["status"] == "ok" and single["reason"] is None
    assert len(single["generated_tokens"]) == 8 and len(set(single["generated_tokens"])) > 1
    assert 0 < single["time_to_first_token_ms"] < single["latency_ms_p50"] <= single["latency_ms_p99"]
    assert single["tokens_per_s"] == pytest.approx(2 * 8 / single["latency_ms_p50"] * 1e3)
    assert single["world_size"] == 1 and single["device"] == "cpu"


@pytest.mark.e2e
@torch.no_grad()
def test_kv_cache_matches_full_recomputation(tmp_path):
    from hp_tool.inference.grid import load_job_config

    cfg = load_job_config(job_config(tmp_path))
    srv = build_server(cfg, DistEnv(), torch.device("cpu"))
    prompt = make_prompt(cfg, srv.device)
    cached, _, _ = generate(srv, prompt)
    seq = prompt
    for _ in range(cfg.output_seq_len):  # no cache: the whole sequence again at every step
        nxt = srv.stage(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(cached, seq[:, cfg.input_seq_len:])


@torch.no_grad()
def test_serving_applies_the_familys_forward_hooks_as_training_does(tmp_path, monkeypatch):
    """A family whose record scales its embeddings, soft-caps its logits and slides a 4-token window over its
    last two layers: KV-cache generation (the prompt step, then one token at a time over the cache) gives
    the tokens of the training stage's own forward over the whole sequence, and other tokens than the same
    weights without the hooks."""
    import dataclasses

    from hp_tool.inference.grid import load_job_config
    from hp_tool.trial.causal import DecoderHooks
    from hp_tool.trial.families import base as family_base, torch_family

    cfg = load_job_config(job_config(tmp_path, model=LLAMA_TINY))

    def generated(srv):
        prompt = make_prompt(cfg, srv.device)
        cached, _, _ = generate(srv, prompt)
        seq = prompt
        for _ in range(cfg.output_seq_len):
            seq = torch.cat([seq, srv.stage(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return cached, seq[:, cfg.input_seq_len:]

    plain, _ = generated(build_server(cfg, DistEnv(), torch.device("cpu")))
    hooks = DecoderHooks(embed_scale=lambda c: c.hidden_size ** 0.5, logit_softcap=lambda c: 0.5,
                         attention_window=lambda c, layer: 4 if layer >= 2 else None)
    monkeypatch.setitem(family_base._FAMILIES._records, "llama",
                        dataclasses.replace(torch_family("llama"), stage_hooks=hooks))
    srv = build_server(cfg, DistEnv(), torch.device("cpu"))
    assert srv.stage.windows == {"0": None, "1": None, "2": 4, "3": 4}
    cached, recomputed = generated(srv)
    assert torch.equal(cached, recomputed)
    assert not torch.equal(cached, plain)


@pytest.fixture(scope="module")
def single_llama(tmp_path_factory) -> dict:
    path = job_config(tmp_path_factory.mktemp("llama_tp1"), model=LLAMA_TINY)
    run_inference(path)
    return load(path)


def worker_ranks(path: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node=2 -m hp_tool.trial.inference_worker path``: the worker's 2 ranks forked from the warm
    process with torchrun's variables (trial_helpers.torchrun_module), so they import nothing again."""
    return torchrun_module("hp_tool.trial.inference_worker", [path], path.parent / f".{path.stem}_ranks", 2, timeout=120)


# The covering set of family x layout (default run): GPT-3 under TP2, Llama (GQA) in 2 pipeline stages; each
# layout once, each family once. The other two cells are the matrix tier (-m matrix).
@pytest.mark.e2e
@pytest.mark.parametrize("tp, pp", [pytest.param(2, 1, marks=pytest.mark.matrix), (1, 2)])
def test_llama_layouts_generate_the_same_tokens(tmp_path, single_llama, tp, pp):
    assert single_llama["status"] == "ok" and len(set(single_llama["generated_tokens"])) > 1
    path = job_config(tmp_path, tp, pp, model=LLAMA_TINY)
    proc = worker_ranks(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load(path)["generated_tokens"] == single_llama["generated_tokens"]


@pytest.mark.e2e
@pytest.mark.parametrize("tp, pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.matrix)])
def test_layouts_generate_the_same_tokens(tmp_path, single, tp, pp):
    path = job_config(tmp_path, tp, pp)
    proc = worker_ranks(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = load(path)
    assert result["status"] == "ok" and result["world_size"] == 2
    assert result["generated_tokens"] == single["generated_tokens"]
    assert result["tokens_per_s_per_gpu"] == pytest.approx(result["tokens_per_s"] / 2)


def test_wrong_process_count_leaves_a_failed_status(tmp_path):
    path = job_config(tmp_path, tp=2)
    result = run_inference(path)
    assert result["status"] == "failed" and "needs TP*PP=2 processes" in result["reason"]
    assert load(path)["status"] == "failed"
