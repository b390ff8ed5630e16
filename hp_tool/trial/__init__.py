"""The trial engine: one real, time-boxed training run of a candidate layout.

    train.py     entry points: ``python -m hp_tool.trial.train SPEC.yaml``, ``run_trial(path)``; the loop
    engine.py    one rank's model stage, optimizer, schedule and data; one optimizer step
    models.py    transformers model on meta, cut into this rank's pipeline stage
    parallel.py  TP (parallelize_module), activation checkpointing, FSDP2 / replicate, pipeline schedule
    weights.py   layout-independent deterministic initialisation of the local shards
    optim.py     AdamW groups per mesh, learning-rate schedule, mesh-aware gradient clipping
    data.py      synthetic or memory-mapped tokens, the same global batch for every layout
    measure.py   timing, memory, stop rule, signals, metrics.jsonl

The contracts it reads and writes (TrialSpec, result.json, metrics.jsonl, the DeepSpeed config) live in
``hp_tool/contracts/``, below every reader. Importing this package does not import torch; only the engine
modules do.
"""
