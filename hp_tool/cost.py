"""Money for a training run: one formula for the planner's predictions, the collector and comparisons.

    full_run_cost_usd            = price per GPU-hour x GPUs x days_to_train x 24
    cost_usd_per_million_tokens  = (price per GPU-hour x GPUs) / (tokens per hour / 1e6)
"""

from __future__ import annotations


def cost_columns(gpu_hour_price: float, num_gpus: int, tokens_per_s: float, days: float) -> dict:
    """Dollars for the full run (``full_run_cost_usd``) and per million tokens
    (``cost_usd_per_million_tokens``); ``tokens_per_s`` is the whole run's throughput."""
    dollars_per_hour = gpu_hour_price * num_gpus
    return {"full_run_cost_usd": dollars_per_hour * days * 24,
            "cost_usd_per_million_tokens": dollars_per_hour / (tokens_per_s * 3600 / 1e6)}
