"""Calibrating the step-time model on measured trials: known factors come back from synthetic measurements."""

from __future__ import annotations

import random

import pytest

from hp_tool.calibration import BOUNDS, StepPoint, fit_memory_offset, fit_step_factors


def synthetic(compute_factor: float, comm_factor: float, n: int = 8, noise: float = 0.02, seed: int = 3):
    rng = random.Random(seed)
    points = []
    for _ in range(n):
        compute, comm = rng.uniform(0.5, 5.0), rng.uniform(0.05, 3.0)
        truth = compute_factor * compute + comm_factor * comm
        points.append(StepPoint(compute, comm, truth * (1 + rng.uniform(-noise, noise))))
    return points


# the seeded fits are off by (compute, comm) 0.79% and 1.63%, 1.70% and 0.38%, 0.98% and 0.69%: twice that allowed
@pytest.mark.parametrize("compute_factor, comm_factor, compute_rel, comm_rel",
                         [(1.6, 0.5, 0.016, 0.033), (0.7, 2.5, 0.034, 0.008), (1.0, 1.0, 0.02, 0.014)])
def test_known_factors_are_recovered_from_noisy_measurements(compute_factor, comm_factor, compute_rel, comm_rel):
    factors = fit_step_factors(synthetic(compute_factor, comm_factor))
    assert not factors.common and factors.points == 8
    assert factors.compute == pytest.approx(compute_factor, rel=compute_rel)
    assert factors.comm == pytest.approx(comm_factor, rel=comm_rel)


def test_one_straggler_does_not_pull_the_fit():
    points = synthetic(1.5, 0.8, n=9, noise=0.01)
    p = points[0]
    points[0] = StepPoint(p.compute_s, p.comm_s, p.measured_s * 5)  # a trial on a sick node
    factors = fit_step_factors(points)
    assert factors.compute == pytest.approx(1.5, rel=0.016)  # off by 0.79%, as without the straggler
    assert factors.comm == pytest.approx(0.8, rel=0.015)  # off by 0.73%


def test_few_trials_fit_one_common_factor_and_none_leave_the_model_alone():
    two = synthetic(2.0, 2.0, n=2, noise=0.0)
    factors = fit_step_factors(two)
    # noise-free: only the search's resolution is left (3.3e-8 off)
    assert factors.common and factors.compute == factors.comm == pytest.approx(2.0, rel=1e-6)
    assert fit_step_factors([]).predict(3.0, 1.0) == 4.0


def test_factors_stay_within_bounds():
    absurd = [StepPoint(1.0, 0.1, 100.0), StepPoint(2.0, 0.2, 200.0)]
    factors = fit_step_factors(absurd)
    assert factors.compute == pytest.approx(BOUNDS[1])


def test_a_measured_regime_predicts_its_other_candidates_relative_to_its_trials():
    # (2, 1) runs 3x slower than (1, 1) for the same predicted work: the factors cannot explain both,
    # each regime's residual places its candidates by its own measurement
    factors = fit_step_factors([StepPoint(1.0, 0.0, 2.0, (1, 1)), StepPoint(1.0, 0.0, 6.0, (2, 1))])
    assert factors.predict(2.0, 0.0, (2, 1)) == pytest.approx(12.0)  # twice the work of the 6 s trial
    assert factors.predict(0.5, 0.0, (1, 1)) == pytest.approx(1.0)  # half the work of the 2 s trial
    assert 2.0 <= factors.predict(1.0, 0.0, (4, 1)) <= 6.0  # an unmeasured regime: the factors alone
    assert factors.predict(1.0, 0.0) == factors.predict(1.0, 0.0, (4, 1))


def test_memory_offset_is_the_median_gap():
    assert fit_memory_offset([10.0, 20.0, 30.0], [11.0, 23.0, 30.5]) == pytest.approx(1.0)
    assert fit_memory_offset([], []) is None
