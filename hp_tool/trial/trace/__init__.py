"""Peak tensor memory of one rank: measured in a real trial, or traced before launch under fake tensors.

    peak.py         ``TensorPeak``: bytes of live tensor storages (the trial's first untimed steps and the trace)
    inflight.py     ``StageTrace`` (a traced rank, phase by phase), micro-batches in flight, interleaved
                    ranks traced as one stage plus their held hidden states
    replay.py       ``trace_stage``: the engine's own rank build under fake tensors on a fake process group,
                    its optimizer steps replayed phase by phase in the schedule's order
    extrapolate.py  ``extrapolated_stages`` from 1-2 units and 1-2 micro-batches in flight,
                    ``traced_peak_bytes`` (the busiest rank, what ``hp_tool.memory_check`` asks for)
    limits.py       ``untraceable_reason``: what the trace cannot model (expert parallelism), without torch
"""
