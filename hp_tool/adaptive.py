"""The adaptive search's decisions, pure: which candidates to launch next, and which to give up on.

Given every selected candidate (``Option``: its layout regime, the predicted compute and communication
seconds of its full-run step, its predicted memory) and the trials that have ended (``Outcome``):

- ``launch_order``: the most promising first, spread over the grid's main axes: round-robin over the
  (TP, PP) regimes, each regime's candidates fastest-predicted first, the regimes in the order of their
  best prediction; so the first wave measures every regime the calibration has to learn.
- ``verdicts``: for every candidate not yet launched, a reason not to launch it, or none:
  * ``pruned_after_oom``: a trial of the same TP and PP ran out of memory, and this candidate is
    predicted to need at least as much;
  * ``skipped``: its calibrated prediction (:mod:`hp_tool.calibration`, refitted on every ended trial)
    is slower than the best measured trial by more than ``skip_margin``; except the best-predicted
    candidate of a (TP, PP) regime no trial has measured yet, which is launched to calibrate on it.
- ``losing``: a running trial whose median step after warm-up (``LOSING_MIN_STEPS`` timed steps at
  least), extrapolated to the full run, is slower than the best measured trial by more than
  ``skip_margin`` is stopped early (stop reason ``losing``, status ok, its measurement kept).
  Each reason carries the numbers the decision used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hp_tool.calibration import StepPoint, fit_step_factors
from hp_tool.vocab import LOSING, PRUNED_AFTER_OOM, SKIPPED

OK = "ok"
LOSING_MIN_STEPS = 5  # timed steps a running trial needs before it is judged (the trial's stable_window)


@dataclass(frozen=True)
class Option:
    name: str
    tp: int
    pp: int
    compute_s: float  # predicted full-run step, compute part
    comm_s: float  # predicted full-run step, communication part
    memory_gib: float  # predicted peak per GPU of the trial

    @property
    def predicted_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str
    step_s: Optional[float] = None  # measured full-run step time, for status ok


def launch_order(options: Sequence[Option]) -> list[str]:
    """Names, most promising first, round-robin over (TP, PP) regimes (see the module docstring)."""
    regimes: dict[tuple[int, int], list[Option]] = {}
    for o in sorted(options, key=lambda o: (o.predicted_s, o.name)):
        regimes.setdefault((o.tp, o.pp), []).append(o)
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
                                          (by_name[r.name].tp, by_name[r.name].pp)) for r in ok])
    best = min(ok, key=lambda r: r.step_s) if ok else None
    ooms = [by_name[r.name] for r in outcomes if r.status == "oom" and r.name in by_name]
    measured_regimes = {(by_name[r.name].tp, by_name[r.name].pp) for r in outcomes if r.name in by_name}
    scouts = {}  # each unmeasured regime's best-predicted candidate
    for o in sorted(options, key=lambda o: (o.predicted_s, o.name)):
        if (o.tp, o.pp) not in measured_regimes:
            scouts.setdefault((o.tp, o.pp), o.name)
    out: dict[str, tuple[str, str]] = {}
    for o in options:
        if o.name in ended:
            continue
        oom = next((x for x in ooms if (x.tp, x.pp) == (o.tp, o.pp) and o.memory_gib >= x.memory_gib), None)
        if oom is not None:
            out[o.name] = (PRUNED_AFTER_OOM,
                           f"{oom.name} (same TP {o.tp}, PP {o.pp}) ran out of memory at a predicted "
                           f"{oom.memory_gib:.2f} GiB per GPU; this one is predicted to need {o.memory_gib:.2f} GiB")
            continue
        if best is None or scouts.get((o.tp, o.pp)) == o.name:
            continue
        calibrated = factors.predict(o.compute_s, o.comm_s, (o.tp, o.pp))
        if calibrated > best.step_s * (1 + skip_margin):
            out[o.name] = (SKIPPED,
                           f"calibrated prediction {calibrated:.4g} s per step (raw {o.predicted_s:.4g} s) is "
                           f"more than skip_margin={skip_margin:g} slower than the best measured, {best.name} "
                           f"at {best.step_s:.4g} s (calibrated on {factors.points} trials)")
    return out


def losing(name: str, measured_s: float, timed_steps: int, full_run_s: Optional[float],
           outcomes: Sequence[Outcome], skip_margin: float) -> Optional[tuple[str, str]]:
    """(LOSING, reason) when the running trial ``name``, ``measured_s`` per step over ``timed_steps``
    timed steps so far (``full_run_s`` extrapolated to the full run), is more than ``skip_margin`` slower
    than the best measured of ``outcomes``; else None."""
    ok = [r for r in outcomes if r.status == OK and r.step_s and r.name != name]
    if timed_steps < LOSING_MIN_STEPS or full_run_s is None or not ok:
        return None
    best = min(ok, key=lambda r: r.step_s)
    if full_run_s <= best.step_s * (1 + skip_margin):
        return None
    return (LOSING, f"stopped early: its median step after warm-up, {measured_s:.4g} s over {timed_steps} timed "
                    f"steps ({full_run_s:.4g} s for the full run), is more than skip_margin={skip_margin:g} "
                    f"slower than the best measured, {best.name} at {best.step_s:.4g} s")
