"""DeepSpeed's C++ ops are built by the orchestrator before the first DeepSpeed trial, never inside one."""

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.deepspeed_ops import needs_deepspeed_ops
from hp_tool.planner import make_plan
from hp_tool.vocab import LEDGER_FILE
from search_helpers import ONE_PROCESS, main_here


def plan_for(tmp_path, *overrides):
    cfg, name = compose(["search_config=gpt3/tiny", *overrides])
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def test_only_a_search_with_deepspeed_trials_builds_the_ops(tmp_path):
    assert not needs_deepspeed_ops(plan_for(tmp_path / "a").specs)
    both = plan_for(tmp_path / "b", "search_config.train_settings.engines=[torch,deepspeed]")
    assert needs_deepspeed_ops(both.specs)
    assert not needs_deepspeed_ops([s for s in both.specs if s.parallel.engine == "torch"])


@pytest.mark.e2e
def test_a_failed_op_build_stops_the_search_before_any_trial(tmp_path):
    """A machine that cannot compile (CXX is /bin/false, empty op cache): the search ends with an error
    naming the engines key and the fix, and no trial was submitted or has a result.
    The CLI's entry in this process (the build runs in a child process of its own, as in every search) on the
    in-process backend with one-process trials and the analytic memory check: the build comes before the first
    trial on every backend, and this one starts no warm process, whose imports would compete with the build's."""
    pytest.importorskip("deepspeed")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "/bin/false"}
    out = main_here("search_config=gpt3/tiny", "search_config.train_settings.engines=[deepspeed]", "cluster=in_process",
                    *ONE_PROCESS, "memory_check=analytic", f"base_results_dir={tmp_path}", cwd=tmp_path, env=env)
    assert out.returncode != 0
    err = out.stdout + out.stderr
    assert "search_config.train_settings.engines" in err and "hp_tool.trial.ds_ops" in err
    assert "engines=[torch]" in err
    assert not list(tmp_path.rglob("result.json")) and not list(tmp_path.rglob(LEDGER_FILE))
