"""Money for a training run: one formula for the planner's predictions, the collector and comparisons.

    full_run_cost_usd            = price per GPU-hour x GPUs x days_to_train x 24
    cost_usd_per_million_tokens  = (price per GPU-hour x GPUs) / (tokens per hour / 1e6)
    hours_per_epoch              = tokens in one epoch of the data / tokens per hour   (fine-tuning)
    cost_usd_per_epoch           = price per GPU-hour x GPUs x hours_per_epoch
"""

from __future__ import annotations


def cost_columns(gpu_hour_price: float, num_gpus: int, tokens_per_s: float, days: float) -> dict:
    """Dollars for the full run (``full_run_cost_usd``) and per million tokens
    (``cost_usd_per_million_tokens``); ``tokens_per_s`` is the whole run's throughput."""
    dollars_per_hour = gpu_hour_price * num_gpus
    return {"full_run_cost_usd": dollars_per_hour * days * 24,
            "cost_usd_per_million_tokens": dollars_per_hour / (tokens_per_s * 3600 / 1e6)}


def epoch_columns(gpu_hour_price: float | None, num_gpus: int, tokens_per_s: float,
                  epoch_tokens: float | None) -> dict:
    """``tokens_per_hour`` of the whole run, and for a fine-tuning search (``epoch_tokens``: tokens in one
    pass over the data) ``hours_per_epoch`` and, with a price, ``cost_usd_per_epoch``; None where unknown."""
    per_hour = tokens_per_s * 3600
    hours = None if epoch_tokens is None else epoch_tokens / per_hour
    cost = None if hours is None or gpu_hour_price is None else gpu_hour_price * num_gpus * hours
    return {"tokens_per_hour": per_hour, "hours_per_epoch": hours, "cost_usd_per_epoch": cost}
