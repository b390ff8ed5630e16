"""Per-search calibration of the analytic model from the trials it has measured. Pure arithmetic, no I/O.

The step-time model splits a candidate's predicted step into a compute part (matmuls, recompute and the
pipeline bubble) and a communication part (TP, PP and DP traffic and offload's PCIe and CPU step). On a
given cluster both can be off by a constant factor: the GPUs' reachable efficiency, the network's real
bandwidth. ``fit_step_factors`` finds the two factors that best explain the measured step times,

    measured ≈ compute_factor · predicted_compute + comm_factor · predicted_comm,

robustly (least absolute log error, so one straggler does not pull the fit) and bounded to
[1/10, 10] (beyond, a trial says more about a fault than about the cluster; the CPU preset's rough peak
sits near the top). A fit that had to stop at a bound (``StepFactors.clamped``) does not explain its trials:
the adaptive search skips nothing on it, and the report says so. With fewer
than three trials, or when the trials' communication parts barely differ from their compute parts in
proportion, the two cannot be told apart and one common factor is fitted.

What the two factors leave unexplained differs most between layout regimes (TP and PP: which collectives run,
how the pipeline fills; the method, the engine, offload, compile, fp8: what trains and which kernels run;
hp_tool/dimensions.py ``Dimension.regime``), and least between the candidates of one regime, which differ in
micro-batch, checkpointing and sequence length. So each regime with measured trials also gets its residual, the
median of measured over the factors' prediction (bounded the same way), applied to its other candidates: they
are predicted relative to their measured neighbours. A regime no trial measured shares with the measured ones
only what it has in common with them: each of its dimensions' values (TP 2, LoRA, the DeepSpeed engine) gets
the residual the trials with that value leave (``value_ratios``: log residuals as a sum over the values, fitted
by medians), and a regime every value of which some trial has run is predicted by their product; one with a
value no trial has run is not calibrated at all (``StepFactors.covers`` is false, and ``predict`` gives the
factors' prediction alone, which the adaptive search does not skip on).
``fit_memory_offset`` is the median of measured minus predicted peak memory: the overhead the preset's
constant misses.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

BOUNDS = (0.1, 10.0)  # the factors' range
MIN_POINTS_FOR_TWO = 3  # trials needed to fit compute and communication apart
MIN_COMM_SPREAD = 0.05  # the communication share must vary by this much across trials to be told apart


Regime = tuple  # a layout regime: (TP, PP, (dimension, value), ...), dimensions.regime_of


@dataclass(frozen=True)
class StepPoint:
    """One measured trial: its predicted compute and communication seconds, its measured step, and its
    layout regime (None: no residual)."""

    compute_s: float
    comm_s: float
    measured_s: float
    regime: Optional[Regime] = None


@dataclass(frozen=True)
class StepFactors:
    compute: float = 1.0
    comm: float = 1.0
    points: int = 0  # trials the fit used; 0: no calibration (factors 1)
    common: bool = True  # one factor fitted for both parts
    residuals: dict = field(default_factory=dict)  # regime -> measured / factors' prediction, median
    clamped: bool = False  # a factor or residual stopped at BOUNDS: the fit does not explain its trials
    values: dict = field(default_factory=dict)  # a regime's value ((name, value)) -> its log residual

    def covers(self, regime: Optional[Regime]) -> bool:
        """Whether ``regime`` is calibrated: measured itself, or every value of it run by some trial."""
        return regime is not None and (regime in self.residuals or all(v in self.values for v in values_of(regime)))

    def ratio(self, regime: Optional[Regime]) -> float:
        """The regime's residual: its own where measured, else the product of its values' (bounded), else 1."""
        if regime in self.residuals:
            return self.residuals[regime]
        if regime is not None and self.covers(regime):
            return _bounded(math.exp(sum(self.values[v] for v in values_of(regime))))
        return 1.0

    def predict(self, compute_s: float, comm_s: float, regime: Optional[Regime] = None) -> float:
        return (self.compute * compute_s + self.comm * comm_s) * self.ratio(regime)

    def shared_ratio(self, regime: Regime, reference: Regime) -> float:
        """How much slower ``regime`` runs than ``reference`` (a measured regime) by what trials know of its values:
        for each dimension whose value in ``regime`` some trial ran, its factor over ``reference``'s value's (a
        difference of one dimension's values, which no constant split among the dimensions moves); 1 for a
        dimension whose value no trial ran, where nothing is known of it (not ``reference``'s own factor)."""
        logs = [self.values[v] - self.values.get(r, 0.0) for v, r in zip(values_of(regime), values_of(reference))
                if v in self.values and v != r]
        return math.exp(sum(logs))


def values_of(regime: Regime) -> list[tuple]:
    """A regime's values by dimension: [("tp", 2), ("pp", 1), ("method", "lora"), ...]."""
    return [("tp", regime[0]), ("pp", regime[1]), *regime[2:]]


def value_ratios(regimes: Sequence[Regime], log_residuals: Sequence[float], rounds: int = 20) -> dict:
    """{value: w} with each trial's log residual about the sum of its regime's values' w (``values_of``), fitted by
    backfitting medians: each value's w in turn the median, over the trials with it, of their log residual less
    the other values' w. A regime's product exp(sum w) does not depend on how a constant splits among the
    dimensions (every regime has one value of each)."""
    trials = [(values_of(r), x) for r, x in zip(regimes, log_residuals)]
    w = {v: 0.0 for values, _ in trials for v in values}
    for _ in range(rounds):
        for v in w:
            w[v] = statistics.median(x - sum(w[u] for u in values if u != v) for values, x in trials if v in values)
    return w


def _loss(points: Sequence[StepPoint], a: float, b: float) -> float:
    return sum(abs(math.log((a * p.compute_s + b * p.comm_s) / p.measured_s)) for p in points)


def _search(loss, dims: int) -> tuple[float, ...]:
    """Minimise ``loss`` over ``dims`` factors in BOUNDS: a log-spaced grid, refined around the best point."""
    lo, hi = (math.log(x) for x in BOUNDS)
    centre, half = [(lo + hi) / 2] * dims, (hi - lo) / 2
    best = tuple(math.exp(c) for c in centre)
    for _ in range(12):
        steps = [-1 + 2 * i / 16 for i in range(17)]
        grid = [[min(hi, max(lo, c + s * half)) for s in steps] for c in centre]
        candidates = [(x,) for x in grid[0]] if dims == 1 else [(x, y) for x in grid[0] for y in grid[1]]
        logs = min(candidates, key=lambda xs: loss(*(math.exp(v) for v in xs)))
        centre, half = list(logs), half / 4
        best = tuple(math.exp(v) for v in logs)
    return best


def fit_step_factors(points: Sequence[StepPoint]) -> StepFactors:
    """The factors that best explain ``points`` (see the module docstring); factors 1 without points."""
    points = [p for p in points if p.measured_s > 0 and p.compute_s + p.comm_s > 0]
    if not points:
        return StepFactors()
    shares = [p.comm_s / (p.compute_s + p.comm_s) for p in points]
    if len(points) >= MIN_POINTS_FOR_TWO and max(shares) - min(shares) >= MIN_COMM_SPREAD:
        a, b = _search(lambda a, b: _loss(points, a, b), 2)
        common = False
    else:
        (a,) = _search(lambda a: _loss(points, a, a), 1)
        b, common = a, True
    ratios: dict = {}
    for p in points:
        if p.regime is not None:
            ratios.setdefault(p.regime, []).append(p.measured_s / (a * p.compute_s + b * p.comm_s))
    raw = {r: statistics.median(v) for r, v in ratios.items()}
    residuals = {r: _bounded(v) for r, v in raw.items()}
    clamped = any(_at_bound(x) for x in (a, b)) or any(residuals[r] != v for r, v in raw.items())
    placed = [p for p in points if p.regime is not None]
    values = value_ratios([p.regime for p in placed],
                          [math.log(p.measured_s / (a * p.compute_s + b * p.comm_s)) for p in placed])
    return StepFactors(a, b, len(points), common, residuals, clamped, values)


def _bounded(x: float) -> float:
    return min(BOUNDS[1], max(BOUNDS[0], x))


def _at_bound(x: float) -> bool:
    """Whether a fitted factor stopped at a bound (the search's grid reaches it only by clamping)."""
    return any(math.isclose(x, bound, rel_tol=1e-6) for bound in BOUNDS)


def fit_memory_offset(predicted_gib: Sequence[float], measured_gib: Sequence[float]) -> Optional[float]:
    """GB to add to every predicted peak: the median of measured minus predicted; None without trials."""
    gaps = [m - p for p, m in zip(predicted_gib, measured_gib) if p is not None and m is not None]
    return statistics.median(gaps) if gaps else None
