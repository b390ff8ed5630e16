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
    assert "b (same regime: TP=2, PP=1) ran out of memory at a predicted 50.00 GiB" in got["c"][1]


def test_nothing_is_decided_before_any_trial_ends():
    assert verdicts(grid(), [], skip_margin=0.0) == {}


def test_no_candidate_of_an_unmeasured_regime_is_skipped_on_another_regimes_calibration():
    # only (2, 1) measured, 3x slower than predicted: its own b and c are calibrated behind a and skipped; (1, 2)
    # and (4, 1) calibrated with (2, 1)'s factor would look hopeless, but no trial has measured them: within 2x
    # of a on their raw predictions, they run (their regimes' best first, by the launch order)
    got = verdicts(grid(), [Outcome("a", "ok", 3.3)], skip_margin=0.0)
    assert set(got) == {"b", "c"}
    assert all(status == SKIPPED and "its regime's factor from its own trials: TP=2, PP=1" in reason
               for status, reason in got.values())


def test_a_running_trial_slower_than_the_best_by_the_margin_is_stopped_with_its_numbers():
    ended = [Outcome("a", "ok", 2.0), Outcome("d", "ok", 1.6), Outcome("b", "oom")]
    # steady 0.5 s steps on the trial's processes, 2.1 s for the full run: 31% behind d's 1.6 s
    steady = [0.5] * LOSING_MIN_STEPS
    stop = losing("e", steady, 2.1, ended, skip_margin=0.25)
    assert stop is not None and stop[0] == LOSING
    assert "0.5 s over 5 timed steps (at least 2.1 s for the full run, 2.1 s at the median)" in stop[1]
    assert "skip_margin=0.25 slower than the best measured, d at 1.6 s" in stop[1]
    assert losing("e", steady, 2.1, ended, skip_margin=0.4) is None  # within 40%
    assert losing("e", steady[1:], 2.1, ended, skip_margin=0.25) is None  # too few steps yet
    assert losing("e", steady, 2.1, [Outcome("b", "oom")], skip_margin=0.0) is None  # no best
    # a trial is not measured against itself (its own earlier result, e.g. a resumed search)
    assert losing("d", steady, 2.1, ended, skip_margin=0.0)[1].endswith("a at 2 s")


def test_a_trial_whose_median_is_behind_only_on_noisy_steps_runs_on():
    # the landscape's best layout on a busy CPU: 7 timed steps, most near 0.04 s, two stalls; the median
    # (0.086 s) extrapolates 2.3x behind the best measured, but the steps' spread says it may be as fast
    ended = [Outcome("a", "ok", 0.045)]
    noisy = [0.037, 0.039, 0.041, 0.086, 0.11, 0.38, 0.09]
    assert losing("best", noisy, 0.086, ended, skip_margin=0.25) is None
    # the same median on steady steps is behind with confidence and stops
    steady = [0.084, 0.085, 0.086, 0.086, 0.087, 0.088, 0.086]
    stop = losing("slow", steady, 0.086, ended, skip_margin=0.25)
    assert stop is not None and stop[0] == LOSING


def test_the_skip_bar_is_the_best_trials_calibrated_prediction_when_the_calibration_over_predicts_it():
    # Fixed calibration from three trials of one regime: the model is right on a and b (x1), while a measured
    # 25% under its own prediction (a lucky run). Judged against a's measured 0.8 s, c (calibrated 1.1 s) would
    # be 37% behind and skipped; judged like for like, against a's calibrated prediction (1.0 s), it is 10%
    # behind and runs. A candidate far behind either way is still skipped, naming both of a's figures.
    options = [Option("a", 1, 1, 1.0, 0.0, 10), Option("b", 1, 1, 1.2, 0.0, 10), Option("x", 1, 1, 1.3, 0.0, 10),
               Option("c", 1, 1, 1.1, 0.0, 10), Option("far", 1, 1, 2.0, 0.0, 10)]
    outcomes = [Outcome("a", "ok", 0.8), Outcome("b", "ok", 1.2), Outcome("x", "ok", 1.3)]
    got = verdicts(options, outcomes, skip_margin=0.25)
    assert "c" not in got
    assert got["far"][0] == SKIPPED
    assert "best measured, a at 1 s (its calibrated prediction; measured 0.8 s" in got["far"][1]


def test_nothing_is_skipped_while_the_calibration_is_clamped_at_its_bounds():
    # measured 20x slower than predicted: the factor stops at its bound 10, which explains nothing; a candidate
    # predicted 3x slower than the best is not skipped on such a fit (an OOM still prunes)
    options = [Option("a", 1, 1, 1.0, 0.0, 10), Option("slow", 1, 1, 3.0, 0.0, 10), Option("big", 1, 1, 1.0, 0.0, 20)]
    outcomes = [Outcome("a", "ok", 20.0), Outcome("o", "oom")]
    assert verdicts(options, outcomes, skip_margin=0.25) == {}
    fitted = verdicts(options, [Outcome("a", "ok", 2.0)], skip_margin=0.25)
    assert fitted["slow"][0] == SKIPPED  # the same case with a factor of 2 skips it


def test_an_unmeasured_regime_predicted_more_than_twice_the_best_is_not_scouted():
    # a (2, 1) measured 3x its prediction; (1, 2)'s best, d, is predicted 1.14x a (raw): it runs once to
    # calibrate its regime. (4, 1)'s f is predicted 1.73x: still within the 2x a regime's own error may
    # span, it runs. A regime g predicted 2.7x a would need its own error to be more than 2x in its favour
    # against a's regime: it is skipped, and the reason says why its regime was not scouted.
    options = [*grid(), Option("g", 8, 1, 2.9, 0.1, 10)]
    got = verdicts(options, [Outcome("a", "ok", 3.3)], skip_margin=0.0)
    assert "d" not in got and "f" not in got
    status, reason = got["g"]
    assert status == SKIPPED
    assert "no trial of its regime (TP=8, PP=1), nor of each of its values, yet" in reason and "more than 2x" in reason
    # a user who keeps everything within 3x (skip_margin=2) scouts it
    assert "g" not in verdicts(options, [Outcome("a", "ok", 3.3)], skip_margin=2.0)


def test_a_trial_far_behind_on_every_step_is_stopped_after_three_timed_steps():
    ended = [Outcome("a", "ok", 0.04)]
    far = [0.78, 0.80, 0.77]  # 20x the best: no run-to-run noise explains it
    stop = losing("tp2", far, 0.78, ended, skip_margin=0.25)
    assert stop is not None and stop[0] == LOSING
    assert "every one of its 3 timed steps" in stop[1]
    # two steps are not enough, and one fast step among three keeps it running until the usual test
    assert losing("tp2", far[:2], 0.78, ended, skip_margin=0.25) is None
    assert losing("tp2", [0.78, 0.09, 0.77], 0.78, ended, skip_margin=0.25) is None
    # behind by less than twice the margin's bar: judged after the usual five timed steps only
    assert losing("slow", [0.09, 0.09, 0.09], 0.09, ended, skip_margin=0.25) is None


def test_a_method_running_7x_its_prediction_does_not_skip_one_running_2x_that_holds_the_best():
    """One TP/PP, two methods (regimes by the method: hp_tool/dimensions.py ``Dimension.regime``): the model ranks
    LoRA first, LoRA runs 7x its predictions and full fine-tuning 2x, so a full layout is the true best. Searched as
    the launcher runs it one trial at a time (launch order, then each verdict before each launch), the full
    regime's best is measured, not skipped on LoRA's factor, and the pick is the true best. With the regime keyed
    by TP and PP alone (the recipe dropped) the full layouts would be priced with LoRA's factor and all skipped."""
    lora, full = (("method", "lora"),), (("method", "full"),)
    options = [Option(f"lora{i}", 1, 1, 1.0 + 0.1 * i, 0.0, 10, lora) for i in range(4)] + \
              [Option(f"full{i}", 1, 1, 1.3 + 0.2 * i, 0.0, 10, full) for i in range(4)]
    truth = {o.name: o.predicted_s * (7.0 if o.recipe == lora else 2.0) for o in options}

    def search(opts: list[Option]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for name in launch_order(opts):
            if name not in verdicts(opts, outcomes, skip_margin=0.25):
                outcomes.append(Outcome(name, "ok", truth[name]))
        return outcomes

    ran = search(options)
    pick = min(ran, key=lambda r: r.step_s)
    assert pick.name == min(truth, key=truth.get) == "full0"
    assert {r.name for r in ran} >= {"lora0", "full0"}
    blind = search([Option(o.name, o.tp, o.pp, o.compute_s, o.comm_s, o.memory_gib) for o in options])
    assert not any(r.name.startswith("full") for r in blind)  # LoRA's 7x put every full layout 2.6x behind
    assert min(blind, key=lambda r: r.step_s).name == "lora0"  # a pick 2.7x slower than the best


def test_an_unmeasured_regime_whose_every_value_ran_is_priced_by_what_it_shares_with_them():
    """(TP 1, full), (TP 1, LoRA) and (TP 2, LoRA) measured: full runs 2x its prediction, LoRA 6x, TP 2 no worse
    than TP 1. (TP 2, full) has no trial but each of its values has run: it is calibrated by the product of its
    values' factors (about 2x), not LoRA's 6x; a (TP 2, full) candidate predicted far behind is skipped on that,
    naming where its factor came from, and one close to the best runs."""
    full, lora = (("method", "full"),), (("method", "lora"),)
    options = [Option("f1", 1, 1, 1.0, 0.0, 10, full), Option("l1", 1, 1, 0.5, 0.0, 10, lora),
               Option("l2", 2, 1, 0.5, 0.0, 10, lora), Option("near", 2, 1, 1.05, 0.0, 10, full),
               Option("far", 2, 1, 2.0, 0.0, 10, full)]
    outcomes = [Outcome("f1", "ok", 2.0), Outcome("l1", "ok", 3.0), Outcome("l2", "ok", 3.0)]
    got = verdicts(options, outcomes, skip_margin=0.25)
    assert "near" not in got
    status, reason = got["far"]
    assert status == SKIPPED and "calibrated prediction 4 s" in reason
    assert "its regime, TP=2, PP=1, not measured: the product of its values' factors" in reason


def test_an_unmeasured_regime_is_set_against_the_best_by_the_values_it_shares_never_by_the_bests_own_factor():
    """(TP 1, LoRA) ran at 2x its prediction and (TP 2, LoRA) at 6x: TP 2 runs 3x slower than the model says. No
    full fine-tuning has run. (TP 1, full), predicted 1.5x the best, is scouted: nothing is known of full, and
    LoRA's 2x is not its. (TP 2, full), predicted 1.5x too, shares TP 2 with a measured trial: 3x that, 4.5x the
    best, more than full's own unknown error could make up within 2x; it is skipped, the reason saying so."""
    full, lora = (("method", "full"),), (("method", "lora"),)
    options = [Option("l1", 1, 1, 1.0, 0.0, 10, lora), Option("l2", 2, 1, 1.0, 0.0, 10, lora),
               Option("f1", 1, 1, 1.5, 0.0, 10, full), Option("f2", 2, 1, 1.5, 0.0, 10, full)]
    got = verdicts(options, [Outcome("l1", "ok", 2.0), Outcome("l2", "ok", 6.0)], skip_margin=0.25)
    assert "f1" not in got
    status, reason = got["f2"]
    assert status == SKIPPED and "4.50x the raw prediction of the best" in reason
    assert "with the factors of the values it shares with trials" in reason
