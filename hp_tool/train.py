"""Fine-tune with a search's winner: its optimal config, the real weights and tokenizer, your text.

    python3 -m hp_tool.train results/finetune/llama2_7b/final_results/optimal_config_6.74b_1nodes.yaml \\
        model.checkpoint=/models/Llama-2-7b-hf data.path=train.jsonl save_dir=/models/llama2-7b-tuned

``data.path`` is a JSON-lines file of ``{"text": ...}`` records: each text is tokenized with the checkpoint's
tokenizer, ends with its end-of-sequence token, and the texts are packed into one stream of token ids
(``<output_dir>/tokens.bin``) that the run reads in windows of the config's sequence length. The run loads
the checkpoint's weights into the chosen layout (``hp_tool.trial.checkpoint``), trains with the config's
layout, optimizer and schedule, and saves a checkpoint (``model.safetensors``, ``config.json`` and the
tokenizer) that ``AutoModelForCausalLM.from_pretrained(save_dir)`` loads.

Other keys: ``output_dir`` (metrics and result; default ``./finetune_run``), ``max_steps`` (stop early; default
the config's full run), ``nproc`` (processes on this machine; default the config's GPUs per node). A
config for more than one node prints the ``sbatch`` line to run it with instead. Everything is checked
before anything is written: the checkpoint against the config (every tensor at its shape), the data file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from hp_tool.contracts.spec import DataSpec, TrialSpec, dump_spec, load_spec
from hp_tool.errors import ConfigError, require
from hp_tool.results.optimal import train_sbatch_command
from hp_tool.trial.checkpoint import check_checkpoint

log = logging.getLogger("hp_tool.train")

KEYS = ("model.checkpoint", "data.path", "save_dir", "output_dir", "max_steps", "nproc")


def parse(argv: list[str]) -> tuple[Path, dict[str, str]]:
    """The config path and the ``key=value`` overrides; an unknown key names the known ones."""
    require(len(argv) >= 1 and not argv[0].count("="), "config", argv[:1], "no config given",
            "python3 -m hp_tool.train <optimal_config.yaml> model.checkpoint=<dir> data.path=<jsonl>")
    overrides = {}
    for item in argv[1:]:
        key, eq, value = item.partition("=")
        require(bool(eq) and key in KEYS, key, value or None, "is not a key of hp_tool.train",
                f"use key=value with one of {list(KEYS)}")
        overrides[key] = value
    for key in ("model.checkpoint", "data.path"):
        require(key in overrides, key, None, "is required", f"add {key}=<path> to the command")
    return Path(argv[0]), overrides


def tokenize(jsonl: Path, checkpoint: str, vocab_size: int):
    """The ``text`` of every JSON line, each ended by the tokenizer's end-of-sequence token, packed into one
    array of token ids (uint32)."""
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
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


def prepare(config: Path, overrides: dict[str, str]) -> tuple[TrialSpec, Path]:
    """The run's spec: the config with the checkpoint, the tokenized data and the save folder; checked
    before anything is written, then written to ``<output_dir>/run_spec.yaml``."""
    require(config.is_file(), "config", str(config), "no such file", "give the optimal_config_*.yaml of a search")
    spec = load_spec(config)
    require(spec.model.hf_config is not None, "config", str(config),
            f"is a {spec.model.family} pretraining config; fine-tuning needs a Hugging Face model",
            "give the optimal config of a finetune/* search")
    checkpoint, data = overrides["model.checkpoint"], Path(overrides["data.path"])
    model = dataclasses.replace(spec.model, checkpoint=str(Path(checkpoint).resolve()))
    check_checkpoint(model, checkpoint)
    require(data.is_file(), "data.path", str(data), "no such file", 'give a JSON-lines file of {"text": ...}')
    ids = tokenize(data, checkpoint, model.vocab_size)
    count = len(ids)
    require(count > model.seq_length, "data.path", str(data), f"holds {count} tokens, fewer than one "
            f"{model.seq_length}-token sequence", "give more text")
    out = Path(overrides.get("output_dir", "finetune_run")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokens = out / "tokens.bin"
    ids.tofile(tokens)
    run = dataclasses.replace(spec.run, output_dir=str(out),
                              save_dir=str(Path(overrides.get("save_dir", out / "model")).resolve()),
                              max_steps=int(overrides.get("max_steps", spec.run.max_steps)), stable_cv=0.0)
    training = dataclasses.replace(spec.training, data=DataSpec(source="file", path=str(tokens), dtype="uint32"))
    spec = dataclasses.replace(spec, model=model, training=training, run=run)
    log.info("%d tokens from %s; %d steps of %d sequences x %d tokens", count, data, run.max_steps,
             training.global_batch_size, model.seq_length)
    return spec, dump_spec(spec, out / "run_spec.yaml")


def launch(spec: TrialSpec, spec_path: Path, nproc: Optional[int]) -> int:
    """Train on this machine with torchrun, or print the sbatch line for a multi-node config."""
    r = spec.resources
    if r.num_nodes > 1:
        print(f"This config trains on {r.num_nodes} nodes; submit it with:\n  {train_sbatch_command(spec, str(spec_path))}")
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc or r.gpus_per_node}",
           "--standalone", "-m", "hp_tool.trial.train", str(spec_path)]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}).returncode


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config, overrides = parse(list(sys.argv[1:] if argv is None else argv))
        spec, spec_path = prepare(config, overrides)
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    code = launch(spec, spec_path, int(overrides["nproc"]) if "nproc" in overrides else None)
    if code == 0 and spec.resources.num_nodes == 1:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(spec.model.checkpoint).save_pretrained(spec.run.save_dir)
        result = json.loads((Path(spec.run.output_dir) / "result.json").read_text())
        loads = (f"AutoModelForCausalLM.from_pretrained({spec.run.save_dir!r})" if spec.model.method == "full" else
                 f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({spec.model.checkpoint!r}), "
                 f"{spec.run.save_dir!r})")
        print(f"Trained {result['steps_run']} steps (final loss {result['final_loss']:.4f}); saved the "
              f"{'model' if spec.model.method == 'full' else 'adapters'} to {spec.run.save_dir}: {loads} loads it.")
    return code


if __name__ == "__main__":
    sys.exit(main())
