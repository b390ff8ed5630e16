"""The confirmation round of a real search: the fastest trials run once more, into their confirm/ folders, the
report gives the run-to-run spread, and a resumed search runs nothing again (one-process trials of gpt3/tiny
on the in-process backend)."""

import pandas as pd
import pytest
from search_helpers import TS, ledger, search_here


@pytest.mark.e2e
def test_a_search_times_its_two_fastest_trials_again_and_a_resume_runs_nothing(tmp_path, monkeypatch):
    overrides = (f"{TS}.limit_search_runs=3", f"{TS}.max_steps_per_run=8", f"{TS}.search_strategy=exhaustive",
                 f"{TS}.confirm_top=2")
    code, out = search_here(tmp_path, *overrides)
    assert code == 0
    rows = pd.read_csv(out / "final_results" / "all_trials_1nodes.csv")
    ran = rows[rows["status"] == "ok"]
    confirmed = ran[ran["confirmed_step_time_s"].notna()]
    assert len(ran) == 3 and len(confirmed) == 2
    # the two confirmed are the two fastest first runs, and they hold ranks 1 and 2
    assert set(confirmed["trial_id"]) == set(ran.nsmallest(2, "full_run_step_time_s")["trial_id"])
    assert sorted(confirmed["rank"]) == [1, 2]
    for tid in confirmed["trial_id"]:
        assert (out / "training_logs" / tid / "confirm" / "result.json").is_file()
    assert "Confirmation round: the 2 fastest trials timed again" in (out / "final_results" / "report.md").read_text()
    submitted = [e for e in ledger(out) if e["state"] == "submitted"]
    assert len(submitted) == 5 and sum(e["trial_id"].endswith(".confirm") for e in submitted) == 2

    assert search_here(tmp_path, *overrides)[0] == 0
    assert len([e for e in ledger(out) if e["state"] == "submitted"]) == 5  # resumed: nothing ran again

    # cancel=true cancels the confirmation round's submitted jobs too (they are the search's)
    from hp_tool import search
    from hp_tool.cli import results_dir
    from hp_tool.planner import make_plan
    from search_helpers import in_process_app

    asked = []
    monkeypatch.setattr(search.LaunchSession, "launch", lambda session, jobs: asked.append((session.cancel, jobs)))
    app, name = in_process_app(tmp_path, *overrides, "cancel=true")
    plan = make_plan(app, name, results_dir(app, name))
    search._cancel_confirmation(app, plan, backend=None)
    (cancel, jobs), = asked
    assert cancel and sorted(j.name for j in jobs) == sorted(f"{t}.confirm" for t in confirmed["trial_id"])
