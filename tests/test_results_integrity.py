"""A ranking names only what was measured: fingerprints, stale results set aside, one orchestrator per
results folder, and tracking failures that never stop a search. Real searches of gpt3/tiny with one-process
trials on the in-process backend: in this test process (tests/shared_searches.py's one_layout_gbs_reruns: one
layout searched at two global batches, the first with W&B unable to write), or as orchestrator processes where
two compete."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.inference import search as inference
from hp_tool.contracts.spec import load_spec
from hp_tool.launch.backends import backend_for
from hp_tool.launch.ledger import Ledger
from hp_tool.launch.monitor import Progress
from hp_tool.launch.runner import Launcher, set_aside
from hp_tool.results.collect import collect_trials
from hp_tool.search import plan_jobs
from hp_tool.vocab import LOCK_FILE
from search_helpers import ONE_PROCESS, TS, main_here
from shared_searches import ONE_LAYOUT, ONE_LAYOUT_TRIAL as TRIAL
from test_results_helpers import planned, selected_ids, trial_dir, write_ok

REPO = Path(__file__).resolve().parent.parent


def main_args(tmp_path, *args):
    return ["search_config=gpt3/tiny", "cluster=in_process", *ONE_PROCESS,
            "memory_check=analytic",  # the trace is tested in test_memory_check and test_launch
            f"base_results_dir={tmp_path / 'res'}", *args]


def main_cmd(tmp_path, *args):
    return [sys.executable, str(REPO / "main.py"), *main_args(tmp_path, *args)]


def out_dir(tmp_path):
    return tmp_path / "res" / "gpt3" / "tiny"


@pytest.mark.e2e
def test_changing_the_global_batch_reruns_the_trial_and_keeps_the_old_result(one_layout_gbs_reruns):
    """ONE_LAYOUT at global batch 8, then 16 in the same folder (tests/shared_searches.py)."""
    first, second = one_layout_gbs_reruns.runs
    assert first.returncode == 0, first.output
    out = one_layout_gbs_reruns.results
    old = json.loads(one_layout_gbs_reruns.old_result)

    assert second.returncode == 0, second.output
    new = json.loads((out / "training_logs" / TRIAL / "result.json").read_text())
    spec = load_spec(out / "candidate_configs" / f"{TRIAL}.yaml")
    assert spec.training.global_batch_size == 16 and new["fingerprint"] == spec.fingerprint() != old["fingerprint"]
    assert new["start_time"] != old["start_time"]  # measured again, not reused
    [kept] = (out / "training_logs" / TRIAL).glob("stale-*/result.json")
    assert json.loads(kept.read_text()) == old
    assert first.submitted == 1 and second.submitted == len(Ledger(out).submissions()) == 2
    row = pd.read_csv(out / "final_results" / "all_trials_1nodes.csv").set_index("trial_id").loc[TRIAL]
    assert (row["status"], row["global_batch_size"], row["trial_global_batch_size"]) == ("ok", 16, 16)
    # GBS 16 carries twice the tokens of GBS 8 per step: the ranked throughput comes from this run
    assert row["measured_step_time_s"] == pytest.approx(new["step_time_s_median"], rel=1e-5)


def test_a_result_of_another_configuration_is_stale_and_never_ranked(tmp_path):
    _, out, plan = planned(tmp_path)
    fast, slow = selected_ids(plan)[:2]
    write_ok(out, fast, 0.1)
    write_ok(out, slow, 0.9)
    path = trial_dir(out, fast) / "result.json"
    result = json.loads(path.read_text())
    path.write_text(json.dumps({**result, "fingerprint": "0123456789abcdef"}))
    df = collect_trials(out).set_index("trial_id")
    assert df.loc[fast, "status"] == "stale" and "0123456789abcdef" in df.loc[fast, "reason"]
    assert pd.isna(df.loc[fast, "rank"]) and pd.isna(df.loc[fast, "measured_step_time_s"])
    assert df.loc[slow, "rank"] == 1


def test_resume_sets_a_stale_result_aside_and_queues_the_trial_again(tmp_path):
    app, out, plan = planned(tmp_path)
    jobs = plan_jobs(plan)
    write_ok(out, jobs[0].name, 0.2)
    write_ok(out, jobs[1].name, 0.3)
    path = jobs[1].out / "result.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "fingerprint": "old"}))
    launcher = Launcher(app.cluster, backend_for(app.cluster, app.gpu), out, jobs[:2], Progress(), "sid")
    launcher.resume()
    assert [j.name for j in launcher.pending] == [jobs[1].name]
    assert not path.exists() and len(list(jobs[1].out.glob("stale-*/result.json"))) == 1
    assert (jobs[0].out / "result.json").exists()


def test_set_aside_moves_only_result_files(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "1_0_log.err").write_text("log")
    (tmp_path / "result.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    moved = set_aside(tmp_path)
    assert sorted(p.name for p in moved.iterdir()) == ["metrics.jsonl", "result.json"]
    assert (tmp_path / "job" / "1_0_log.err").exists() and set_aside(tmp_path) is None


@pytest.mark.e2e
def test_two_orchestrators_started_together_submit_each_trial_once_and_a_third_is_refused(tmp_path):
    args = (f"{TS}.micro_batch_sizes=[2,4]", *ONE_LAYOUT[1:], f"{TS}.search_strategy=exhaustive", "wait_for_lock=true")
    first, waiting = (subprocess.Popen(main_cmd(tmp_path, *args), cwd=tmp_path, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for _ in range(2))
    lock = out_dir(tmp_path) / LOCK_FILE
    deadline = time.time() + 60
    while not (lock.exists() and "pid" in lock.read_text()):
        if time.time() > deadline:
            for p in (first, waiting):
                p.kill()
            pytest.fail(f"after 60 s no orchestrator has written its pid into {lock}; their output: "
                        + " | ".join("".join(p.communicate())[-1500:] for p in (first, waiting)))
        time.sleep(0.2)
    holder = lock.read_text()
    # without wait_for_lock: the CLI's entry in this process, refused by the lock an orchestrator process holds
    refused = main_here(*main_args(tmp_path, *args[:-1]), cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "is in use by pid" in refused.stderr and holder.split()[1] in refused.stderr
    assert "wait_for_lock=true" in refused.stderr
    outs = [p.communicate(timeout=600) for p in (first, waiting)]
    assert [p.returncode for p in (first, waiting)] == [0, 0], [o[1][-2000:] for o in outs]
    assert sum("waiting for it (wait_for_lock=true)" in o[0] + o[1] for o in outs) == 1
    ledger = Ledger(out_dir(tmp_path))
    names = [e.trial_id for e in ledger.submissions()]
    assert sorted(names) == sorted(set(names)) and len(names) == 2  # each trial submitted once
    assert not lock.read_text().strip()  # released


@pytest.mark.e2e
def test_a_broken_wandb_directory_leaves_the_search_complete(one_layout_gbs_reruns):
    """ONE_LAYOUT's first search ran with W&B on (offline) and WANDB_DIR a file (tests/shared_searches.py)."""
    first = one_layout_gbs_reruns.runs[0]
    assert first.returncode == 0, first.output
    assert f"W&B: {TRIAL} was not uploaded" in first.stderr
    summary = first.summary_frame()
    assert list(summary["trial_id"]) == [TRIAL] and list(summary["status"]) == ["ok"]


def test_inference_result_of_another_configuration_is_stale(tmp_path):
    cfg, _ = compose(["search_config=gpt3/tiny", "cluster=local", "search_config.inference_settings.max_batch_sizes=[1]",
                      "search_config.inference_settings.tensor_parallel_sizes=[1]"])
    app = to_app_config(cfg)
    plan = inference.plan_inference(app, tmp_path)
    inference.write_configs(plan)
    [(cid, job_cfg)] = plan.configs.items()
    plan_rows = (plan.root / "candidate_configs" / "plan.csv").read_text()
    assert job_cfg.fingerprint() in plan_rows
    result = {**inference.report.empty_result(job_cfg), "status": "ok", "fingerprint": "other"}
    inference.report.write_result(Path(job_cfg.output_dir), result)
    [row] = inference.collect_rows(plan)
    assert row["status"] == "stale" and "other" in row["reason"]
