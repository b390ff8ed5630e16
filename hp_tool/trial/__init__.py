"""The trial engine: one real, time-boxed training run of a candidate layout.

    train.py       entry points: ``python -m hp_tool.trial.train SPEC.yaml``, ``run_trial(path)``; the loop
    engines/       the ``Engine`` protocol and its implementations, keyed by ``parallel.engine``:
                   ``TorchEngine`` (torch_engine.py) and ``DeepSpeedEngine`` (ds_engine.py); one step each
    rank.py        one rank's model and optimizer, built one way for the torch engine and the tracer:
                   stage on meta, TP, checkpointing, DP per chunk, then a materialiser (real or fake)
    families/      one file per model family registering its ``TorchFamily`` record (config, model class,
                   stage cut, TP / sequence-parallel plans, CP's attention module, stage hooks, head counts,
                   the tracer's inputs): the only place naming a family's modules; ``torch_family(name)``
    models.py      the spec's family's transformers model on meta, cut into this rank's stage(s); the loss
    converters.py  training transforms applied at one point of the build (LoRA, QLoRA's 4-bit base)
    stage.py       ``StageModule`` (what every stage shares), ``InterleavedStages``, parameter names
    causal.py      a decoder-only causal LM stage (GPT-3/OPT, Llama) and the family hooks of its forward
    encdec.py      an encoder-decoder stage (T5, mT5): both stacks, position tables carried between stages
    parallel.py    TP (parallelize_module), EP (transformers' expert parallelism), activation checkpointing,
                   FSDP2 / replicate, pipeline schedule
    weights.py     layout-independent deterministic initialisation of the local shards
    optim.py       AdamW groups per mesh, learning-rate schedule, mesh-aware gradient clipping, ZeRO-1
    data.py        synthetic or memory-mapped tokens, the same global batch for every layout
    dist.py        process environment, device, process group and the (pp, dp, tp) mesh ((pp, edp, ep, tp)
                   with expert parallelism)
    measure.py     timing, memory, stop rule, signals, metrics.jsonl
    trace/         peak tensor memory: measured (``TensorPeak``) and traced before launch under fake tensors
    memterms.py    the analytic memory model's per-layer terms beside the traced ones
    ds_ops.py      builds DeepSpeed's C++ ops ahead of the trials (``python -m hp_tool.trial.ds_ops``)

The contracts it reads and writes (TrialSpec, result.json, metrics.jsonl, the DeepSpeed config) live in
``hp_tool/contracts/``, below every reader. Importing this package does not import torch; only the engine
modules do.
"""

import logging as _logging

# bitsandbytes' CPU backend logs, when it is imported (by QLoRA's build and by peft on every adapter run), that an
# optional hub package of faster CPU kernels is missing; its own CPU kernels run instead, so the line says
# nothing a trial's reader can act on. Only that line is dropped; bitsandbytes' other messages stay.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "kernels-community" not in record.getMessage())
