"""The fine-tuning searches several test files read, each run once per test session (one search, many asserts):

``finetune_methods_search``: finetune/tiny over full fine-tuning, LoRA and QLoRA (one layout each: DP 2, ZeRO 0,
    bf16, 64 tokens), the real command line (``python3 main.py ... cluster=local``) as a process of its own, its
    trials on 2 CPU processes each. Read by tests/test_lora.py (the three methods ranked, adapters counted, MFU per
    method) and tests/test_finetune.py (the per-epoch columns of a real search).
``finetune_savers_search``: finetune/tiny at 256 tokens over the long-context savers (the chunked and the
    whole-logits loss, CP 1 and 2, TP 2 with sequence parallelism, activation offload), run by the CLI's entry in
    this process (search_helpers.main_here; the trials are processes of their own, 2 each). Read by
    tests/test_long_context.py (every saver trained and ranked) and tests/test_finetune.py (its per-epoch columns
    at another sequence length).

Their readers only read the results folder (a test that writes there copies it first). Each fixture is a
``shared_searches.Searched`` of one command (its exit code and output, which its readers assert on first, so a
failed search fails each reader with the search's own output). No tests here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from shared_searches import Searched, _run

REPO = Path(__file__).resolve().parent.parent
TS = "search_config.train_settings"

__all__ = ["finetune_methods_search", "finetune_savers_search"]


# full, LoRA (rank 16, every linear) and QLoRA in the same layout: 3 trials (exhaustive), one per method
METHODS_SEARCH = ["search_config=finetune/tiny", "cluster=local", f"{TS}.methods=[full,lora,qlora]",
                  f"{TS}.zero_stages=[0]", f"{TS}.precision=bf16", f"{TS}.seq_lengths=[64]",
                  f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.micro_batch_sizes=[4]", f"{TS}.act_ckpt_layers=[0]",
                  f"{TS}.search_strategy=exhaustive", f"{TS}.max_steps_per_run=6"]
METHODS_TRIALS = 3

# the savers, each with activation offload: 5 trials (tp, cp, sequence_parallel, loss):
# (1, 1, False, chunked), (1, 1, False, full), (1, 2, False, chunked), (1, 2, False, full), (2, 1, True, full)
SAVERS_SEARCH = ["search_config=finetune/tiny", "cluster=local", f"{TS}.search_strategy=exhaustive",
                 f"{TS}.seq_lengths=[256]", f"{TS}.global_batch_tokens=1024", f"{TS}.tensor_parallel_sizes=[1,2]",
                 f"{TS}.context_parallel_sizes=[1,2]", f"{TS}.losses=[full,chunked]", f"{TS}.micro_batch_sizes=[2]",
                 f"{TS}.zero_stages=[0]", f"{TS}.act_ckpt_layers=[0]", f"{TS}.activation_offload=[true]",
                 f"{TS}.methods=[full]", f"{TS}.limit_search_runs=5", f"{TS}.max_steps_per_run=4",
                 "memory_check=analytic"]
SAVERS_TRIALS = 5


@pytest.fixture(scope="session")
def finetune_methods_search(tmp_path_factory) -> Searched:
    """``python3 main.py`` over the three methods as a process (the real command line, its own interpreter, the
    local backend's warm process and its default, traced, memory check): the suite's one fine-tuning search run
    end to end as a user runs it."""
    base = tmp_path_factory.mktemp("finetune_methods")
    proc = subprocess.run([sys.executable, str(REPO / "main.py"), *METHODS_SEARCH, f"base_results_dir={base}"],
                          capture_output=True, text=True, timeout=600, cwd=base)
    results = base / "finetune" / "tiny"
    return Searched(results, (_run(results, proc.returncode, proc.stdout, proc.stderr),))


@pytest.fixture(scope="session")
def finetune_savers_search(tmp_path_factory) -> Searched:
    """The savers search through the CLI's entry in this process (the orchestrating process is not what its
    readers test; the trials still run as processes of their own on the local backend)."""
    from search_helpers import main_here

    base = tmp_path_factory.mktemp("finetune_savers")
    proc = main_here(*SAVERS_SEARCH, f"base_results_dir={base}", cwd=base)
    results = base / "finetune" / "tiny"
    return Searched(results, (_run(results, proc.returncode, proc.stdout, proc.stderr),))
