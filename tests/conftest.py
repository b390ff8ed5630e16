"""Test tiers: tests that run something end to end (start processes, train or trace a model, sweep every
shipped preset or published run) carry the ``e2e`` marker, so ``-m "not e2e and not slurm"`` is the fast tier: it runs in the
test process alone. With HP_TOOL_CHECK_TIERS=1 an unmarked test that starts a process fails,
naming what it started (the process is not started). The ``matrix`` tier (every layout x family product)
is left out of the default run (pyproject's addopts) and run with ``-m matrix``.

The budget: a test of the default run whose call takes more than HP_TOOL_TEST_BUDGET_S (90 s; 0 turns the
check off) fails, naming its time: one slow test is how a suite outgrows its CI. Setup is not held to it: a
shared search (one search, many asserts) is set up by whichever of its readers runs first, so its time would
fail a reader by the order tests run in; ``--durations`` (CI lists the 30 slowest phases) shows it."""

from __future__ import annotations

import os
import subprocess
import tempfile

import _posixsubprocess
import pytest

# session-scoped searches that many tests read (one search, many asserts)
from shared_finetune_searches import *  # noqa: E402,F401,F403
from shared_searches import *  # noqa: E402,F401,F403

BUDGET_S = float(os.environ.get("HP_TOOL_TEST_BUDGET_S", "90"))
# what hp_tool keeps once per input (hp_tool/hf_config.py cache_dir) is this session's own, never the user's
os.environ["HP_TOOL_CACHE"] = tempfile.mkdtemp(prefix="hp_tool_cache_")


def pytest_collection_modifyitems(config, items):
    for item in items:  # a matrix cell runs something end to end: never in the fast tier
        if item.get_closest_marker("matrix"):
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (BUDGET_S > 0 and report.passed and call.when == "call" and call.duration > BUDGET_S
            and not item.get_closest_marker("matrix")):
        report.outcome = "failed"
        report.longrepr = (f"the test took {call.duration:.0f} s, over the {BUDGET_S:.0f} s a test of the default "
                           f"run may take (tests/conftest.py): share a fixture's search, trim the model or steps, "
                           f"or move it to the matrix tier")


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
