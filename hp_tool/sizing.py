"""Model size from a compute budget, and days to train a size (NeMo auto-configurator).

Training compute is taken as 8·N·T FLOPs: 6 for forward and backward, 2 for full activation recompute
(Narayanan et al. 2021).
"""

from __future__ import annotations

from hp_tool.families import family

SECONDS_PER_DAY = 86400


def _family_factors(family_name: str) -> tuple[float, float]:
    """(p, q): the family's size-for-budget and time-per-parameter factors (mT5 gets a smaller model for the
    budget and takes longer per parameter)."""
    return family(family_name).sizing.size_factors


def recommend_model_size_b(family: str, days: float, gpus: int, tflops_per_gpu: float,
                           tokens_b: float) -> float:
    """Largest model (billions of parameters) that trains on ``tokens_b`` billion tokens in ``days``."""
    p, _ = _family_factors(family)
    flops = days * SECONDS_PER_DAY * gpus * tflops_per_gpu * 1e12
    return round(p * flops / (8 * tokens_b * 1e9) / 1e9, 2)


def days_to_train(family: str, size_b: float, gpus: int, tflops_per_gpu: float, tokens_b: float,
                  ndigits: int | None = 2) -> float:
    """Days to train ``size_b`` billion parameters on ``tokens_b`` billion tokens at ``tflops_per_gpu``."""
    _, q = _family_factors(family)
    seconds = q * size_b * 1e9 * 8 * tokens_b * 1e9 / (gpus * tflops_per_gpu * 1e12)
    days = seconds / SECONDS_PER_DAY
    return days if ndigits is None else round(days, ndigits)


def run_days(steps: int, step_time_s: float) -> float:
    """Days a run of ``steps`` optimizer steps takes at ``step_time_s`` per step: the one rule behind every
    layout's days to train (the plan's rows and headline, the collector's measured rows)."""
    return steps * step_time_s / SECONDS_PER_DAY


def format_days(days: float) -> str:
    """'33.9 days', '5.2 hours', '42 minutes': three significant digits in the unit that reads best."""
    for unit, per_day in (("days", 1), ("hours", 24), ("minutes", 1440)):
        if days * per_day >= 1 or unit == "minutes":
            return f"{float(f'{days * per_day:.3g}'):g} {unit}"
    raise AssertionError("unreachable")


def size_label(num_parameters: float) -> str:
    """Short readable size for file names: 5b, 12.9b, 126m, 240k (three significant digits)."""
    for scale, unit in ((1e9, "b"), (1e6, "m"), (1e3, "k")):
        if num_parameters >= scale:
            return f"{float(f'{num_parameters / scale:.3g}'):g}{unit}"
    return f"{int(num_parameters)}"
