"""What the pre-launch trace cannot model, decided from the spec alone (no torch imported, so the planner's
process can ask before it starts a tracing worker; :mod:`hp_tool.memory_check` keeps the analytic figure
with this reason).

The DeepSpeed engine is not the engine the trace rebuilds; offloaded states live in host RAM, which a trace
cannot tell from GPU memory; QLoRA's 4-bit weights (bitsandbytes) do not run under fake tensors. The
long-context savers trace: the chunked loss and sequence parallelism run as the engine runs them, and
activation offload's host copies are kept off the traced device (:mod:`hp_tool.trial.activation_offload`).

Expert parallelism: each rank's experts run on the tokens the EP group's routers send them, so a rank's
activations depend on the routing, i.e. on the values; the all-to-all dispatch even reads its split sizes
back to the host (``transformers.distributed.expert_parallel.AllToAllEP``), which a fake tensor has no value
for. A mixture of experts at EP 1 traces: one rank runs all its tokens' ``top_k`` expert rows whatever the
routing, and the grouped matmul's shapes follow the token count.
"""

from __future__ import annotations

from typing import Optional

from hp_tool.contracts.spec import TrialSpec
from hp_tool.engine_facts import engine_facts


class Untraceable(ValueError):
    """The trace was asked for a spec it cannot model; the message says why."""


def untraceable_reason(spec: TrialSpec) -> Optional[str]:
    """Why the trace cannot model ``spec``'s memory, or None."""
    if not engine_facts(spec.parallel.engine).traceable:
        return f"the {spec.parallel.engine} engine is not traced"
    if spec.parallel.offload != "none":
        return "offloaded states live in host RAM, which a trace cannot tell from GPU memory"
    if spec.model.method == "qlora":
        return "qlora's 4-bit weights (bitsandbytes) do not run under fake tensors"
    if spec.parallel.ep > 1:
        return (f"expert parallelism (EP={spec.parallel.ep}) sends each rank the tokens the routers pick, a "
                "count fake tensors do not have")
    return None


def require_traceable(spec: TrialSpec) -> None:
    """Raise ``Untraceable`` with the reason when the trace cannot model ``spec``."""
    reason = untraceable_reason(spec)
    if reason is not None:
        raise Untraceable(reason)
