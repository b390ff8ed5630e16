"""The DeepSpeed config of a TrialSpec: one builder for the DeepSpeed trial engine and for the
``ds_config_<size>_<N>nodes.json`` written beside a DeepSpeed winner. Pure, no deepspeed import.

The written file is a plain DeepSpeed config (numbers, no "auto"), which ``deepspeed.initialize`` and the
transformers Trainer (``TrainingArguments(deepspeed=...)`` with matching batch sizes) accept as is: batch
sizes, gradient accumulation, clipping, precision (fp16 with dynamic loss scaling), the ZeRO stage with its
offload, AutoTP, AdamW and a warm-up + cosine schedule. hp_tool's own engine passes its optimizer in
(``with_optimizer=False``) so the learning rate follows the TrialSpec's schedule step by step, including its
constant phase, which DeepSpeed's WarmupCosineLR lacks.
"""

from __future__ import annotations

from typing import Any

from hp_tool.contracts.spec import TrialSpec


def ds_config(spec: TrialSpec, with_optimizer: bool = True, pin_memory: bool = True) -> dict[str, Any]:
    """DeepSpeed's config dict for ``spec`` (its parallel.engine need not be deepspeed)."""
    p, t = spec.parallel, spec.training
    data_parallel = spec.resources.num_nodes * spec.resources.gpus_per_node // (p.tp * p.pp)
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if p.offload == "optimizer_and_params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": p.mbs,
        "gradient_accumulation_steps": t.global_batch_size // (p.mbs * data_parallel),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        # loss_scale 0: DeepSpeed's dynamic loss scaling, which fp16 needs for its narrow range
        "fp16": {"enabled": True, "loss_scale": 0} if t.precision == "fp16" else {"enabled": False},
        "steps_per_print": max(1, t.max_steps // 100),
        "wall_clock_breakdown": False,
    }
    if p.tp > 1:
        config["tensor_parallel"] = {"autotp_size": p.tp}
    if t.optimizer != "adamw":  # SGD and 8-bit AdamW are client optimizers DeepSpeed's ZeRO has not vetted
        config["zero_allow_untested_optimizer"] = True
    if with_optimizer and t.optimizer == "adamw":  # others: the client's (transformers' `optim`) optimizer
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": t.lr, "betas": list(t.betas), "eps": 1e-8, "weight_decay": t.weight_decay}}
    if with_optimizer:
        config["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": t.max_steps, "warmup_num_steps": t.warmup_steps,
            "warmup_min_ratio": 0.0, "cos_min_ratio": t.min_lr / t.lr if t.lr else 0.0}}
    return config
