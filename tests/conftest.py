"""Test tiers: tests that run something end to end (start processes, train or trace a model, plan every
shipped config) carry the ``e2e`` marker, so ``-m "not e2e and not slurm"`` is the fast tier: it runs in the
test process alone. With HP_TOOL_CHECK_TIERS=1 an unmarked test that starts a process fails,
naming what it started (the process is not started)."""

from __future__ import annotations

import os

import subprocess

import _posixsubprocess
import pytest


@pytest.fixture(autouse=True)
def _processes_only_in_marked_tests(request, monkeypatch):
    if not os.environ.get("HP_TOOL_CHECK_TIERS") or any(
            request.node.get_closest_marker(m) for m in ("e2e", "slurm")):
        yield
        return
    started: list[str] = []

    def watch(what):
        def call(*args, **kwargs):
            started.append(what(args))
            raise RuntimeError(f"a test without the e2e marker starts a process: {started[-1]}")
        return call

    monkeypatch.setattr(_posixsubprocess, "fork_exec", watch(lambda a: repr(a[0])[:120]))
    monkeypatch.setattr(subprocess, "_fork_exec", watch(lambda a: repr(a[0])[:120]))
    monkeypatch.setattr(os, "fork", watch(lambda a: "os.fork()"))
    monkeypatch.setattr(os, "posix_spawn", watch(lambda a: repr(a[:2])[:120]))
    monkeypatch.setattr(os, "posix_spawnp", watch(lambda a: repr(a[:2])[:120]))
    yield
    if started:
        pytest.fail(f"starts {len(started)} process(es), e.g. {started[0]}: mark it @pytest.mark.e2e")
