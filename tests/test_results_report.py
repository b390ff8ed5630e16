"""final_results/: CSV schemas, the optimal config (round trip and a real training run), plots, report.md,
the printed summary, a re-run, a search where nothing succeeded, and a real tiny search's report.md."""

import contextlib
import csv
import io
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from test_results_helpers import planned, selected_ids, write_failed, write_metrics, write_ok

from hp_tool.inference.report import summary_frame
from hp_tool.results.collect import RANK_COLUMN, TABLE_COLUMNS, collect_trials
from hp_tool.results.plots import PEAK_MEMORY, TENSOR_MEMORY, memory_comparison
from hp_tool.results.report_inputs import write_inference_report
from hp_tool.dimensions import layout_columns
from hp_tool.results.report import ALL_TRIALS_COLUMNS, SUMMARY_FIGURES
from hp_tool.search import finalize
from hp_tool.contracts.spec import load_spec

UNIT_HINTS = ("_s", "_gib", "_pct", "_usd", "tokens", "tflops", "days", "hours", "_b", "mfu", "loss", "rank")
MISSING_WORDS = {"None", "none", "nan", "NaN", "<NA>", "NA", "null"}


def flat(text: str) -> str:
    """Text with every run of whitespace as one space: a sentence wraps where the page wraps it."""
    return re.sub(r"\s+", " ", text)


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


@pytest.fixture(scope="module")
def finalized(tmp_path_factory):
    """finished_search's folder after one finalize (what it printed in ``printed``): its tests only read it."""
    app, out, ids, fastest = finished_search(tmp_path_factory.mktemp("finalized"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert finalize(out, app) == 0
    return SimpleNamespace(app=app, out=out, ids=ids, fastest=fastest, printed=printed.getvalue())


def test_csv_schemas_and_rows(finalized):
    out, ids, fastest = finalized.out, finalized.ids, finalized.fastest
    final = out / "final_results"
    header, rows = read_csv(final / "all_trials_1nodes.csv")
    assert tuple(header) == ALL_TRIALS_COLUMNS == TABLE_COLUMNS
    for name in header:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
    numeric = [c for c in header if c not in ("trial_id", "status", "reason", "plan_status", "note", "model_family",
                                              "memory_check",
                                              "stop_reason", "device", "start_time", "end_time", "fingerprint")]
    no_unit = {"tp", "pp", "dp", "mbs", "act_ckpt_layers", "engine", "zero_stage", "offload", "global_batch_size", "num_nodes", "num_gpus",
               "trial_num_nodes", "trial_dp", "trial_global_batch_size", "trial_world_size", "steps_run",
               "steps_measured", "seq_length", "optimizer", "method", "lora_rank", "trainable_parameters",
               "experts", "top_k", "ep", "active_parameters", "cp", "sequence_parallel", "loss",
               "activation_offload", "act_ckpt_mode", "master_weights", "fp8", "compile"}  # counts, names and flags
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
    _, plan_rows = read_csv(out / "candidate_configs" / "plan.csv")
    possible = [r for r in plan_rows if r["plan_status"] != "invalid"]
    varying = {c for c in layout_columns() if len({r[c] for r in possible}) > 1}
    assert {"tp", "mbs"} <= varying  # the grid varies these, so the summary must name them
    assert s_header[:2] == ["rank", "trial_id"] and tuple(s_header[-len(SUMMARY_FIGURES):]) == SUMMARY_FIGURES
    assert varying | {"tp", "pp", "dp", "mbs", "act_ckpt_layers", "engine", "zero_stage"} <= set(s_header)
    assert not {"cp", "loss", "activation_offload", "sequence_parallel", "method"} & set(s_header)  # never varied
    assert [r["trial_id"] for r in s_rows] == fastest
    assert [float(r[RANK_COLUMN]) for r in s_rows] == [0.3, 0.4, 0.5]
    assert float(s_rows[0]["cost_usd_per_million_tokens"]) == pytest.approx(4.0 / (1024 / 0.3 * 3600 / 1e6),
                                                                             rel=1e-5)
    printed = finalized.printed
    assert f"Recommended: {fastest[0]}" in printed and "3 of 12 selected trials succeeded" in printed


def test_top_n_limits_the_summary(tmp_path):
    app, out, _, fastest = finished_search(tmp_path, "search_config.train_settings.output_top_n=2")
    assert finalize(out, app) == 0
    _, rows = read_csv(out / "final_results" / "final_summary_1nodes.csv")
    assert [r["trial_id"] for r in rows] == fastest[:2]


def test_optimal_config_is_the_full_run_of_the_fastest_trial(finalized):
    out, fastest = finalized.out, finalized.fastest
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


@pytest.mark.e2e
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


def test_plots_are_non_empty_pngs(finalized):
    out = finalized.out
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


def test_rerun_collects_again_without_duplicates(finalized, tmp_path):
    out = Path(shutil.copytree(finalized.out, tmp_path / "copy"))  # the shared folder is only read
    app, ids = finalized.app, finalized.ids
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
    assert tuple(header[-len(SUMMARY_FIGURES):]) == SUMMARY_FIGURES and "tp" in header and summary == []
    assert not (out / "final_results" / "optimal_config_241k_1nodes.yaml").exists()
    assert (out / "final_results" / "throughput.png").stat().st_size > 0
    page = (out / "final_results" / "report.md").read_text()
    assert "**No pick yet**" in page and "Pick:" not in page
    assert f"| {ids[1]} | failed | rank 1: RuntimeError: boom |" in page


def test_memory_plot_compares_the_tensor_peak_never_the_cpu_rss_with_a_prediction(tmp_path):
    _, out, plan = planned(tmp_path)
    ids = selected_ids(plan)
    write_ok(out, ids[0], 0.3, peak_memory_gib=0.45, peak_tensor_memory_gib=0.015)
    write_ok(out, ids[1], 0.4, peak_memory_gib=0.44, peak_tensor_memory_gib=0.011)
    assert memory_comparison(collect_trials(out, memory_overhead_gib=0.5)) is TENSOR_MEMORY
    cpu = collect_trials(out)  # no overhead given: no tensor predictions to compare with
    assert memory_comparison(cpu) is None
    cpu["device"] = cpu["device"].map(lambda d: None if d is None else "cuda")  # on GPUs: allocated peak
    assert memory_comparison(cpu) is PEAK_MEMORY


def linked_files(page: str) -> list[str]:
    return re.findall(r"\]\(([^)]+)\)", page)


def test_report_md_names_the_pick_by_the_median_and_every_trial_without_a_rank(finalized):
    out, ids, fastest = finalized.out, finalized.ids, finalized.fastest
    page = (out / "final_results" / "report.md").read_text()
    head = page.split("## ")[0]
    assert f"**Pick: {fastest[0]}** — TP=" in head
    # medians 0.30 and 0.40 (the means are 15% higher: 0.345 and 0.46, never the ranking figures)
    assert f"33.3% faster than the runner-up, {fastest[1]}, on `{RANK_COLUMN}`" in head
    assert "median-based): 0.3 s against 0.4 s" in head
    assert "fits with 3.00 GiB headroom: measured peak RSS per process 1.00 GiB of 4 GiB per GPU" in head
    assert "3 of 12 selected trials succeeded" in head and "7 have not run yet" in head
    ranked = page.split("## Ranked trials")[1].split("## Plots")[0]
    header = next(line for line in ranked.splitlines() if line.startswith("| rank |"))
    assert "| zero_stage | act_ckpt_mode |" in header  # the plan searched full and selective checkpointing
    assert "seq_length" not in header and "| ep |" not in header  # one value each: nothing to tell apart
    assert [ranked.index(f"| {i + 1} | {tid} |") for i, tid in enumerate(fastest)] == sorted(
        ranked.index(f"| {i + 1} | {tid} |") for i, tid in enumerate(fastest))
    unranked = page.split("## Skipped, pruned and failed")[1]
    assert f"| {ids[1]} | oom | rank 0: OutOfMemoryError: x |" in unranked
    assert f"| {ids[3]} | failed | killed without a result; derived from 3 logged steps" in unranked
    assert "| invalid |" in unranked and "| over_limit |" in unranked
    links = linked_files(page)
    assert {"throughput.png", "predicted_vs_measured.png", "all_trials_1nodes.csv",
            "optimal_config_241k_1nodes.yaml"} <= set(links)
    assert all((out / "final_results" / name).is_file() for name in links)
    trust = page.split("## How far to trust the plan")[1]
    assert "| step time |" in trust and "| 3 |" in trust
    assert "Calibrated on 3 trials: compute x" in trust and "in-sample" in trust
    # no confirmation round: the noise it ranked under, from the timed steps (standard deviation 0.3 x the median
    # over 7 timed steps each: 11.3% standard error a trial, 32.1% twice that of the difference, under the gap)
    assert ("Within its run a trial's timed steps varied by 30.0% (their standard deviation over the median step; "
            "the median of 3 trials, up to 30.0%). The top two are 33.3% apart, beyond the +-32.1%") in flat(head)
    assert "confirm_top=2 times the two fastest again" in head


def test_inference_report_picks_the_fastest_config_within_the_latency_bound(tmp_path):
    rows = [
        {"config_id": "gpt3_b1_tp1", "status": "ok", "tp": 1, "pp": 1, "batch_size": 1, "num_gpus": 1,
         "latency_ms_p50": 10.0, "latency_ms_p99": 12.0, "tokens_per_s_per_gpu": 800.0},
        {"config_id": "gpt3_b4_tp1", "status": "ok", "tp": 1, "pp": 1, "batch_size": 4, "num_gpus": 1,
         "latency_ms_p50": 30.0, "latency_ms_p99": 35.0, "tokens_per_s_per_gpu": 1000.0},
        {"config_id": "gpt3_b8_tp1", "status": "ok", "tp": 1, "pp": 1, "batch_size": 8, "num_gpus": 1,
         "latency_ms_p50": 90.0, "latency_ms_p99": 120.0, "tokens_per_s_per_gpu": 1500.0},  # over the bound
        {"config_id": "gpt3_b1_tp4", "status": "invalid", "tp": 4, "pp": 1, "batch_size": 1, "num_gpus": 4,
         "reason": "num_attention_heads=4 over tp=8"},
    ]
    frame = summary_frame(rows, max_latency_ms=100.0)
    page = write_inference_report(tmp_path, frame, 100.0).read_text()
    assert "**Pick: gpt3_b4_tp1**" in page and "p99 batch latency 35 ms (bound 100 ms)" in page
    assert "25.0% higher than the runner-up, gpt3_b1_tp1, on `tokens_per_s_per_gpu`" in page
    assert "| gpt3_b1_tp4 | invalid | num_attention_heads=4 over tp=8 |" in page
    assert "configs within the p99 latency bound first, each group highest first" in page
    ranked = page.split("## Ranked trials")[1]
    assert ranked.index("| gpt3_b4_tp1 |") < ranked.index("| gpt3_b1_tp1 |") < ranked.index("| gpt3_b8_tp1 |")
    assert "![" not in page  # no plot file beside it, so none linked


@pytest.mark.e2e
def test_a_real_tiny_search_writes_report_md_linking_only_files_it_wrote(readme_tiny_search):
    """A whole search (README's command, 2 trials on the local backend, then the same command again:
    tests/shared_searches.py's readme_tiny_search) writes report.md; every file it links exists and the memory
    rows compare like with like."""
    for run in readme_tiny_search.runs:  # the page as the second command rewrote it
        assert run.returncode == 0, run.output
    final = readme_tiny_search.final
    page = (final / "report.md").read_text()
    assert re.search(r"\*\*Pick: gpt3_241k_\w+\*\* — TP=", page)
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert set(images) == {"throughput.png", "predicted_vs_measured.png"}
    for name in linked_files(page):
        assert (final / name).stat().st_size > 0, name
    trust = page.split("## How far to trust the plan")[1]
    assert "| tensor memory, analytic | peak_tensor_memory_gib vs predicted_tensor_memory_gib |" in trust
    assert "process RSS, not comparable" in trust
    assert "Noise: no confirmation round (train_settings.confirm_top=0)" in page  # the CPU demo names its noise


def test_top_two_within_their_steps_spread_are_called_swappable():
    """Without a confirmation round, two trials 4% apart whose timed steps vary by 20% (10 steps each: 6.3% standard
    error a trial, 17.9% twice that of their difference) are within it: another run may swap them."""
    from hp_tool.results.report import noise_line

    ranked = pd.DataFrame({"trial_id": ["a", "b"], RANK_COLUMN: [1.0, 1.04], "measured_step_time_s": [1.0, 1.04],
                           "measured_step_time_std_s": [0.2, 0.208], "steps_measured": [10, 10],
                           "confirmed_step_time_s": [None, None]})
    line = noise_line(ranked)
    assert "varied by 20.0%" in line and "The top two are 4.0% apart, within the +-17.9%" in line
    assert "another run may swap them" in line


def one_trial_per_regime(out, plan, step_time_s) -> dict:
    """The first selected trial of each TP/PP regime measured ok, the i-th at ``step_time_s(i)``;
    {(tp, pp): trial id}."""
    by_regime = {}
    for spec in plan.specs:
        by_regime.setdefault((spec.parallel.tp, spec.parallel.pp), spec.trial_id)
    for i, tid in enumerate(by_regime.values()):
        write_ok(out, tid, step_time_s(i))
    return by_regime


def test_a_calibrated_step_error_fitted_exactly_is_not_shown_as_zero(tmp_path):
    """One measured trial per TP/PP regime: each regime's residual reproduces its trial, so a 0% calibrated
    error would claim a precision nobody measured."""
    app, out, plan = planned(tmp_path)
    by_regime = one_trial_per_regime(out, plan, lambda i: 0.3 + 0.1 * i)
    assert len(by_regime) >= 2 and finalize(out, app) == 0
    page = (out / "final_results" / "report.md").read_text()
    assert f"| {len(by_regime)} |" in page and "| exact by construction: one trial per regime |" in page
    write_ok(out, next(s.trial_id for s in plan.specs if s.trial_id not in by_regime.values()), 0.9)
    assert finalize(out, app) == 0  # a second trial in one regime: the calibrated error means something again
    assert "exact by construction" not in (out / "final_results" / "report.md").read_text()


def test_a_calibration_clamped_at_its_bounds_is_not_called_exact(tmp_path):
    """One trial per TP/PP regime, each measured thousands of times slower than predicted (a fault, not the
    cluster): the factors stop at their bound, the calibrated figures do not reproduce the trials, and the
    report says the fit was clamped instead of calling it exact."""
    app, out, plan = planned(tmp_path)
    by_regime = one_trial_per_regime(out, plan, lambda i: 5000.0 + 1000 * i)
    assert len(by_regime) >= 2 and finalize(out, app) == 0
    page = (out / "final_results" / "report.md").read_text()
    assert "exact by construction" not in page
    assert "clamped at a bound (x0.1-x10)" in page


def _confirm(out, trial_id, first, step_time_s):
    """The confirmation round's second run of a trial: its result.json in training_logs/<id>/confirm/."""
    from hp_tool.fsutil import atomic_write_json

    again = dict(first, step_time_s_median=step_time_s, step_time_s_mean=1.15 * step_time_s)
    atomic_write_json(out / "training_logs" / trial_id / "confirm" / "result.json", again)


def test_the_confirmation_round_ranks_the_top_trials_by_both_runs_and_says_when_they_are_tied(tmp_path, capsys):
    app, out, plan = planned(tmp_path)
    a, b, c = selected_ids(plan)[:3]
    first = {a: write_ok(out, a, 0.30), b: write_ok(out, b, 0.32)}
    write_ok(out, c, 0.40)
    # a was lucky on its first run: 0.30 then 0.40; b 0.32 then 0.31. On the mean of two runs b is faster.
    _confirm(out, a, first[a], 0.40)
    _confirm(out, b, first[b], 0.31)
    df = collect_trials(out)
    top = df[df["rank"].notna()].sort_values("rank")
    assert list(top["trial_id"])[:3] == [b, a, c]
    assert top.iloc[0]["confirmed_step_time_s"] < top.iloc[1]["confirmed_step_time_s"]
    assert top.iloc[1]["run_to_run_pct"] > 30 and pd.isna(top.iloc[2]["confirmed_step_time_s"])
    assert finalize(out, app) == 0
    page = (out / "final_results" / "report.md").read_text()
    printed = capsys.readouterr().out
    for text in (page, " ".join(printed.split())):
        assert f"Confirmation round: the 2 fastest trials timed again: {b} " in text
        assert "The top two are tied within noise:" in text and "either layout will do" in text
    assert f"**Pick: {b}**" in page


def test_a_confirmed_lead_beyond_the_run_to_run_spread_is_called_a_lead(tmp_path):
    app, out, plan = planned(tmp_path)
    a, b = selected_ids(plan)[:2]
    first = {a: write_ok(out, a, 0.30), b: write_ok(out, b, 0.32)}
    _confirm(out, a, first[a], 0.31)
    _confirm(out, b, first[b], 0.33)
    assert finalize(out, app) == 0
    page = (out / "final_results" / "report.md").read_text()
    assert f"{a} leads by " in page and "beyond the" in page and "tied within noise" not in page


def test_the_throughput_chart_draws_every_selected_trial_measured_or_predicted(finalized):
    """A trial without a measurement (never ran, failed) is drawn at its calibrated prediction, hollow; a measured
    one at its full-run figure; the chart's numbers come from the collector's columns."""
    from hp_tool.results.plots import full_run_tokens_per_gpu

    out = finalized.out
    df = collect_trials(out)
    selected = df[df["plan_status"] == "selected"]
    values, measured = full_run_tokens_per_gpu(selected)
    # 3 ran ok and one killed trial left timed steps: measured; the other selected ones predicted
    assert measured.sum() == 4 and set(selected.loc[measured, "status"]) == {"ok", "failed"} and values.notna().all()
    ok = measured
    assert (values[ok] == selected.loc[ok, "full_run_tokens_per_s_per_gpu"]).all()
    rest = selected[~ok]
    expected = rest["predicted_tokens_per_s_per_gpu"] * rest["predicted_step_time_s"] / rest["calibrated_step_time_s"]
    assert values[~ok].to_numpy() == pytest.approx(expected.to_numpy())
    assert (values[~ok] != rest["predicted_tokens_per_s_per_gpu"]).any()  # calibrated, not the raw plan figure


def test_the_optimal_configs_header_names_every_dimension_the_pick_sets():
    """The optimal config's header names the pick's layout as the "Recommended:" sentence does (the dimension
    table's words): a LoRA fine-tuning pick names its method and rank, its sequence length and its context
    parallelism, which the header once left out; a dense model's experts (a missing value) are not named."""
    import pandas as pd

    from hp_tool.contracts.spec import LoraSpec, ModelSpec, TrialSpec
    from hp_tool.results.optimal import _header

    best = pd.Series(dict(seq_length=4096, method="lora", lora_rank=16, tp=1, pp=1, dp=4, ep=pd.NA, cp=2, mbs=1,
                          act_ckpt_layers=32, engine="torch", zero_stage=3, offload="none", days_to_train=0.5,
                          full_run_cost_usd=float("nan"), measured_step_time_s=1.5, full_run_step_time_s=1.6))
    spec = TrialSpec(model=ModelSpec("llama", 2, 64, 4, 4, 176, 512, 4096, hf_config={"model_type": "llama"},
                                     method="lora", lora=LoraSpec(16, 32.0, 0.0, ["q_proj"])))
    line = next(x for x in _header(spec, best, 3, "").splitlines() if x.startswith("# Full run:"))
    assert line == ("# Full run: 1 node(s) x 1 GPUs: 4096 tokens per sequence, LoRA rank 16, TP=1, PP=1, DP=4, CP=2, "
                    "MBS=1, 32 checkpointed layers per stage, torch engine, ZeRO-3, global batch 8.")
