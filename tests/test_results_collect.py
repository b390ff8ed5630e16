"""Collecting a results directory: ranking by the named full-run column, every candidate accounted for,
killed and corrupt trials, and days and cost against numbers worked out by hand."""

import csv
import json
import random

import pytest
from test_results_helpers import planned, selected_ids, trial_dir, write_failed, write_metrics, write_ok

from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.speed import dp_comm_s, extrapolate_step_time_s
from hp_tool.results.collect import RANK_COLUMN, collect_trials, full_run_for, read_plan, successful


def test_rank_follows_measured_speed_not_any_file_or_plan_order(tmp_path):
    _, out, plan = planned(tmp_path)
    ids = selected_ids(plan)  # predicted fastest first
    rng = random.Random(7)
    times = {tid: 0.1 * (i + 1) for i, tid in enumerate(rng.sample(ids, len(ids)))}
    true_order = sorted(ids, key=times.get)
    plan_csv_order = [line.split(",")[0] for line in
                      (out / "candidate_configs" / "plan.csv").read_text().splitlines()[1:]]
    plan_csv_order = [t for t in plan_csv_order if t in times]
    # written slowest first, so creation order is the reverse of the answer too
    for tid in sorted(ids, key=times.get, reverse=True):
        write_ok(out, tid, times[tid])
    dir_order = [p.name for p in (out / "training_logs").iterdir()]
    for other in (ids, sorted(ids), plan_csv_order, dir_order, list(reversed(true_order))):
        assert other != true_order  # any positional mix-up would show

    df = collect_trials(out)
    ranked = successful(df)
    assert list(ranked["trial_id"]) == true_order
    assert list(ranked["rank"]) == list(range(1, len(ids) + 1))
    assert list(ranked[RANK_COLUMN]) == sorted(times.values())
    assert list(df["trial_id"][: len(ids)]) == true_order  # the table itself starts with the ranking


def test_rank_uses_full_run_step_time_with_extrapolated_communication(tmp_path):
    # 4 nodes of 2 processes; trials run on 1 node, so the full run adds inter-node DP communication
    _, out, plan = planned(tmp_path, "search_config.train_settings.num_nodes=4",
                           "search_config.train_settings.global_batch_size=32",
                           "gpu.inter_node_bandwidth_gbps=0.01", "search_config.train_settings.act_ckpt_modes=[full]")
    full = full_run_for(out)
    a, b = "gpt3_241k_tp1_pp1_mbs4_ac0_torch_z0_noff", "gpt3_241k_tp2_pp1_mbs4_ac0_torch_z0_noff"  # full DP 8 and 4
    assert {a, b} <= set(selected_ids(plan))

    def extra(tp, trial_dp, dp):
        lay = lambda d: Layout.of(tp=tp, pp=1, dp=d, mbs=4, act_ckpt_layers=0, global_batch_size=32 // dp * d, zero_stage=0)  # noqa: E731
        return dp_comm_s(full.shape, lay(dp), full.hw, 4) - dp_comm_s(full.shape, lay(trial_dp), full.hw, 1)

    extra_a, extra_b = extra(1, 2, 8), extra(2, 1, 4)
    assert extra_a > 0 and extra_b > 0 and abs(extra_a - extra_b) > 1e-3
    # the one the full run slows more runs faster in the trial, by half the difference: the ranking flips
    (more, trial_dp, full_dp, tp), less = ((a, 2, 8, 1), b) if extra_a > extra_b else ((b, 1, 4, 2), a)
    write_ok(out, more, 1.0)
    write_ok(out, less, 1.0 + abs(extra_a - extra_b) / 2)
    ranked = successful(collect_trials(out))
    assert list(ranked["trial_id"][:2]) == [less, more]
    row = ranked.set_index("trial_id").loc[more]
    hw = Hardware(2, 4.0, full.hw.peak_tflops, full.hw.intra_node_bandwidth_gbps, 0.01, 0.0, **full.hw.efficiency(),
                  memory_bandwidth_gbps=full.hw.memory_bandwidth_gbps, device_is_host=full.hw.device_is_host)
    expected = extrapolate_step_time_s(1.0, full.shape, Layout.of(tp=tp, pp=1, dp=trial_dp, mbs=4, act_ckpt_layers=0, global_batch_size=32 // full_dp * trial_dp, zero_stage=0),
                                       Layout.of(tp=tp, pp=1, dp=full_dp, mbs=4, act_ckpt_layers=0, global_batch_size=32, zero_stage=0), hw, 1, 4)
    assert row[RANK_COLUMN] == pytest.approx(expected) and row["measured_step_time_s"] == 1.0


def test_days_and_cost_match_hand_computation(tmp_path):
    _, out, _ = planned(tmp_path, "gpu.price_per_gpu_hour=2.0")
    tid = "gpt3_241k_tp1_pp1_mbs4_ac0_torch_z0_noff"
    write_ok(out, tid, 0.5)
    row = collect_trials(out).set_index("trial_id").loc[tid]
    # full run: 1 node x 2 GPUs, GBS 8 x seq 128, 976 steps (1e6 tokens / 1024 per step); trial = full run
    assert row["num_gpus"] == 2 and row[RANK_COLUMN] == 0.5
    assert row["days_to_train"] == pytest.approx(976 * 0.5 / 86400)  # 0.0056481 days
    assert row["full_run_cost_usd"] == pytest.approx(2.0 * 2 * 976 * 0.5 / 3600)  # $0.54222
    # $/M tokens = (2.0 $/GPU-h * 2 GPUs) / (1024 tokens / 0.5 s * 3600 s / 1e6) = 4.0 / 7.3728
    assert row["cost_usd_per_million_tokens"] == pytest.approx(0.5425347222)
    assert row["full_run_tokens_per_s"] == pytest.approx(2048.0)
    assert row["full_run_tokens_per_s_per_gpu"] == pytest.approx(1024.0)


def test_cost_columns_empty_without_a_price(tmp_path):
    _, out, _ = planned(tmp_path)
    write_ok(out, "gpt3_241k_tp1_pp1_mbs4_ac0_torch_z0_noff", 0.5)
    row = successful(collect_trials(out)).iloc[0]
    assert row["days_to_train"] > 0
    assert row.isna()["full_run_cost_usd"] and row.isna()["cost_usd_per_million_tokens"]


def test_every_candidate_has_a_status_and_reason(tmp_path):
    _, out, plan = planned(tmp_path, "search_config.train_settings.limit_search_runs=3")
    ids = selected_ids(plan)
    write_ok(out, ids[0], 0.2)
    df = collect_trials(out).set_index("trial_id")
    assert len(df) == len(plan.candidates) and df.index.is_unique
    assert set(df["status"]) == {"ok", "not_run", "over_limit", "invalid"}
    for tid in ids[1:]:
        assert df.loc[tid, "status"] == "not_run" and "never ran" in df.loc[tid, "reason"]
    others = df[df["plan_status"] != "selected"]
    assert (others["status"] == others["plan_status"]).all() and others["reason"].str.len().gt(0).all()


def test_killed_trial_is_derived_from_its_metrics(tmp_path):
    _, out, plan = planned(tmp_path)
    killed, late, ok = selected_ids(plan)[:3]
    write_metrics(out, killed, [0.9, 0.30, 0.20, 0.25], torn_tail=True)
    write_metrics(out, late, [0.9, 0.3, 0.3], interval_s=85.0)  # log spans 170.9 s of a 180 s box
    write_ok(out, ok, 0.5)
    df = collect_trials(out, time_box_s=180.0).set_index("trial_id")
    row = df.loc[killed]
    assert row["status"] == "failed"
    assert row["reason"] == "killed without a result; derived from 4 logged steps, 1 unreadable line(s)"
    assert row["measured_step_time_s"] == pytest.approx(0.25)  # median of the timed steps only
    assert row["steps_measured"] == 3 and row["steps_run"] == 4
    assert row["peak_memory_gib"] == pytest.approx(0.54)
    assert row["tokens_per_s_per_gpu"] > 0 and row[RANK_COLUMN] > 0 and row.isna()["rank"]
    assert df.loc[late, "status"] == "timeout"
    assert list(successful(df.reset_index())["trial_id"]) == [ok]


def test_corrupt_and_partial_results_fail_with_reason_and_the_rest_is_collected(tmp_path):
    _, out, plan = planned(tmp_path)
    broken, partial, listed, bad_status, good, oom = selected_ids(plan)[:6]
    (trial_dir(out, broken) / "result.json").write_text('{"status": "ok", "step_time')
    (trial_dir(out, partial) / "result.json").write_text(json.dumps({"status": "ok"}))
    (trial_dir(out, listed) / "result.json").write_text("[1, 2]")
    (trial_dir(out, bad_status) / "result.json").write_text(json.dumps({"status": "done", "reason": "?"}))
    write_ok(out, good, 0.4)
    write_failed(out, oom, "oom", "rank 0: OutOfMemoryError: CUDA out of memory\nTraceback ...")
    df = collect_trials(out).set_index("trial_id")
    assert df.loc[broken, "status"] == "failed" and "unreadable" in df.loc[broken, "reason"]
    assert "no positive step_time_s_median" in df.loc[partial, "reason"]
    assert "holds a list" in df.loc[listed, "reason"]
    assert "no valid status" in df.loc[bad_status, "reason"] and "it said: ?" in df.loc[bad_status, "reason"]
    assert df.loc[oom, "status"] == "oom"
    assert df.loc[oom, "reason"] == "rank 0: OutOfMemoryError: CUDA out of memory (traceback in result.json)"
    assert list(successful(df.reset_index())["trial_id"]) == [good]


def test_result_with_launcher_verdict_keeps_status_and_gains_logged_timing(tmp_path):
    _, out, plan = planned(tmp_path)
    tid = selected_ids(plan)[0]
    write_failed(out, tid, "timeout", "SLURM TIMEOUT")
    write_metrics(out, tid, [1.0, 0.4, 0.6])
    row = collect_trials(out).set_index("trial_id").loc[tid]
    assert (row["status"], row["reason"]) == ("timeout", "SLURM TIMEOUT")
    assert row["measured_step_time_s"] == pytest.approx(0.5) and row.isna()["rank"]


def test_trial_directory_outside_the_plan_is_shown_not_ranked(tmp_path):
    _, out, plan = planned(tmp_path)
    write_ok(out, selected_ids(plan)[0], 0.3)
    stray = trial_dir(out, "gpt3_241k_tp8_pp1_mbs1_ac0_torch_z0_noff")
    (stray / "result.json").write_text(json.dumps({"status": "ok", "step_time_s_median": 0.01}))
    df = collect_trials(out).set_index("trial_id")
    assert df.loc[stray.name, "plan_status"] == "not_in_plan" and df.isna().loc[stray.name, "rank"]
    assert "not in candidate_configs/plan.csv" in df.loc[stray.name, "reason"]
    assert successful(df.reset_index())["trial_id"].tolist() == [selected_ids(plan)[0]]


def test_measured_trials_calibrate_every_candidates_prediction(tmp_path):
    """all_trials shows the raw and the calibrated prediction: trials measured 1.7x slower than predicted
    move every prediction, run or not, by the same factor; memory by the median measured gap."""
    _, out, plan = planned(tmp_path)
    ids = selected_ids(plan)
    predicted = {r["trial_id"]: r for r in read_plan(out)}
    measured, unmeasured = ids[:-2], ids[-2:]
    for i, tid in enumerate(measured):
        p = predicted[tid]
        write_ok(out, tid, 1.7 * p["predicted_step_time_s"] * (1.01 if i % 2 else 0.99),
                 peak_memory_gib=p["predicted_memory_gib"] + 0.25)
    df = collect_trials(out).set_index("trial_id")
    for tid in unmeasured:
        row = df.loc[tid]
        assert row["status"] == "not_run"
        assert row["calibrated_step_time_s"] == pytest.approx(1.7 * row["predicted_step_time_s"], rel=0.02)
        assert row["calibrated_memory_gib"] == pytest.approx(row["predicted_memory_gib"] + 0.25, abs=1e-6)
    ran = df.loc[measured]
    assert (ran["calibrated_step_time_error_pct"].abs() < 2).all()
    assert (ran["step_time_error_pct"] > 60).all()  # the raw prediction, kept beside it


def test_tensor_peak_is_set_against_the_predictions_without_the_overhead(tmp_path):
    """On CPU a trial's peak_memory_gib is the process RSS; its tensor peak is what the analytic and traced
    figures predict once the preset's overhead (0.5 GiB for gpu=cpu) is left out of them."""
    _, out, plan = planned(tmp_path)
    tid = selected_ids(plan)[0]
    set_traced(out, tid, 0.55)  # as memory_check=traced writes it: tensors + overhead
    p = {r["trial_id"]: r for r in read_plan(out)}[tid]
    tensors = 1.1 * (p["predicted_memory_gib"] - 0.5)  # 10% above the analytic tensor figure
    write_ok(out, tid, 0.3, peak_memory_gib=0.45, peak_tensor_memory_gib=tensors)
    row = collect_trials(out, memory_overhead_gib=0.5).set_index("trial_id").loc[tid]
    assert row["predicted_tensor_memory_gib"] == pytest.approx(p["predicted_memory_gib"] - 0.5)
    assert row["traced_tensor_memory_gib"] == pytest.approx(0.05)
    assert row["tensor_memory_error_pct"] == pytest.approx(10.0)
    assert row["traced_tensor_memory_error_pct"] == pytest.approx(100 * (tensors / 0.05 - 1))
    assert row["memory_error_pct"] == pytest.approx(100 * (0.45 / p["predicted_memory_gib"] - 1))  # RSS, apart
    unknown = collect_trials(out).set_index("trial_id").loc[tid]  # overhead not given: nothing to compare
    assert unknown.isna()["predicted_tensor_memory_gib"] and unknown.isna()["tensor_memory_error_pct"]


def set_traced(out, trial_id: str, gib: float) -> None:
    """plan.csv with ``trial_id``'s traced_memory_gib set, as a traced plan writes it."""
    path = out / "candidate_configs" / "plan.csv"
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        fields, rows = reader.fieldnames, list(reader)
    for row in rows:
        if row["trial_id"] == trial_id:
            row["traced_memory_gib"] = str(gib)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def test_a_killed_trial_with_a_phase_log_says_where_it_was(tmp_path):
    """The collector's own verdict on a trial killed without result.json (e.g. its orchestrator died too)
    leads with the phase the trial was in when its last line was written."""
    import json as _json

    from hp_tool.contracts import phases

    _, out, plan = planned(tmp_path)
    killed = selected_ids(plan)[0]
    write_metrics(out, killed, [0.9, 0.30, 0.20])
    lines = [("start", "imports", 0.0), ("imports", "distributed_init", 4.0), ("distributed_init", "model_build", 5.0),
             ("model_build", "weights", 6.0), ("weights", "optimizer", 9.0), ("optimizer", "first_forward", 10.0),
             ("first_forward", "first_backward", 11.0), ("first_backward", "first_step", 12.0)]
    rows = [{"phase": p, "next": n, "time": t} for p, n, t in lines] + \
        [{"phase": "first_step" if s == 1 else "step", "next": "step", "time": 12.0 + s, "step": s} for s in (1, 2, 3)]
    (out / "training_logs" / killed / phases.file_name(0)).write_text("".join(_json.dumps(r) + "\n" for r in rows))
    row = collect_trials(out, time_box_s=180.0).set_index("trial_id").loc[killed]
    assert row["status"] == "failed"
    assert row["reason"] == ("killed without a result; derived from 3 logged steps; failed in step 4 after 15 s; "
                             "imports 4 s, distributed init 1 s, model build 1 s, weight initialisation / loading 3 s, "
                             "optimizer build 1 s, first forward 1 s, first backward 1 s, first optimizer step 1 s")
