"""Test tiers: tests that run something end to end (start processes, train or trace a model, plan every
shipped config) carry the ``e2e`` marker, so ``-m "not e2e and not slurm"`` is the fast tier: it runs in the
test process alone. With HP_TOOL_CHECK_TIERS=1 an unmarked test that starts a process fails,
naming what it started (the process is not started). The ``matrix`` tier (every layout x family product)
is left out of the default run (pyproject's addopts) and run with ``-m matrix``.

The budget: a test of the default run whose setup, call or teardown takes more than HP_TOOL_TEST_BUDGET_S
(90 s; 0 turns the check off) is listed at the end of the run with its time; with HP_TOOL_TEST_BUDGET_FAIL=1
it fails. One slow test is how a suite outgrows its CI."""

from __future__ import annotations

import os

import subprocess

import _posixsubprocess
import pytest

BUDGET_S = float(os.environ.get("HP_TOOL_TEST_BUDGET_S", "90"))


def pytest_collection_modifyitems(config, items):
    for item in items:  # a matrix cell runs something end to end: never in the fast tier
        if item.get_closest_marker("matrix"):
            item.add_marker(pytest.mark.e2e)


OVER_BUDGET: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (BUDGET_S > 0 and report.passed and call.duration > BUDGET_S
            and not item.get_closest_marker("matrix")):
        OVER_BUDGET.append(f"{call.duration:.0f} s {call.when} {item.nodeid}")
        if os.environ.get("HP_TOOL_TEST_BUDGET_FAIL") == "1":
            report.outcome = "failed"
            report.longrepr = (f"{call.when} took {call.duration:.0f} s, over the {BUDGET_S:.0f} s a test of the "
                               f"default run may take (tests/conftest.py): share a fixture's search, trim the model "
                               f"or steps, or move it to the matrix tier")


def pytest_terminal_summary(terminalreporter):
    if OVER_BUDGET:
        terminalreporter.section(f"over the {BUDGET_S:.0f} s budget of a test (tests/conftest.py)")
        for line in OVER_BUDGET:
            terminalreporter.write_line(line)


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
