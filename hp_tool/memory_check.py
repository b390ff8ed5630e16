"""The memory check before launch: trace each candidate's per-rank peak under fake tensors, in parallel.

``memory_check=traced`` (the default when trials launch) traces every candidate the planner would launch
with ``hp_tool.trial.trace.extrapolate.traced_peak_bytes`` (the engine's own rank-build code on a fake
process group, no real memory) in worker processes over the machine's cores; the planner
prunes on the traced figure plus the gpu preset's ``memory_overhead_gib``. ``analytic`` (the default of a
dry run) keeps the instant formula of hp_tool/estimate/memory.py and never imports torch.

A candidate the trace cannot run keeps the analytic figure, with the reason in its row: the DeepSpeed
engine (not traced), host offload of the states (a CPU trace cannot tell host-resident states from GPU
memory; activation offload is traced, its host copies kept apart: hp_tool/trial/activation_offload.py), or a
trace that failed (an operator without a fake implementation, say). Traces are cached by what decides
them (model, layout, batch, precision, device, torch version) in ``candidate_configs/memory_traces.json``,
so a resumed or repeated search traces nothing twice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hp_tool.trial.trace.limits import untraceable_reason
from hp_tool.fingerprint import fingerprint_of
from hp_tool.launch.backends import warm
from hp_tool.config import trial_device
from hp_tool.contracts.spec import TrialSpec
from hp_tool.estimate.layout import GIB
from hp_tool.vocab import TRACE_CACHE_FILE

log = logging.getLogger(__name__)

TRACE_VERSION = 8  # bump when the trace counts differently: cached traces of another version are redone


@dataclass(frozen=True)
class TraceOutcome:
    """A candidate's traced peak tensor memory per rank (GiB), or None and why the analytic figure stands."""

    tensor_gib: Optional[float]
    reason: str = ""
    seconds: float = 0.0


def trace_device(gpu_name: str) -> str:
    """The device the trace models (``config.trial_device``): a GPU preset is traced with its precision's autocast
    and FSDP2 parameter dtype."""
    return trial_device(gpu_name)


def trace_key(spec: TrialSpec, device_type: str, torch_version: str) -> str:
    d = spec.to_dict()
    return fingerprint_of({"model": d["model"], "parallel": d["parallel"],
                           "batch": spec.training.global_batch_size, "precision": spec.training.precision,
                           "device": device_type, "torch": torch_version, "version": TRACE_VERSION})


def _worker_init() -> None:
    """One core per worker; what every trace imports, imported once per worker, not per candidate."""
    import torch

    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mt5.modeling_mt5  # noqa: F401
    import transformers.models.opt.modeling_opt  # noqa: F401
    import transformers.models.t5.modeling_t5  # noqa: F401

    import hp_tool.trial.trace.extrapolate  # noqa: F401 - with it the engine's models, families and parallel

    torch.set_num_threads(1)
    logging.getLogger("torch").setLevel(logging.ERROR)


def trace_one(spec: TrialSpec, device_type: str) -> TraceOutcome:
    """Trace one candidate (in a worker process); a failure becomes the reason, never an exception."""
    import warnings

    from hp_tool.trial.trace.extrapolate import traced_peak_bytes

    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peak = traced_peak_bytes(spec, device_type)
    except Exception as exc:  # noqa: BLE001 - any failure falls back to the analytic figure, with its cause
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return TraceOutcome(None, f"the trace failed ({type(exc).__name__}: {first})",
                            time.monotonic() - start)
    return TraceOutcome(peak / GIB, "", time.monotonic() - start)


def trace_siblings(specs: list[TrialSpec], device_type: str) -> list[TraceOutcome]:
    """Trace candidates that differ only in their checkpointed layers, in one worker: none checkpointed,
    then all, then some, so each reuses the builds the ones before made (trace.replay._TRACES)."""
    from hp_tool.trial.trace.extrapolate import stage_units

    def order(spec: TrialSpec) -> tuple[bool, int]:
        units, per_unit, _ = stage_units(spec)
        k = spec.parallel.act_ckpt_layers
        return 0 < k < units * per_unit, k

    ranked = sorted(range(len(specs)), key=lambda i: order(specs[i]))
    out: list[Optional[TraceOutcome]] = [None] * len(specs)
    for i in ranked:
        out[i] = trace_one(specs[i], device_type)
    return out  # type: ignore[return-value]


def sibling_key(spec: TrialSpec) -> str:
    """What candidates that share traces have in common: everything but the checkpointed layers and how they are
    recomputed (the stages without checkpointed layers are the same builds)."""
    return dataclasses.replace(spec, parallel=spec.parallel.checkpointing(0)).fingerprint()


class Tracer:
    """Traces lists of candidate specs over ``workers`` processes, remembering each by its key.

    ``cache``: traces from an earlier run (``load``); ``text`` is what is known now, for the cache file."""

    def __init__(self, device_type: str, workers: Optional[int] = None, cache: Optional[dict] = None):
        import torch

        self.device_type = device_type
        self.workers = workers or max(1, len(os.sched_getaffinity(0)))
        self.torch_version = torch.__version__
        self.cache: dict[str, dict] = dict(cache or {})
        self.traced = 0  # candidates traced (not from the cache) by this tracer
        self.seconds: list[float] = []

    @classmethod
    def load(cls, device_type: str, folder: Path, workers: Optional[int] = None) -> "Tracer":
        path = Path(folder) / TRACE_CACHE_FILE
        cache = {}
        if path.is_file():
            try:
                cache = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                log.warning("Ignoring unreadable %s (%s); tracing again", path, exc)
        return cls(device_type, workers, cache)

    def text(self) -> str:
        return json.dumps(self.cache, indent=1, sort_keys=True) + "\n"

    def __call__(self, specs: list[TrialSpec]) -> list[TraceOutcome]:
        out: list[Optional[TraceOutcome]] = [None] * len(specs)
        todo: dict[str, list[int]] = {}
        for i, spec in enumerate(specs):
            why = untraceable_reason(spec)
            key = trace_key(spec, self.device_type, self.torch_version)
            if why:
                out[i] = TraceOutcome(None, why)
            elif key in self.cache:
                out[i] = TraceOutcome(**self.cache[key])
            else:
                todo.setdefault(key, []).append(i)
        if todo:
            done = self._trace({key: specs[where[0]] for key, where in todo.items()})
            for key, where in todo.items():
                for i in where:
                    out[i] = done[key]
        return out  # type: ignore[return-value]

    def _trace(self, jobs: dict[str, TrialSpec]) -> dict[str, TraceOutcome]:
        """Trace ``jobs`` (key: spec) in worker processes, candidates that differ only in checkpointing
        together (``trace_siblings``); a worker that died is not remembered."""
        groups: dict[str, list[str]] = {}
        for key, spec in jobs.items():
            groups.setdefault(sibling_key(spec), []).append(key)
        workers = min(self.workers, len(groups))
        log.info("Tracing the memory of %d candidates on %d processes", len(jobs), workers)
        context = warm.context()  # forks of a fresh interpreter that has imported the engine: no state of ours
        done: dict[str, TraceOutcome] = {}
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) as pool:
            futures = {pool.submit(trace_siblings, [jobs[k] for k in keys], self.device_type): keys
                       for keys in groups.values()}
            for future in concurrent.futures.as_completed(futures):
                keys = futures[future]
                try:
                    outcomes = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker that died (killed, out of memory)
                    for key in keys:
                        done[key] = TraceOutcome(None, f"the trace process failed ({type(exc).__name__}: {exc})")
                    continue
                for key, outcome in zip(keys, outcomes):
                    done[key] = outcome
                    self.cache[key] = {"tensor_gib": outcome.tensor_gib, "reason": outcome.reason,
                                       "seconds": round(outcome.seconds, 3)}
                    self.traced += 1
                    self.seconds.append(outcome.seconds)
        return done
