"""final_results/: CSV schemas, the optimal config (round trip and a real training run), plots, the printed
summary, a re-run, and a search where nothing succeeded."""

import csv
import re

import pytest
from test_results_helpers import planned, selected_ids, write_failed, write_metrics, write_ok

from hp_tool.results.collect import RANK_COLUMN, TABLE_COLUMNS
from hp_tool.results.report import ALL_TRIALS_COLUMNS, SUMMARY_COLUMNS
from hp_tool.search import finalize
from hp_tool.contracts.spec import load_spec

UNIT_HINTS = ("_s", "_gib", "_pct", "_usd", "tokens", "tflops", "days", "hours", "_b", "mfu", "loss", "rank")
MISSING_WORDS = {"None", "none", "nan", "NaN", "<NA>", "NA", "null"}


def read_csv(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def finished_search(tmp_path, *overrides):
    """A tiny search: 3 ok trials in a known speed order, one oom, one killed, the rest never ran."""
    app, out, plan = planned(tmp_path, "gpu.price_per_gpu_hour=2.0", *overrides)
    ids = selected_ids(plan)
    times = {ids[4]: 0.30, ids[0]: 0.50, ids[2]: 0.40}
    for tid, t in times.items():
        write_ok(out, tid, t)
    write_failed(out, ids[1])
    write_metrics(out, ids[3], [0.9, 0.2, 0.2])
    return app, out, ids, sorted(times, key=times.get)


def test_csv_schemas_and_rows(tmp_path, capsys):
    app, out, ids, fastest = finished_search(tmp_path)
    assert finalize(out, app) == 0
    final = out / "final_results"
    header, rows = read_csv(final / "all_trials_1nodes.csv")
    assert tuple(header) == ALL_TRIALS_COLUMNS == TABLE_COLUMNS
    for name in header:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
    numeric = [c for c in header if c not in ("trial_id", "status", "reason", "plan_status", "model_family", "memory_check",
                                              "stop_reason", "device", "start_time", "end_time", "fingerprint")]
    no_unit = {"tp", "pp", "dp", "mbs", "act_ckpt_layers", "engine", "zero_stage", "offload", "global_batch_size", "num_nodes", "num_gpus",
               "trial_num_nodes", "trial_dp", "trial_global_batch_size", "trial_world_size", "steps_run",
               "steps_measured", "seq_length", "optimizer", "method", "lora_rank", "trainable_parameters",
               "experts", "top_k", "ep", "active_parameters", "cp", "sequence_parallel", "loss",
               "activation_offload", "act_ckpt_mode"}  # counts, names and flags
    for name in numeric:
        assert name in no_unit or any(h in name for h in UNIT_HINTS), f"{name} has no unit in its name"
    assert len(rows) == 24 and len({r["trial_id"] for r in rows}) == 24
    assert [r["trial_id"] for r in rows[:3]] == fastest and [r["rank"] for r in rows[:3]] == ["1", "2", "3"]
    assert all(v not in MISSING_WORDS for r in rows for k, v in r.items() if k != "offload")  # offload=none is a value
    by_id = {r["trial_id"]: r for r in rows}
    assert by_id[ids[1]]["status"] == "oom" and by_id[ids[3]]["status"] == "failed"
    assert by_id[ids[3]]["reason"].startswith("killed without a result; derived from 3 logged steps")
    assert {r["status"] for r in rows} == {"ok", "oom", "failed", "not_run", "invalid", "over_limit"}
    for r in rows:  # columns line up with the header: a shifted row would break these
        assert r["status"] in {"ok", "oom", "failed", "not_run", "invalid", "over_limit"}
        assert r["tp"] in {"1", "2"} and r["model_family"] == "gpt3"
        assert (r["rank"] != "") == (r["status"] == "ok")

    s_header, s_rows = read_csv(final / "final_summary_1nodes.csv")
    assert tuple(s_header) == SUMMARY_COLUMNS
    assert [r["trial_id"] for r in s_rows] == fastest
    assert [float(r[RANK_COLUMN]) for r in s_rows] == [0.3, 0.4, 0.5]
    assert float(s_rows[0]["cost_usd_per_million_tokens"]) == pytest.approx(4.0 / (1024 / 0.3 * 3600 / 1e6),
                                                                             rel=1e-5)
    printed = capsys.readouterr().out
    assert f"Recommended: {fastest[0]}" in printed and "3 of 12 selected trials succeeded" in printed


def test_top_n_limits_the_summary(tmp_path):
    app, out, _, fastest = finished_search(tmp_path, "search_config.train_settings.output_top_n=2")
    assert finalize(out, app) == 0
    _, rows = read_csv(out / "final_results" / "final_summary_1nodes.csv")
    assert [r["trial_id"] for r in rows] == fastest[:2]


def test_optimal_config_is_the_full_run_of_the_fastest_trial(tmp_path):
    app, out, _, fastest = finished_search(tmp_path)
    assert finalize(out, app) == 0
    path = out / "final_results" / "optimal_config_241k_1nodes.yaml"
    spec = load_spec(path)
    trial = load_spec(out / "candidate_configs" / f"{fastest[0]}.yaml")
    base = load_spec(out / "base_cfg_241k.yaml")
    assert spec.trial_id == fastest[0] and spec.run.mode == "full"
    assert (spec.parallel.tp, spec.parallel.pp, spec.parallel.mbs) == (trial.parallel.tp, trial.parallel.pp,
                                                                       trial.parallel.mbs)
    assert spec.parallel.dp == trial.full_run.dp
    assert spec.resources.num_nodes == base.full_run.num_nodes
    assert spec.resources.gpus_per_node == base.resources.gpus_per_node
    assert spec.training.global_batch_size == base.training.global_batch_size
    assert spec.training.max_steps == spec.run.max_steps == base.full_run.max_steps == 976
    assert spec.estimates.step_time_s == pytest.approx(0.3)
    text = path.read_text()
    assert "# Estimated days to train: 0.003389 (976 steps x 0.3 s = 4.88 minutes)" in text
    assert "# Cost: $0.325 at $2 per GPU-hour ($0.326 per million tokens" in text  # 4 $/h x 976 x 0.3 s


def test_optimal_config_trains_with_the_engine(tmp_path):
    train = pytest.importorskip("hp_tool.trial.train", reason="the trial engine (hp_tool.trial.train) "
                                                              "cannot be imported")
    # one process, so the full run is 1 GPU; 5e3 tokens / (8 x 128) = 4 steps of the full schedule
    app, out, plan = planned(tmp_path, "search_config.train_settings.gpus_per_node=1",
                             "search_config.train_settings.tensor_parallel_sizes=[1]",
                             "search_config.train_settings.pipeline_parallel_sizes=[1]",
                             "search_config.train_settings.num_tokens_in_b=0.000005")
    write_ok(out, selected_ids(plan)[0], 0.05)
    assert finalize(out, app) == 0
    path = out / "final_results" / "optimal_config_241k_1nodes.yaml"
    result = train.run_trial(str(path), str(tmp_path / "full_run"))
    assert result["status"] == "ok", result["reason"]
    assert result["steps_run"] == 4 and result["world_size"] == 1


def test_plots_are_non_empty_pngs(tmp_path):
    app, out, _, _ = finished_search(tmp_path)
    assert finalize(out, app) == 0
    for name in ("throughput.png", "predicted_vs_measured.png"):
        data = (out / "final_results" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_memory_warning_names_the_fastest_trial_below_98_percent(tmp_path, capsys):
    app, out, plan = planned(tmp_path)  # tiny: 4 GiB per GPU
    ids = selected_ids(plan)
    write_ok(out, ids[0], 0.2, peak_memory_gib=3.95)  # 98.75%
    write_ok(out, ids[1], 0.3, peak_memory_gib=3.93)  # 98.25%
    write_ok(out, ids[2], 0.4, peak_memory_gib=2.0)
    assert finalize(out, app) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"Recommended: {ids[0]}" in printed
    assert "is 98.8% of the 4 GiB per GPU, above 98%" in printed
    assert f"The fastest trial below that line is {ids[2]} (rank 3" in printed


def test_rerun_collects_again_without_duplicates(tmp_path):
    app, out, ids, _ = finished_search(tmp_path)
    assert finalize(out, app) == 0
    first = (out / "final_results" / "all_trials_1nodes.csv").read_text()
    write_ok(out, ids[5], 0.1)  # a trial finished since
    assert finalize(out, app) == 0
    _, rows = read_csv(out / "final_results" / "all_trials_1nodes.csv")
    assert len(rows) == len(first.splitlines()) - 1 == 24
    assert rows[0]["trial_id"] == ids[5] and len({r["trial_id"] for r in rows}) == 24
    assert load_spec(out / "final_results" / "optimal_config_241k_1nodes.yaml").trial_id == ids[5]


def test_no_successful_trial(tmp_path, capsys):
    app, out, plan = planned(tmp_path)
    ids = selected_ids(plan)
    write_failed(out, ids[0], "oom")
    write_failed(out, ids[1], "failed", "rank 1: RuntimeError: boom")
    write_metrics(out, ids[2], [0.5])  # killed during warm-up
    assert finalize(out, app) == 1
    printed = capsys.readouterr().out
    assert "0 of 12 selected trials succeeded" in printed and "No trial succeeded" in printed
    _, rows = read_csv(out / "final_results" / "all_trials_1nodes.csv")
    assert len(rows) == 24 and all(r["rank"] == "" for r in rows)
    header, summary = read_csv(out / "final_results" / "final_summary_1nodes.csv")
    assert tuple(header) == SUMMARY_COLUMNS and summary == []
    assert not (out / "final_results" / "optimal_config_241k_1nodes.yaml").exists()
    assert (out / "final_results" / "throughput.png").stat().st_size > 0
