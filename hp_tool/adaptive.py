"""The adaptive search's decisions, pure: which candidates to launch next, and which to give up on.

Given every selected candidate (``Option``: its layout regime, the predicted compute and communication
seconds of its full-run step, its predicted memory) and the trials that have ended (``Outcome``):

A regime is what changes how fast the engine runs a layout relative to the model: TP and PP (which
collectives run, how the pipeline fills) and the recipe's regime dimensions (hp_tool/dimensions.py
``Dimension.regime``: the method, the engine, offload, compile, fp8). Within a regime the model's own terms
carry the micro-batch, checkpointing and sequence length; across regimes one run's factor says little about
another's (a LoRA trial may run 7x its prediction where full fine-tuning runs 2x).

- ``launch_order``: the most promising first, spread over the regimes: round-robin over them, each regime's
  candidates fastest-predicted first, the regimes in the order of their best prediction; so the first wave
  measures every regime the calibration has to learn.
- ``verdicts``: for every candidate not yet launched, a reason not to launch it, or none:
  * ``pruned_after_oom``: a trial of the same regime ran out of memory, and this candidate is predicted to
    need at least as much;
  * ``skipped``, in a regime some trial has measured: its calibrated prediction (:mod:`hp_tool.calibration`,
    refitted on every ended trial, with its regime's own residual) is slower by more than ``skip_margin``
    than the best measured trial judged the same way: the larger of that trial's measured step and its own
    calibrated prediction (like for like: a calibration that over-predicts every layout over-predicts the
    best one too, and a lucky fast measurement does not lower the bar for the others). Nothing is skipped
    this way while the calibration is clamped at its bounds (it does not explain the trials then);
  * ``skipped``, in a regime no trial has measured: never on another regime's calibration. Where every value
    of its regime (TP 2, LoRA, the DeepSpeed engine, ...) has run in some trial, it is calibrated with what
    it shares with them, the product of its values' factors (:mod:`hp_tool.calibration` ``value_ratios``), and
    judged as above. Where some value has not run, its raw prediction is set against the best measured
    trial's raw prediction, each value it has run taken with its factor relative to the best's value of that
    dimension (``StepFactors.shared_ratio``: what the two have in common; the values it has not run count as the
    best's), and it is launched (its regime's best candidate first, by the launch order) unless more than
    ``SCOUT_RANGE`` (2x) behind it (or ``1 + skip_margin`` when larger): its own values' error would have to be
    more than that in its favour.
- ``losing``: a running trial is stopped early (stop reason ``losing``, status ok, its measurement kept)
  only when it is slower with confidence: after ``LOSING_MIN_STEPS`` timed steps, the lower end of its
  median's confidence interval (median - 1.57 x IQR / sqrt(n), the box plot's notch), extrapolated to the
  full run, is more than ``skip_margin`` slower than the best measured trial; a few noisy steps widen
  the interval and keep it running. A trial far behind is judged sooner: after ``LOSING_FAST_STEPS``
  timed steps, when even its fastest step, extrapolated, is more than ``FAR`` (2) times that bar (a gap
  no step-to-step noise explains; stalls only slow a step down).
  Each reason carries the numbers the decision used.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from hp_tool.calibration import StepPoint, fit_step_factors
from hp_tool.dimensions import regime_words
from hp_tool.vocab import LOSING, PRUNED_AFTER_OOM, SKIPPED
from hp_tool.words import plural

OK = "ok"
LOSING_MIN_STEPS = 5  # timed steps a running trial needs before it is judged (the trial's stable_window)
NOTCH = 1.57  # the box plot's notch: median +- 1.57 IQR / sqrt(n) is about a 95% interval of the median
LOSING_FAST_STEPS = 3  # timed steps after which a trial FAR behind the bar on every one of them is stopped
FAR = 2.0  # how far behind the losing bar (best x (1 + skip_margin)) every timed step must be to stop it sooner
SCOUT_RANGE = 2.0  # an unmeasured regime's best candidate is scouted when calibrated within this x the best


@dataclass(frozen=True)
class Option:
    name: str
    tp: int
    pp: int
    compute_s: float  # predicted full-run step, compute part
    comm_s: float  # predicted full-run step, communication part
    memory_gib: float  # predicted peak per GPU of the trial
    recipe: tuple = ()  # its regime beyond TP and PP: ((dimension, value), ...), dimensions.regime_recipe

    @property
    def predicted_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def regime(self) -> tuple:
        """What it is calibrated with: TP, PP and the recipe's regime dimensions (``dimensions.regime_of``'s
        key)."""
        return (self.tp, self.pp, *self.recipe)

    @property
    def regime_words(self) -> str:
        return regime_words(self.tp, self.pp, self.recipe)


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str
    step_s: Optional[float] = None  # measured full-run step time, for status ok


def launch_order(options: Sequence[Option]) -> list[str]:
    """Names, most promising first, round-robin over the regimes (see the module docstring)."""
    regimes: dict[tuple, list[Option]] = {}
    for o in sorted(options, key=lambda o: (o.predicted_s, o.name)):
        regimes.setdefault(o.regime, []).append(o)
    queues = list(regimes.values())  # in the order of each regime's best prediction
    order: list[str] = []
    while queues:
        for queue in queues:
            order.append(queue.pop(0).name)
        queues = [q for q in queues if q]
    return order


def verdicts(options: Sequence[Option], outcomes: Sequence[Outcome], skip_margin: float
             ) -> dict[str, tuple[str, str]]:
    """{name: (status, reason)} for the candidates without an outcome that should not be launched
    (outcomes: the trials that ended ok, with their full-run step time, or out of memory)."""
    by_name = {o.name: o for o in options}
    ended = {r.name for r in outcomes}
    ok = [r for r in outcomes if r.status == OK and r.step_s and r.name in by_name]
    factors = fit_step_factors([StepPoint(by_name[r.name].compute_s, by_name[r.name].comm_s, r.step_s,
                                          by_name[r.name].regime) for r in ok])
    best = min(ok, key=lambda r: r.step_s) if ok else None
    if best is not None:  # the best trial judged like the others: its calibrated prediction, or more
        b = by_name[best.name]
        best_calibrated = factors.predict(b.compute_s, b.comm_s, b.regime)
        bar = max(best.step_s, best_calibrated)
        bar_words = (f"measured {best.step_s:.4g} s" if bar == best.step_s else
                     f"its calibrated prediction; measured {best.step_s:.4g} s")
    ooms = [by_name[r.name] for r in outcomes if r.status == "oom" and r.name in by_name]
    measured_regimes = {by_name[r.name].regime for r in outcomes if r.name in by_name}
    out: dict[str, tuple[str, str]] = {}
    for o in options:
        if o.name in ended:
            continue
        oom = next((x for x in ooms if x.regime == o.regime and o.memory_gib >= x.memory_gib), None)
        if oom is not None:
            out[o.name] = (PRUNED_AFTER_OOM,
                           f"{oom.name} (same regime: {o.regime_words}) ran out of memory at a predicted "
                           f"{oom.memory_gib:.2f} GiB per GPU; this one is predicted to need {o.memory_gib:.2f} GiB")
            continue
        if best is None:
            continue
        if not factors.covers(o.regime):  # never judged on another regime's calibration
            scout_range = max(SCOUT_RANGE, 1 + skip_margin)
            behind = o.predicted_s / b.predicted_s * factors.shared_ratio(o.regime, b.regime)
            if behind > scout_range:
                out[o.name] = (SKIPPED,
                               f"no trial of its regime ({o.regime_words}), nor of each of its values, yet, and its "
                               f"raw prediction {o.predicted_s:.4g} s per step is {behind:.2f}x the raw prediction of "
                               f"the best (with the factors of the values it shares with trials, relative to the "
                               f"best's; none of another regime) "
                               f"measured, {best.name} ({b.predicted_s:.4g} s raw, {best.step_s:.4g} s measured; "
                               f"regime {b.regime_words}): its regime's own error would have to be more than "
                               f"{scout_range:g}x in its favour")
            continue
        if factors.clamped:
            continue
        calibrated = factors.predict(o.compute_s, o.comm_s, o.regime)
        if calibrated > bar * (1 + skip_margin):
            source = (f"its regime's factor from its own trials: {o.regime_words}" if o.regime in measured_regimes
                      else f"its regime, {o.regime_words}, not measured: the product of its values' factors, each "
                           f"from the trials that ran it")
            out[o.name] = (SKIPPED,
                           f"calibrated prediction {calibrated:.4g} s per step (raw {o.predicted_s:.4g} s; "
                           f"{source}) is more than "
                           f"skip_margin={skip_margin:g} slower than the best measured, {best.name} at {bar:.4g} s "
                           f"({bar_words}; calibrated on {plural(factors.points, 'trial')})")
    return out


def median_interval(step_s: Sequence[float]) -> tuple[float, float, float]:
    """(low, median, high) of timed step times: the median and its notch, median +- NOTCH x IQR / sqrt(n)."""
    xs = sorted(step_s)
    median = statistics.median(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    half = NOTCH * (q3 - q1) / math.sqrt(len(xs))
    return median - half, median, median + half


def losing(name: str, step_s: Sequence[float], full_run_s: Optional[float], outcomes: Sequence[Outcome],
           skip_margin: float) -> Optional[tuple[str, str]]:
    """(LOSING, reason) when the running trial ``name``, with timed step times ``step_s`` so far (its median
    extrapolated to the full run: ``full_run_s``), is slower with confidence than the best measured of
    ``outcomes`` by more than ``skip_margin``: the low end of its median's interval, extrapolated alike; or,
    after ``LOSING_FAST_STEPS``, its fastest step ``FAR`` times that bar; else None."""
    ok = [r for r in outcomes if r.status == OK and r.step_s and r.name != name]
    if len(step_s) < LOSING_FAST_STEPS or full_run_s is None or not ok:
        return None
    best = min(ok, key=lambda r: r.step_s)
    bar = best.step_s * (1 + skip_margin)
    low, median, _ = median_interval(step_s)
    fastest_full = full_run_s * min(step_s) / median
    if fastest_full > FAR * bar:
        return (LOSING, f"stopped early: every one of its {len(step_s)} timed steps after warm-up, the fastest "
                        f"{min(step_s):.4g} s ({fastest_full:.4g} s for the full run), is more than {FAR:g}x "
                        f"{bar:.4g} s: skip_margin={skip_margin:g} over the best measured, "
                        f"{best.name} at {best.step_s:.4g} s")
    if len(step_s) < LOSING_MIN_STEPS:
        return None
    low_full = full_run_s * max(0.0, low) / median
    if low_full <= bar:
        return None
    return (LOSING, f"stopped early: its median step after warm-up, {median:.4g} s over {len(step_s)} timed "
                    f"steps (at least {low_full:.4g} s for the full run, {full_run_s:.4g} s at the median), is "
                    f"more than skip_margin={skip_margin:g} slower than the best measured, {best.name} at "
                    f"{best.step_s:.4g} s")
