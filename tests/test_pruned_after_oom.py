"""A real adaptive search in which a trial runs out of memory and the layout the plan predicts to need more
of it in the same (TP, PP) regime is never launched: its row is pruned_after_oom (hp_tool/adaptive.py
``verdicts``; README's status table). tests/test_adaptive.py covers the decision as a pure function.

The machine here is one whose trial processes have 2 GiB of address space (``run.memory_cap_gib``, which
the trial applies as RLIMIT_AS on CPU; the search has no key for it, so this test sets it on every trial
spec the planner makes). gpt3/tiny widened to 8 layers of 256 at 2048 tokens: the plan (gpu.memory_gib=2.5)
prunes MBS 8 without checkpointing and selects, fastest first,

    A  MBS 4, no checkpointing      predicted 1.65 GiB   needs about 2.8 GiB of address space here
    B  MBS 8, 4 layers checkpointed predicted 1.92 GiB   never launched: A (same regime: TP=1, PP=1) ran out of memory
       MBS 4, 4 layers checkpointed                      over_limit (limit_search_runs=2)

The process builds its model in about 1.3 GiB of address space, so A fails in its first forward, whatever
the cap between 1.3 and 2.7 GiB: the 2 GiB cap sits in the middle. glibc's per-thread malloc arenas
reserve address space per core; MALLOC_ARENA_MAX and OMP_NUM_THREADS keep that the same on bigger machines.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from hp_tool import planner
from hp_tool.cli import compose, results_dir, run
from hp_tool.config import to_app_config
from hp_tool.vocab import PRUNED_AFTER_OOM

TS = "search_config.train_settings"
CAP_GIB = 2.0
A = "gpt3_6.97m_tp1_pp1_mbs4_ac0_torch_z0_noff"
B = "gpt3_6.97m_tp1_pp1_mbs8_ac4_torch_z0_noff"
C = "gpt3_6.97m_tp1_pp1_mbs4_ac4_torch_z0_noff"


@pytest.mark.e2e
def test_a_trial_out_of_memory_prunes_the_bigger_layout_of_its_regime_unlaunched(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # the trials inherit this process's environment
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    make_spec = planner.candidate_spec

    def capped(*args, **kwargs):
        spec = make_spec(*args, **kwargs)
        return dataclasses.replace(spec, run=dataclasses.replace(spec.run, memory_cap_gib=CAP_GIB))

    monkeypatch.setattr(planner, "candidate_spec", capped)
    cfg, name = compose(["search_config=gpt3/tiny", "cluster=local", "memory_check=analytic", "gpu.memory_gib=2.5",
                         f"base_results_dir={tmp_path / 'res'}", f"{TS}.gpus_per_node=1",
                         f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.pipeline_parallel_sizes=[1]",
                         f"{TS}.micro_batch_sizes=[4,8]", f"{TS}.act_ckpt_layers=[0,4]", f"{TS}.act_ckpt_modes=[full]",
                         "search_config.model.num_layers=8", "search_config.model.hidden_size=256",
                         "search_config.model.ffn_hidden_size=1024", f"{TS}.vocab_size=512", f"{TS}.seq_length=2048",
                         f"{TS}.global_batch_size=8", f"{TS}.max_steps_per_run=2", f"{TS}.limit_search_runs=2",
                         f"{TS}.search_strategy=adaptive"])
    app = to_app_config(cfg)
    assert run(app, name) == 1  # no trial measured anything

    res = results_dir(app, name)
    rows = pd.read_csv(res / "final_results" / "all_trials_1nodes.csv").set_index("trial_id")
    assert rows.loc[A, "status"] == "oom" and "allocate" in rows.loc[A, "reason"]
    assert rows.loc[B, "status"] == PRUNED_AFTER_OOM
    assert rows.loc[B, "reason"] == (f"{A} (same regime: TP=1, PP=1) ran out of memory at a predicted 1.65 GiB per GPU; "
                                     "this one is predicted to need 1.92 GiB")
    assert rows.loc[C, "plan_status"] == "over_limit"
    assert not (res / "training_logs" / B / "job").exists()  # decided before submission: no job folder
    assert (res / "training_logs" / A / "job").exists()
