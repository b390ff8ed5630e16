"""Run one trial: train the spec's model on the spec's layout inside its time box and leave results.

    torchrun --nproc-per-node 4 -m hp_tool.trial.train SPEC.yaml [--output-dir DIR]
    srun python -m hp_tool.trial.train SPEC.yaml
    run_trial(spec_path, output_dir=None)   # from a submitit job, after
                                            # submitit.helpers.TorchDistributedEnvironment().export()

Rank 0 appends ``metrics.jsonl`` every step and writes ``result.json`` at the end (see result.py). Any
exception becomes status ``oom`` or ``failed``; in a multi-process run the failing rank records it and
leaves at once (``os._exit``), so the other ranks' collectives fail fast instead of hanging, and rank 0
writes the earliest failure as the trial's reason.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hp_tool.contracts import phases
from hp_tool.contracts import result as res
from hp_tool.estimate.layout import GIB
from hp_tool.contracts.spec import ModelSpec, TrialSpec, load_spec
from hp_tool.trial import dist as tdist
from hp_tool.trial import measure
from hp_tool.trial.checkpoint import save_checkpoint, save_dtype
from hp_tool.trial.engines import Engine, build_engine, engine_needs_process_group, train_step
from hp_tool.trial.optim import lr_at
from hp_tool.trial.trace.peak import TensorPeak

log = logging.getLogger(__name__)

def output_dir_for(spec: TrialSpec, output_dir: Optional[str]) -> Path:
    """``output_dir`` if given, else spec.run.output_dir, else ./training_logs/<trial_id>."""
    chosen = output_dir or spec.run.output_dir or str(Path("training_logs") / spec.trial_id)
    return Path(chosen)


def apply_memory_cap(spec: TrialSpec, device: torch.device) -> None:
    """On CPU, cap this process's address space at run.memory_cap_gib so over-allocation fails for real."""
    cap = spec.run.memory_cap_gib
    if cap is None or device.type != "cpu":
        return
    limit = int(cap * GIB)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    log.info("address space capped at %.2f GIB (run.memory_cap_gib)", limit / GIB)


def _reduce(values: list[float], op, device: torch.device) -> list[float]:
    """All-reduce a few floats over the world (identity for one process)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _stop_code(rule: measure.StopRule, steps: int, elapsed: float, last: float, timed: list,
               signalled: bool, requested: Optional[str], device: torch.device) -> Optional[str]:
    """Rank 0's stop decision, broadcast so that every rank leaves the loop after the same step."""
    reason = rule.reason(steps, elapsed, last, timed, signalled, requested)
    if not dist.is_initialized():
        return reason
    choices = (None,) + res.STOP_REASONS
    code = torch.tensor([choices.index(reason)], device=device)
    dist.broadcast(code, src=0)
    return choices[int(code.item())]


def run_loop(engine: Engine, out: Path, t_start: float, flag: measure.SignalFlag) -> dict:
    """Train until the stop rule fires; returns steps run, timed step times, losses and stop reason."""
    spec, device, rank0 = engine.spec, engine.device, engine.env.rank == 0
    rule = measure.StopRule(spec.run, measure.time_budget_s(spec.run), measure.effective_warmup(spec.run))
    par = spec.parallel
    share = 1.0 / (par.dp * par.cp * par.tp)  # last-stage ranks each add their share
    tokens = spec.training.global_batch_size * spec.model.seq_length
    writer = measure.MetricsWriter(out / res.METRICS_FILE, enabled=rank0)
    timed, losses, step, reason, request = [], [], 0, None, None
    tensor_peak = _TensorPeakSteps(engine, min(2, rule.warmup), spec.parallel.compile)
    try:
        while reason is None:
            begin = measure.now_s()
            with tensor_peak.around(step):
                loss = train_step(engine, step)
            measure.synchronize(device)
            local = float(loss) * share if loss is not None and engine.is_last_stage else 0.0
            loss_sum, signals = _reduce([local, float(flag.received is not None)], dist.ReduceOp.SUM,
                                        device)
            step_s = measure.now_s() - begin
            step += 1
            phases.mark("first_step" if step == 1 else "step", "step", step=step, step_time_s=round(step_s, 6))
            is_timed = step > rule.warmup
            if is_timed:
                timed.append(step_s)
            losses.append(loss_sum if dist.is_initialized() else float(loss))
            writer.write({"step": step, "step_time_s": step_s, "loss": losses[-1], "grad_norm": engine.grad_norm,
                          "lr": lr_at(step - 1, spec.training), "tokens": tokens,
                          "memory_gib": measure.peak_memory_gib(device)[0], "timed": is_timed,
                          "time": time.time()})
            request = res.read_stop_request(out) if rank0 else None
            reason = _stop_code(rule, step, measure.now_s() - t_start, step_s, timed, signals > 0,
                                request and request["stop_reason"], device)
    finally:
        writer.close()
    return {"steps_run": step, "timed": timed, "losses": losses, "stop_reason": reason,
            "tensor_peak_bytes": tensor_peak.peak,
            "request_reason": request.get("reason") if request and reason == request["stop_reason"] else None}


class _TensorPeakSteps:
    """Peak tensor bytes of this rank over the first untimed steps (none when no step is untimed). On a GPU
    the caching allocator's own count (its peak reset before the first step, read after each: free, so the
    first steps run at full speed); on CPU ``TensorPeak``, a dispatch mode over every op (the count the
    pre-launch trace makes, which this checks it against), only for an engine that ``measures_tensor_peak`` and
    a layout whose layers run eager: torch.compile does not trace under a Python dispatch mode, and a frame it
    skips once it runs eager for good, so a compiled CPU trial measures no tensor peak. A Python dispatch mode
    over a GPU step would turn milliseconds into minutes."""

    def __init__(self, engine: Engine, steps: int, compiled: bool = False):
        self.engine, self.peak, self.tracker = engine, None, None
        self.on_gpu = engine.device.type == "cuda"
        self.steps = steps if self.on_gpu or (engine.measures_tensor_peak and not compiled) else 0

    @contextlib.contextmanager
    def around(self, step: int):
        if self.on_gpu:  # the build's peak (loading, casting) is not the training step's: reset it
            if step == 0:
                torch.cuda.reset_peak_memory_stats(self.engine.device)
            yield
            if step < self.steps:
                self.peak = torch.cuda.max_memory_allocated(self.engine.device)
            return
        if step >= self.steps:
            yield
            return
        if self.tracker is None:
            self.tracker = TensorPeak(self.engine.device.type)
            self.tracker.track(self.engine.stage, self.engine.optimizer)
        with self.tracker:
            self.tracker.restart_peak()
            yield
        self.peak = max(self.peak or 0, self.tracker.peak_bytes())


def saved_message(model: ModelSpec, save_dir: str) -> str:
    """The one line saying what a run saved and what loads it: the whole model, or a LoRA / QLoRA run's adapters
    (peft's format, loaded over the base model)."""
    if model.method == "full":
        return f"saved the model to {save_dir}: AutoModelForCausalLM.from_pretrained({save_dir!r}) loads it"
    base = model.checkpoint or "<the base model>"
    return (f"saved the {model.method} adapters to {save_dir}: PeftModel.from_pretrained("
            f"AutoModelForCausalLM.from_pretrained({base!r}), {save_dir!r}) loads them")


def _finish(spec: TrialSpec, result: dict, outcome: dict, device: torch.device, world: int) -> dict:
    """Fill the result's measurements from the loop outcome (peak memory: max over ranks)."""
    stats = res.step_stats(outcome["timed"])
    peak, reserved = measure.peak_memory_gib(device)
    tensors = outcome["tensor_peak_bytes"]
    peak, reserved_max, tensors_max = _reduce([peak, reserved or 0.0, (tensors or 0) / GIB],
                                              dist.ReduceOp.MAX, device)
    measured = stats["count"] > 0
    result.update(
        status="ok" if measured else "timeout",
        reason=outcome["request_reason"] if measured else
        f"stopped by {outcome['stop_reason']} before any timed step, {outcome['steps_run']} untimed; {phases.where()}",
        stop_reason=outcome["stop_reason"], steps_run=outcome["steps_run"],
        steps_measured=stats["count"], step_time_s_median=stats["median"],
        step_time_s_mean=stats["mean"], step_time_s_std=stats["std"],
        peak_memory_gib=peak, peak_memory_reserved_gib=reserved_max if reserved is not None else None,
        peak_tensor_memory_gib=tensors_max if tensors is not None else None,
        first_losses=outcome["losses"][:res.FIRST_LOSSES],
        final_loss=outcome["losses"][-1] if outcome["losses"] else None,
        end_time=res.iso_utc(time.time()),
    )
    result.update(res.throughput(spec, stats["median"], world))
    return result


def engine_device(result: dict) -> torch.device:
    return torch.device("cuda") if result["device"] == "cuda" else torch.device("cpu")


def _fail(exc: Exception, spec: TrialSpec, result: dict, out: Path, env: tdist.DistEnv) -> dict:
    """Record the failure; rank 0 names the earliest failure of any rank. Multi-process: exit at once."""
    root = res.record_failure(exc, out, env.rank, env.world_size, f"trial {spec.trial_id}", phases.where())
    result.update(status=root["status"], reason=root["reason"], stop_reason=None,
                  peak_memory_gib=measure.peak_memory_gib(engine_device(result))[0],
                  end_time=res.iso_utc(time.time()))
    res.write_and_leave(out, env.rank, env.world_size, lambda: res.write_result(out, result))
    return result


def _load_or_record(spec_path: str | os.PathLike, output_dir: Optional[str]) -> TrialSpec:
    """Load the spec; if it is unreadable and an output folder is known, leave a failed status there."""
    try:
        return load_spec(spec_path)
    except Exception as exc:
        if output_dir is not None and tdist.read_env().rank == 0:
            result = res.empty_result(Path(spec_path).stem)
            result.update(res.describe_failure(exc, 0), start_time=res.iso_utc(time.time()),
                          end_time=res.iso_utc(time.time()))
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            res.write_result(Path(output_dir), result)
        raise


def run_trial(spec_path: str | os.PathLike, output_dir: Optional[str] = None,
              started_unix: Optional[float] = None) -> dict:
    """Run the trial described by ``spec_path``; returns result.json's content (rank 0's view).
    ``started_unix``: when the job started, for the phase log (default: now; a job process passes its own
    start, :func:`hp_tool.contracts.phases.process_start_unix`)."""
    t_start, wall_start = measure.now_s(), time.time()
    spec = _load_or_record(spec_path, output_dir)
    out = output_dir_for(spec, output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = tdist.read_env()
    if env.rank == 0:
        (out / res.STOP_REQUEST_FILE).unlink(missing_ok=True)  # an earlier run's: not this one's
    device = tdist.select_device(env)
    result = res.empty_result(spec.trial_id, spec.fingerprint())
    result.update(world_size=env.world_size, device=device.type,
                  backend=tdist.backend_name(env, device), start_time=res.iso_utc(wall_start))
    phases.start(out, env.rank, wall_start if started_unix is None else started_unix)
    flag = measure.SignalFlag()
    flag.install()
    try:
        apply_memory_cap(spec, device)
        tdist.init_distributed(env, device, solo_group=engine_needs_process_group(spec))
        phases.mark("distributed_init", "model_build")
        engine = build_engine(spec, env, device)
        outcome = run_loop(engine, out, t_start, flag)
        if spec.run.save_dir:
            state = engine.full_state_dict(save_dtype(spec.model))  # collective
            if env.rank == 0:
                save_checkpoint(state, spec.model, spec.run.save_dir)
                log.info("%s", saved_message(spec.model, spec.run.save_dir))
        _finish(spec, result, outcome, device, env.world_size)
        if env.rank == 0:
            res.write_result(out, result)
        tdist.shutdown()
        return result
    except Exception as exc:  # every failure must leave a status on disk
        return _fail(exc, spec, result, out, env)
    finally:
        flag.restore()
        phases.stop()
        if env.world_size == 1:  # a one-rank group of this trial's own (a failure skipped the shutdown above)
            tdist.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hp_tool.trial.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="TrialSpec YAML")
    parser.add_argument("--output-dir", default=None, help="default: the spec's run.output_dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{tdist.read_env().rank} %(levelname)s %(name)s: %(message)s")
    return exit_code(run_trial(args.spec, args.output_dir, phases.process_start_unix()))


def exit_code(result: dict) -> int:
    """A trial process's exit code for its result: 0 when it ran as asked (ok, timed out or cancelled), else 1."""
    return 0 if result["status"] in ("ok", "timeout", "cancelled") else 1


def exit_now(code: int) -> None:
    """End a torchrun rank without interpreter finalization, once its results are on disk and its streams
    flushed: tearing down torch's distributed objects in the interpreter's module order sometimes aborts a
    rank after a finished trial ('terminate called without an active exception')."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
