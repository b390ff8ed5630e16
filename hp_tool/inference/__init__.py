"""The inference search: which TP x PP x batch layouts serve the chosen model within a latency bound,
with the highest throughput per GPU, measured on the cluster.

    grid.py     the grid, validity filter and memory check; the per-config job YAML (no torch)
    worker.py   one job: the trial engine's model, greedy generation with a KV cache, timings
    report.py   result.json fields, latency statistics, final_output.csv, the latency-throughput plot
    search.py   ``run_inference_search``: plan (plan.csv), launch through the one launcher, collect, rank

Importing this package does not import torch; only the worker does.
"""
