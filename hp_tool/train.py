"""Fine-tune a Hugging Face checkpoint with a search's winner: its optimal config, the checkpoint's weights and
tokenizer, and your text.

Usage:
    python3 -m hp_tool.train <optimal_config.yaml> model.checkpoint=<dir> data.path=<file.jsonl> [key=value ...]
    python3 -m hp_tool.train -h | --help

    python3 -m hp_tool.train results/finetune/llama2_7b/final_results/optimal_config_6.74b_1nodes.yaml \\
        model.checkpoint=/models/Llama-2-7b-hf data.path=train.jsonl save_dir=/models/llama2-7b-tuned

Keys:
    model.checkpoint  required: the checkpoint folder (safetensors weights, config.json and its tokenizer)
    data.path         required: a JSON-lines file of {"text": ...} records
    save_dir          where the tuned model (full) or its adapters (lora, qlora) go; default <output_dir>/model
    output_dir        the run's token file, spec, metrics.jsonl and result.json; default <results>/finetune_run,
                      beside the config's final_results folder (beside the config if it is elsewhere)
    epochs            passes over the data, a whole number; default the config's epochs, else 1
    max_steps         stop after this many steps, a whole number; default every step the data and epochs give
    training.lr       the peak learning rate; default the config's, which the search sets by method: full 2e-5,
                      lora and qlora 2e-4
    nproc             processes on this machine: the config's (its GPUs per node), the default

Each text is tokenized with the checkpoint's tokenizer and ended by its end-of-sequence token; the texts are
packed into one stream of token ids (<output_dir>/tokens.bin) read in windows of the config's sequence length.
The steps come from the data: its tokens x epochs / (global batch x sequence length), at least 1, capped by
max_steps; the run prints its tokens, passes and steps before it starts, and a progress line (step, loss,
tokens/s, MFU, time left) every few steps while it trains. It loads the checkpoint's weights into the config's layout,
trains with its layout, optimizer and schedule, and saves a checkpoint with the tokenizer:
AutoModelForCausalLM.from_pretrained(save_dir) loads a full fine-tune, PeftModel.from_pretrained(<base model>,
save_dir) LoRA's and QLoRA's adapters. A config for more than one node prints the sbatch line that trains it
instead. Everything is checked before anything is written: the keys, the config, the checkpoint against the
config (every tensor at its shape) and its tokenizer, the data file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hp_tool.base_config import FINETUNE_WARMUP_RATIO, with_lr
from hp_tool.contracts import result as res
from hp_tool.contracts.spec import DataSpec, TrialSpec, dump_spec, load_spec
from hp_tool.errors import ConfigError, require

USAGE = "python3 -m hp_tool.train <optimal_config.yaml> model.checkpoint=<dir> data.path=<file.jsonl>"
KEYS = ("model.checkpoint", "data.path", "save_dir", "output_dir", "epochs", "max_steps", "training.lr", "nproc")
WHOLE_NUMBERS = ("epochs", "max_steps", "nproc")
CONFIG_SUFFIXES = (".yaml", ".yml")
DATA_SUFFIXES = (".jsonl", ".json")
RUN_FOLDER = "finetune_run"  # the default output folder, beside the search's final_results
PROGRESS_LINES = 20  # progress lines over a run, about
PROGRESS_EVERY_S = 30.0  # and at least one this often


@dataclass(frozen=True)
class Options:
    """The command line, typed and checked."""

    config: Path
    checkpoint: str
    data: Path
    save_dir: Optional[str] = None
    output_dir: Optional[str] = None
    epochs: Optional[int] = None
    max_steps: Optional[int] = None
    lr: Optional[float] = None
    nproc: Optional[int] = None


def whole_number(key: str, value: str) -> int:
    """``value`` as a positive integer, else a ConfigError naming ``key``."""
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(key, value, "is not a whole number", f"give a positive integer, e.g. {key}=2") from None
    fix = "leave max_steps out to train on all the data" if key == "max_steps" else f"give {key}=1 or more"
    require(number >= 1, key, number, "must be at least 1", fix)
    return number


def learning_rate(value: str) -> float:
    try:
        lr = float(value)
    except ValueError:
        raise ConfigError("training.lr", value, "is not a number",
                          "give a learning rate, e.g. training.lr=2e-4") from None
    require(0 < lr < 1, "training.lr", lr, "is not a learning rate", "give a number between 0 and 1, e.g. 2e-4")
    return lr


def parse(argv: list[str]) -> Options:
    """The config path and the ``key=value`` overrides, each checked; an unknown key names the known ones."""
    require(len(argv) >= 1 and "=" not in argv[0], "config", argv[0] if argv else None, "no config given",
            f"{USAGE} (-h for every key)")
    overrides: dict[str, str] = {}
    for item in argv[1:]:
        key, eq, value = item.partition("=")
        require(bool(eq) and key in KEYS, key, value or None, "is not a key of hp_tool.train",
                f"use key=value with one of {list(KEYS)}")
        overrides[key] = value
    for key in ("model.checkpoint", "data.path"):
        require(bool(overrides.get(key)), key, overrides.get(key), "is required", f"add {key}=<path> to the command")
    numbers = {key: whole_number(key, overrides[key]) for key in WHOLE_NUMBERS if key in overrides}
    lr = learning_rate(overrides["training.lr"]) if "training.lr" in overrides else None
    return Options(Path(argv[0]), overrides["model.checkpoint"], Path(overrides["data.path"]),
                   save_dir=overrides.get("save_dir"), output_dir=overrides.get("output_dir"),
                   epochs=numbers.get("epochs"), max_steps=numbers.get("max_steps"), lr=lr, nproc=numbers.get("nproc"))


def _first_line(path: Path) -> str:
    with open(path, errors="replace") as fh:
        return next((line.strip() for line in fh if line.strip()), "")


def _is_text_record(line: str) -> bool:
    """Whether ``line`` is a JSON object with a ``text`` field: a line of the data, not of a config."""
    try:
        return "text" in json.loads(line)
    except (ValueError, TypeError):
        return False


def check_inputs(options: Options) -> None:
    """The config and the data, each where the other belongs: a JSON-lines file given as the config, a YAML
    config given as data.path."""
    config, data = options.config, options.data
    swap = f"give the optimal config first and the data as data.path: {USAGE}"
    require(config.is_file(), "config", str(config), "no such file",
            "give the optimal_config_*.yaml in a search's final_results folder")
    require(config.suffix not in DATA_SUFFIXES and not _is_text_record(_first_line(config)), "config", str(config),
            "is a JSON-lines data file, not a training config", swap)
    require(data.is_file(), "data.path", str(data), "no such file", 'give a JSON-lines file of {"text": ...}')
    require(data.suffix not in CONFIG_SUFFIXES, "data.path", str(data), "is a YAML file, not JSON-lines text", swap)


def load_config(config: Path) -> TrialSpec:
    """The optimal config of a fine-tuning search; anything else is a ConfigError naming ``config``."""
    try:
        spec = load_spec(config)
    except ConfigError:
        raise
    except Exception as exc:  # a YAML or schema error: the file is not a config hp_tool wrote
        problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("config", str(config), f"does not load as a training config ({problem})",
                          "give the optimal_config_*.yaml in a search's final_results folder") from None
    require(spec.model.hf_config is not None, "config", str(config),
            f"is a {spec.model.family} pretraining config; fine-tuning needs a Hugging Face model",
            "give the optimal config of a finetune/* search")
    return spec


def load_tokenizer(checkpoint: str):
    """The checkpoint's own tokenizer; a folder without one is a ConfigError naming model.checkpoint."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(checkpoint)
    except (OSError, ValueError, TypeError, KeyError, ImportError) as exc:
        problem = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError("model.checkpoint", checkpoint, f"has no tokenizer transformers can load ({problem})",
                          "save the base model's tokenizer beside its weights: "
                          "AutoTokenizer.from_pretrained(<base model>).save_pretrained(<checkpoint>)") from None


def tokenize(jsonl: Path, tokenizer, checkpoint: str, vocab_size: int):
    """The ``text`` of every JSON line, each ended by the tokenizer's end-of-sequence token, packed into one
    array of token ids (uint32)."""
    import numpy as np

    ids: list[int] = []
    with open(jsonl) as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError("data.path", str(jsonl), f"line {number} is not a JSON object with a 'text' "
                                  f"field ({exc})", 'write one {"text": "..."} object per line') from exc
            ids += tokenizer(text, add_special_tokens=True)["input_ids"]
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
    require(max(ids, default=0) < vocab_size, "model.checkpoint", checkpoint,
            f"its tokenizer produces id {max(ids, default=0)}, beyond the model's {vocab_size}-token vocabulary",
            "use the checkpoint's own tokenizer files")
    return np.asarray(ids, dtype=np.uint32)


def default_output_dir(config: Path) -> Path:
    """``<results>/finetune_run`` for a config in ``<results>/final_results``; beside the config otherwise."""
    folder = config.resolve().parent
    return (folder.parent if folder.name == "final_results" else folder) / RUN_FOLDER


@dataclass(frozen=True)
class Plan:
    """What the run will train: the data's tokens, the steps they give and the steps run."""

    tokens: int  # in the packed data file
    epochs: float
    tokens_per_step: int  # global batch x sequence length
    steps: int  # tokens x epochs / tokens per step, at least 1: the schedule's length
    run_steps: int  # steps, capped by max_steps

    @property
    def passes(self) -> float:
        """Passes over the data the run makes."""
        return self.run_steps * self.tokens_per_step / self.tokens

    def sentence(self, data: Path, spec: TrialSpec) -> str:
        t, cap = spec.training, self.run_steps < self.steps
        return (f"{self.tokens:,} tokens in {data} x {self.epochs:g} epoch(s) / {self.tokens_per_step:,} tokens per "
                f"step ({t.global_batch_size} sequences x {spec.model.seq_length} tokens) = {self.steps:,} steps"
                + (f"; max_steps stops after {self.run_steps:,}" if cap else "")
                + f". Training {self.run_steps * self.tokens_per_step:,} tokens ({self.passes:.2f} passes over the "
                f"data) in {self.run_steps:,} steps, {spec.model.method} at lr {t.lr:g}.")


def plan_steps(tokens: int, epochs: float, spec: TrialSpec, max_steps: Optional[int]) -> Plan:
    per_step = spec.training.global_batch_size * spec.model.seq_length
    steps = max(1, int(tokens * epochs // per_step))
    return Plan(tokens, epochs, per_step, steps, min(steps, max_steps) if max_steps else steps)


def prepare(options: Options) -> tuple[TrialSpec, Path, Plan]:
    """The run's spec: the config with the checkpoint, the tokenized data, the steps the data gives, the
    learning rate and the save folder. Everything is checked first; then the token file and
    ``<output_dir>/run_spec.yaml`` are written."""
    check_inputs(options)
    spec = load_config(options.config)
    from hp_tool.trial.checkpoint import check_checkpoint

    checkpoint = options.checkpoint
    model = dataclasses.replace(spec.model, checkpoint=str(Path(checkpoint).resolve()))
    check_checkpoint(model, checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    ids = tokenize(options.data, tokenizer, checkpoint, model.vocab_size)
    require(len(ids) > model.seq_length, "data.path", str(options.data), f"holds {len(ids)} tokens, fewer than "
            f"one {model.seq_length}-token sequence", "give more text")
    r = spec.resources
    require(options.nproc is None or r.num_nodes > 1 or options.nproc == r.gpus_per_node, "nproc", options.nproc,
            f"the config's layout runs on {r.gpus_per_node} processes (TP x PP x CP x DP)",
            f"leave nproc out (or nproc={r.gpus_per_node}); a different count needs a config planned for it")
    epochs = options.epochs or spec.full_run.epochs or 1
    plan = plan_steps(len(ids), epochs, spec, options.max_steps)
    out = Path(options.output_dir).resolve() if options.output_dir else default_output_dir(options.config)
    tokens = out / "tokens.bin"
    lr = options.lr if options.lr is not None else spec.training.lr  # the planner wrote the method's (finetune_lr)
    training = dataclasses.replace(spec.training, max_steps=plan.steps, constant_steps=0,
                                   warmup_steps=int(FINETUNE_WARMUP_RATIO * plan.steps),
                                   data=DataSpec(source="file", path=str(tokens), dtype="uint32"))
    run = dataclasses.replace(spec.run, output_dir=str(out), max_steps=plan.run_steps, stable_cv=0.0,
                              save_dir=str(Path(options.save_dir or out / "model").resolve()))
    full_run = dataclasses.replace(spec.full_run, num_tokens_in_b=plan.tokens * epochs / 1e9, max_steps=plan.steps,
                                   epochs=float(epochs))
    spec = dataclasses.replace(spec, model=model, training=with_lr(training, lr), run=run, full_run=full_run)
    # checked; now written
    out.mkdir(parents=True, exist_ok=True)
    for stale in (res.METRICS_FILE, res.RESULT_FILE):  # an earlier run's in the same folder: not this one's
        (out / stale).unlink(missing_ok=True)
    ids.tofile(tokens)
    return spec, dump_spec(spec, out / "run_spec.yaml"), plan


def duration(seconds: float) -> str:
    """``h:mm:ss``, the hours unbounded."""
    minutes, secs = divmod(max(0, round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Progress:
    """Rank 0's metrics.jsonl, read while the run trains: a line with the step, loss, tokens/s, MFU (the trials'
    own definition, ``contracts.result.throughput``, so a run shows the speed its search measured) and time
    left every ``total / PROGRESS_LINES`` steps, and at least every ``PROGRESS_EVERY_S`` seconds."""

    def __init__(self, metrics: Path, spec: TrialSpec):
        self.metrics, self.spec, self.total = metrics, spec, spec.run.max_steps
        self.world = spec.resources.num_nodes * spec.resources.gpus_per_node
        self.every = max(1, self.total // PROGRESS_LINES)
        self.offset, self.first, self.shown_at = 0, None, 0.0

    def poll(self) -> None:
        if not self.metrics.is_file():
            return
        with open(self.metrics, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            self.show(json.loads(line))

    def show(self, record: dict) -> None:
        step = record["step"]
        if self.first is None:
            self.first = record
        now = time.monotonic()
        if not (step in (1, self.total) or step % self.every == 0 or now - self.shown_at >= PROGRESS_EVERY_S):
            return
        self.shown_at = now
        # seconds per step since the first (which loads and compiles); the first step's own time until then
        done = step - self.first["step"]
        per_step = (record["time"] - self.first["time"]) / done if done else record["step_time_s"]
        rate = record["tokens"] / per_step if per_step > 0 else float("nan")
        mfu = res.throughput(self.spec, per_step, self.world)["mfu"] if per_step > 0 else float("nan")
        left = duration((self.total - step) * per_step)
        print(f"step {step:,}/{self.total:,}  loss {record['loss']:.4f}  {rate:,.0f} tokens/s  MFU {mfu:.3g}  "
              f"{left} left", flush=True)


def launch(spec: TrialSpec, spec_path: Path) -> int:
    """Train on this machine with torchrun, showing rank 0's progress, or print the sbatch line for a
    multi-node config."""
    r = spec.resources
    if r.num_nodes > 1:
        from hp_tool.results.optimal import train_sbatch_command

        print(f"This config trains on {r.num_nodes} nodes; submit it with:\n"
              f"  {train_sbatch_command(spec, str(spec_path))}")
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={r.gpus_per_node}",
           "--standalone", "-m", "hp_tool.trial.train", str(spec_path)]
    progress = Progress(Path(spec.run.output_dir) / res.METRICS_FILE, spec)
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    try:
        while proc.poll() is None:
            progress.poll()
            time.sleep(0.25)
    except KeyboardInterrupt:  # the terminal's interrupt reached torchrun too: let it stop its ranks
        proc.wait()
    progress.poll()
    return proc.returncode


def finish(spec: TrialSpec, plan: Plan) -> None:
    """Save the tokenizer beside the weights and say how the run ended (the trial said what it saved)."""
    from transformers import AutoTokenizer

    out = Path(spec.run.output_dir)
    result = json.loads((out / res.RESULT_FILE).read_text())
    AutoTokenizer.from_pretrained(spec.model.checkpoint).save_pretrained(spec.run.save_dir)
    steps = result["steps_run"] or 0
    loss = result["final_loss"]
    print(f"Trained {steps:,} steps ({steps * plan.tokens_per_step:,} tokens, "
          f"{steps * plan.tokens_per_step / plan.tokens:.2f} passes over the data)"
          + (f", final loss {loss:.4f}" if loss is not None else "")
          + (f", stopped by {result['stop_reason']}" if result.get("stop_reason") not in (None, "max_steps") else "")
          + f"; the tokenizer is in {spec.run.save_dir}; metrics in {out / res.METRICS_FILE}.")


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        for arg in args:
            flag, _, value = arg.partition("=")
            require(not arg.startswith("-"), flag, value or None, "is not an option of hp_tool.train",
                    "give key=value arguments (-h prints them)")
        options = parse(args)
        spec, spec_path, plan = prepare(options)
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    print(plan.sentence(options.data, spec), flush=True)
    code = launch(spec, spec_path)
    if spec.resources.num_nodes > 1:
        return code
    if code == 0:
        finish(spec, plan)
    else:
        result = Path(spec.run.output_dir) / res.RESULT_FILE
        reason = json.loads(result.read_text()).get("reason") if result.is_file() else None
        print(f"Training failed (exit code {code}){': ' + reason if reason else ''}; the logs above say more.",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
