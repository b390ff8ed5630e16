"""The adaptive search's decisions on constructed cases: launch order, skipping, pruning after an OOM,
stopping a losing trial."""

from __future__ import annotations

from hp_tool.vocab import LOSING, PRUNED_AFTER_OOM, SKIPPED
from hp_tool.adaptive import (LOSING_MIN_STEPS, Option, Outcome, launch_order,
                              losing, verdicts)


def grid() -> list[Option]:
    # three regimes; predictions fastest in (2, 1), then (1, 2), then (4, 1)
    return [
        Option("a", 2, 1, 1.0, 0.1, 40), Option("b", 2, 1, 1.1, 0.1, 50), Option("c", 2, 1, 1.2, 0.1, 60),
        Option("d", 1, 2, 1.05, 0.2, 45), Option("e", 1, 2, 1.3, 0.2, 30),
        Option("f", 4, 1, 1.5, 0.4, 20),
    ]


def test_first_wave_spreads_over_tp_pp_regimes_most_promising_first():
    assert launch_order(grid()) == ["a", "d", "f", "b", "e", "c"]


def test_candidates_slower_than_the_best_measured_by_the_margin_are_skipped_with_both_numbers():
    # measured 2x slower than predicted everywhere: calibration scales every prediction by 2
    outcomes = [Outcome("a", "ok", 2.2), Outcome("d", "ok", 2.5), Outcome("f", "ok", 3.8)]
    got = verdicts(grid(), outcomes, skip_margin=0.15)
    assert set(got) == {"e", "c"}  # calibrated 3.0 and 2.6 s > 2.2 x 1.15; b (2.4 s) is within the margin
    status, reason = got["e"]
    assert status == SKIPPED
    assert "calibrated prediction 3" in reason and "best measured, a at 2.2 s" in reason
    assert verdicts(grid(), outcomes, skip_margin=1.0) == {}


def test_an_oom_prunes_untried_candidates_of_its_regime_predicted_to_need_as_much():
    got = verdicts(grid(), [Outcome("b", "oom")], skip_margin=10)
    assert got == {"c": (PRUNED_AFTER_OOM, got["c"][1])}  # a needs less, d/e/f are other regimes
    assert "b (same TP 2, PP 1) ran out of memory at a predicted 50.00 GiB" in got["c"][1]


def test_nothing_is_decided_before_any_trial_ends():
    assert verdicts(grid(), [], skip_margin=0.0) == {}


def test_each_unmeasured_regime_gets_its_best_candidate_launched_before_anything_is_skipped():
    # only (2, 1) measured, 3x slower than predicted: (1, 2) and (4, 1) are calibrated hopeless, but their
    # best candidates still run once so the calibration sees their communication
    got = verdicts(grid(), [Outcome("a", "ok", 3.3)], skip_margin=0.0)
    assert set(got) == {"b", "c", "e"}
    assert all(status == SKIPPED for status, _ in got.values())


def test_a_running_trial_slower_than_the_best_by_the_margin_is_stopped_with_its_numbers():
    ended = [Outcome("a", "ok", 2.0), Outcome("d", "ok", 1.6), Outcome("b", "oom")]
    # measured 0.5 s per step on the trial's processes, 2.1 s for the full run: 31% behind d's 1.6 s
    stop = losing("e", 0.5, LOSING_MIN_STEPS, 2.1, ended, skip_margin=0.25)
    assert stop is not None and stop[0] == LOSING
    assert "0.5 s over 5 timed steps (2.1 s for the full run)" in stop[1]
    assert "skip_margin=0.25 slower than the best measured, d at 1.6 s" in stop[1]
    assert losing("e", 0.5, LOSING_MIN_STEPS, 2.1, ended, skip_margin=0.4) is None  # within 40%
    assert losing("e", 0.5, LOSING_MIN_STEPS - 1, 2.1, ended, skip_margin=0.25) is None  # too few steps yet
    assert losing("e", 0.5, LOSING_MIN_STEPS, 2.1, [Outcome("b", "oom")], skip_margin=0.0) is None  # no best
    # a trial is not measured against itself (its own earlier result, e.g. a resumed search)
    assert losing("d", 0.5, LOSING_MIN_STEPS, 2.1, ended, skip_margin=0.0)[1].endswith("a at 2 s")
