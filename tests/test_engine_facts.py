"""Engines described by facts (hp_tool/engine_facts.py): every engine the trial runs has a record, and the
rules (hp_tool/sharding.py) follow the record, not the engine's name."""

import dataclasses

import pytest

from hp_tool import engine_facts as facts_module, sharding
from hp_tool.engine_facts import DEEPSPEED, ENGINE_FACTS, TORCH
from hp_tool.vocab import ENGINES


def test_every_engine_has_one_record_and_an_implementation():
    from hp_tool.trial.engines import ENGINES as IMPLEMENTED

    assert set(ENGINE_FACTS) == set(ENGINES) == set(IMPLEMENTED)
    assert len({f.code for f in ENGINE_FACTS.values()}) == len(ENGINE_FACTS)  # trial ids tell them apart


@pytest.mark.parametrize("fact, rule", [
    ("context_parallel", lambda e: sharding.sequence_problem("llama", 4096, 1, 1, 2, 1, False, "full", False, e)),
    ("chunked_loss", lambda e: sharding.sequence_problem("llama", 4096, 1, 1, 1, 1, False, "chunked", False, e)),
    ("activation_offload", lambda e: sharding.sequence_problem("llama", 4096, 1, 1, 1, 1, False, "full", True, e)),
    ("selective_checkpointing", lambda e: sharding.checkpoint_mode_problem("llama", "selective", 4, e)),
    ("expert_parallel", lambda e: sharding.expert_problem(8, 2, 4, 1, e)),
])
def test_a_rule_follows_the_engines_record(monkeypatch, fact, rule):
    """DeepSpeed's record says it does not run this; the same engine with the fact set runs it, and the
    torch engine with the fact cleared does not: the rule reads the record, not the name."""
    assert rule("deepspeed") is not None and rule("torch") is None
    monkeypatch.setitem(facts_module.ENGINE_FACTS, "deepspeed", dataclasses.replace(DEEPSPEED, **{fact: True}))
    monkeypatch.setitem(facts_module.ENGINE_FACTS, "torch", dataclasses.replace(TORCH, **{fact: False}))
    assert rule("deepspeed") is None and rule("torch") is not None


def test_savers_follow_the_record(monkeypatch):
    assert sharding.combination_problem("torch", 1, "optimizer", 1, 1)[0] == "offload"  # FSDP2's stages only
    assert sharding.combination_problem("deepspeed", 1, "optimizer", 1, 1) is None
    assert sharding.combination_problem("deepspeed", 3, "none", 2, 1)[0] == "zero_stages"
    assert sharding.combination_problem("deepspeed", 1, "none", 1, 2)[0] == "engines"
    monkeypatch.setitem(facts_module.ENGINE_FACTS, "torch", dataclasses.replace(TORCH, offload_min_zero_stage=1))
    monkeypatch.setitem(facts_module.ENGINE_FACTS, "deepspeed", dataclasses.replace(
        DEEPSPEED, tp_zero_stages=(0, 1, 2, 3), pp_zero_stages=(0, 1, 2, 3)))
    assert sharding.combination_problem("torch", 1, "optimizer", 1, 1) is None
    assert sharding.combination_problem("deepspeed", 3, "none", 2, 1) is None
    assert sharding.combination_problem("deepspeed", 1, "none", 1, 2) is None
