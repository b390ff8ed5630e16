"""Tiny TrialSpecs and process launchers shared by the trial engine tests.

``torchrun`` starts the engine's ranks as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, one
thread each, gloo): forked from the warm process the local CPU jobs fork from (hp_tool/launch/backends/warm.py),
which has imported the engine once, so a launch spends no seconds importing torch and transformers per rank (a
real ``torch.distributed.run`` launch: tests/test_loss_scaling.py). ``torchrun_module`` starts another entry's
ranks (the inference worker's) the same way; ``trial_process`` runs one trial in a warm fork of its own, as a job
runs one, without torchrun's variables.

``launched`` runs a spec once per test session (the same spec, from any test file, reads the first launch's
output): several test files launch the same tiny layouts (their losses in one, their measured peaks in another)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hp_tool.contracts.spec import (ModelSpec, ParallelSpec, ResourcesSpec, RunSpec, TrainingSpec,
                                TrialSpec, dump_spec)

REPO = Path(__file__).resolve().parents[1]
MOE_FAMILIES = ("moe", "mixtral", "qwen2_moe", "qwen3_moe")


def tiny_spec(family: str = "gpt3", tp: int = 1, pp: int = 1, dp: int = 1, mbs: int = 2,
              gbs: int = 8, act_ckpt: int = 0, max_steps: int = 3, **run) -> TrialSpec:
    """4 layers, hidden 64, 4 heads (2 kv heads for Llama), vocab 512, seq 64: a step takes milliseconds.
    T5/mT5: 2 layers per stack, 4 heads of 16 channels, encoder 64 and decoder 32 tokens (mT5 a larger
    vocabulary). Mixtures of experts (``MOE_FAMILIES``): 2 layers, vocab 256, seq 32, 4 experts of width 32,
    top-2, 2 kv heads; qwen2_moe adds a shared expert of width 48 and q, k, v biases. ``ep`` (in ``run``):
    the experts split over that many of the DP ranks; ``cp`` (in ``run``): each sequence split over that
    many ranks (context parallelism)."""
    kv = 2 if family in ("llama", *MOE_FAMILIES) else 4
    ffn = {"llama": 176, "t5": 128, "mt5": 128, **{name: 32 for name in MOE_FAMILIES}}.get(family, 256)
    encdec, moe = family in ("t5", "mt5"), family in MOE_FAMILIES
    experts = dict(num_experts=4, top_k=2, shared_expert_ffn_hidden_size=48 if family == "qwen2_moe" else 0,
                   qkv_bias=family == "qwen2_moe") if moe else {}
    model = ModelSpec(family=family, num_layers=2 if encdec or moe else 4, hidden_size=64, num_attention_heads=4,
                      num_kv_heads=kv, ffn_hidden_size=ffn,
                      vocab_size={"mt5": 2048, **{name: 256 for name in MOE_FAMILIES}}.get(family, 512),
                      seq_length=32 if moe else 64, kv_channels=16 if encdec else None,
                      decoder_seq_length=32 if encdec else None, **experts)
    parallel = ParallelSpec(tp=tp, pp=pp, dp=dp, mbs=mbs, act_ckpt_layers=act_ckpt,
                            engine=run.pop("engine", "torch"), zero_stage=run.pop("zero_stage", 3),
                            offload=run.pop("offload", "none"), virtual_stages=run.pop("vp", 1),
                            ep=run.pop("ep", 1), cp=run.pop("cp", 1))
    training = TrainingSpec(global_batch_size=gbs, lr=1e-3, min_lr=1e-4, warmup_steps=1,
                            max_steps=100, seed=1234)
    run_spec = RunSpec(max_steps=max_steps, warmup_steps=run.pop("warmup_steps", 1),
                       stable_cv=run.pop("stable_cv", 0.0), **run)
    trial_id = f"{family}_tiny_tp{tp}_pp{pp}_vp{parallel.virtual_stages}_dp{dp}_mbs{mbs}_ac{act_ckpt}" + \
        (f"_ep{parallel.ep}" if parallel.ep > 1 else "") + (f"_cp{parallel.cp}" if parallel.cp > 1 else "")
    return TrialSpec(trial_id=trial_id, model=model, parallel=parallel, training=training,
                     resources=ResourcesSpec(num_nodes=1, gpus_per_node=tp * pp * parallel.cp * dp,
                                             peak_tflops_per_gpu=1.0),
                     run=run_spec)



def long_context_spec(seq_length: int = 256, vocab_size: int = 2048, loss: str = "full",
                      loss_chunk_tokens: int = 4096, sequence_parallel: bool = False,
                      activation_offload: bool = False, **layout) -> TrialSpec:
    """``tiny_spec("llama", **layout)`` (4 layers, hidden 64, 2 kv heads) at a long-ish sequence over a
    vocabulary whose logits outweigh a layer's activations (256 tokens, 2048 words: the fp32 logits of a
    2-sequence micro-batch are 4.2 MB, a layer's saved activations 2.6 MB), with the long-context savers:
    the chunked loss and its chunk, sequence parallelism (TP > 1), activation offload."""
    spec = tiny_spec("llama", **layout)
    return dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, seq_length=seq_length, vocab_size=vocab_size),
        parallel=dataclasses.replace(spec.parallel, loss=loss, loss_chunk_tokens=loss_chunk_tokens,
                                     sequence_parallel=sequence_parallel, activation_offload=activation_offload))


def write_spec(spec: TrialSpec, folder: Path) -> Path:
    return dump_spec(spec, folder / f"{spec.trial_id}.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(spec_path: Path, out: Path, nproc: int, timeout: float = 120,
             torch_logs: str | None = None) -> subprocess.CompletedProcess:
    """Run the engine's ``nproc`` CPU ranks (gloo) on ``spec_path`` (module docstring), forked from the warm
    process; the ranks' output in order, the first failing rank's exit code.
    ``torch_logs``: TORCH_LOGS for the forked ranks (e.g. "dynamo"), torch's logging set up from it in each rank
    as torch's import does, so a launch that reads torch's logs needs no torchrun of its own."""
    argv = [str(spec_path), "--output-dir", str(out)]
    extra = {"TORCH_LOGS": torch_logs} if torch_logs else {}
    return _forked("hp_tool.trial.train", argv, Path(out).parent / f".{Path(out).name}_ranks", nproc, timeout,
                   extra)


def torchrun_module(module: str, argv: list[str], logs: Path, nproc: int,
                    timeout: float = 120) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m module *argv`` as ``torchrun`` runs the trial entry: ``nproc`` ranks
    forked from the warm process with torchrun's variables, each calling ``module.main(argv)``; the ranks' output
    under ``logs``, in order, the first failing rank's exit code."""
    return _forked(module, [str(a) for a in argv], Path(logs), nproc, timeout)


def trial_process(spec_path: Path, out: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m hp_tool.trial.train spec_path --output-dir out`` as a job runs a one-process trial: a process of
    its own (forked from the warm process, so it imports nothing again) with the launch's environment and no
    torchrun variables; its output, its exit code."""
    argv = [str(spec_path), "--output-dir", str(out)]
    return _forked("hp_tool.trial.train", argv, Path(out).parent / f".{Path(out).name}_process", None, timeout)


def _forked(module: str, argv: list[str], logs: Path, nproc: int | None, timeout: float,
            extra: dict | None = None) -> subprocess.CompletedProcess:
    """``nproc`` ranks of ``module.main(argv)`` forked from the warm process with torchrun's variables (``nproc``
    None: one process without them); their output in order, the first failing one's exit code."""
    from hp_tool.launch.backends import warm

    logs.mkdir(parents=True, exist_ok=True)
    if nproc is None:
        envs = [{**os.environ, **(extra or {})}]
    else:
        # the launch's environment now, as torchrun hands it on (not the warm process's), and torchrun's variables
        ranks = {**os.environ, **(extra or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                 "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
        envs = [{**ranks, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]
    nproc = len(envs)
    logging_from_env = "TORCH_LOGS" in (extra or {})
    procs = [warm.context().Process(target=_rank, args=(argv, env, str(logs / f"{r}.out"), str(logs / f"{r}.err"),
                                                        module, logging_from_env))
             for r, env in enumerate(envs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [p for p in procs if p.is_alive()]
    for p in late:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    stdout = "".join((logs / f"{r}.out").read_text() for r in range(nproc))
    stderr = "".join((logs / f"{r}.err").read_text() for r in range(nproc))
    if late:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    code = next((p.exitcode for p in procs if p.exitcode), 0)
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def _rank(argv: list[str], ranks: dict, out: str, err: str, module: str = "hp_tool.trial.train",
          logging_from_env: bool = False) -> None:
    """One rank in a fork of the warm process: torchrun's variables, one thread, its output in ``out``/``err``,
    the exit code of ``module``'s ``main`` (the trial entry's by default); with ``logging_from_env`` torch's logging
    set up again from the rank's TORCH_LOGS."""
    import importlib

    import torch

    main = importlib.import_module(module).main

    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ.clear()
    os.environ.update(ranks, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if logging_from_env:  # torch read TORCH_LOGS as it was imported, in the warm process: again, as its import does
        from torch._logging._internal import _init_logs

        _init_logs()
    code = 1
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the rank's end: its traceback to its log, its code to the launch
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of ``spec`` (``launched``): its output folder, the launch's exit code and the ranks' output (empty
    for one process, which ran in the test process)."""

    spec: TrialSpec
    out: Path
    returncode: int
    stdout: str
    stderr: str

    def result(self) -> dict:
        return read_result(self.out)

    def metrics(self) -> list[dict]:
        return read_metrics(self.out)


_LAUNCHED: dict[str, Launch] = {}


def launched(tmp_path_factory, spec: TrialSpec) -> Launch:
    """``spec`` run once per test session: one process in this process (``run_trial``), more as ``torchrun``'s
    ranks; the same spec again, from any test file, gets that launch. Its readers only read its output folder
    (a test that writes there copies it first)."""
    key = json.dumps(spec.to_dict(), sort_keys=True, default=str)
    if key not in _LAUNCHED:
        folder = tmp_path_factory.mktemp(f"launched_{spec.trial_id}"[:60])
        out = folder / "out"
        world = spec.resources.num_nodes * spec.resources.gpus_per_node
        if world == 1:
            from hp_tool.trial.train import exit_code, run_trial

            code = exit_code(run_trial(write_spec(spec, folder), str(out)))
            proc = subprocess.CompletedProcess([], code, "", "")
        else:
            proc = torchrun(write_spec(spec, folder), out, world)
        _LAUNCHED[key] = Launch(spec, out, proc.returncode, proc.stdout, proc.stderr)
    return _LAUNCHED[key]


def read_result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
