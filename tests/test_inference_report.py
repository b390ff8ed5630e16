"""Inference summary: latency statistics, the latency filter, CSV schema and ranking, Pareto front, plot."""

from __future__ import annotations

import pandas as pd
import pytest

from hp_tool.inference import report


def row(cid, status="ok", p99=None, per_gpu=None, reason=None):
    return {"config_id": cid, "status": status, "tp": 1, "pp": 1, "batch_size": 1, "num_gpus": 1,
            "latency_ms_p50": p99, "latency_ms_p95": p99, "latency_ms_p99": p99,
            "time_to_first_token_ms": None if p99 is None else p99 / 10, "tokens_per_s_per_gpu": per_gpu,
            "reason": reason}


def test_percentiles_and_throughput():
    assert report.percentile([4, 1, 3, 2], 50) == 2.5
    assert report.percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    stats = report.latency_stats([0.1, 0.2, 0.3], [0.01, 0.02, 0.03], batch=4, new_tokens=8, gpus=2)
    assert stats["latency_ms_p50"] == pytest.approx(200)
    assert stats["time_to_first_token_ms"] == pytest.approx(20)
    assert stats["samples_per_s"] == pytest.approx(20)
    assert stats["tokens_per_s"] == pytest.approx(160)
    assert stats["tokens_per_s_per_gpu"] == pytest.approx(80)


def test_latency_filter():
    assert report.meets_bound({"status": "ok", "latency_ms_p99": 100.0}, 100.0)
    assert not report.meets_bound({"status": "ok", "latency_ms_p99": 100.1}, 100.0)
    assert not report.meets_bound({"status": "failed", "latency_ms_p99": 1.0}, 100.0)
    assert not report.meets_bound({"status": "ok", "latency_ms_p99": None}, 100.0)


def test_ranking_puts_configs_within_the_bound_first_by_throughput(tmp_path):
    rows = [row("slow_fast", p99=500, per_gpu=900), row("a", p99=50, per_gpu=100),
            row("b", p99=90, per_gpu=300), row("dead", "oom", reason="rank 0: OutOfMemoryError"),
            row("c", p99=80, per_gpu=200), row("bad", "invalid", reason="TP=3 does not divide")]
    frame = report.summary_frame(rows, max_latency_ms=100)
    assert list(frame["config_id"]) == ["b", "c", "a", "slow_fast", "dead", "bad"]
    assert list(frame["meets_latency_bound"]) == [True, True, True, False, False, False]
    path = report.write_summary_csv(frame, tmp_path / "final_output.csv")
    text = path.read_text()
    assert "None" not in text and "nan" not in text.lower()
    back = pd.read_csv(path)
    assert tuple(back.columns) == report.SUMMARY_COLUMNS
    dead = back[back["config_id"] == "dead"].iloc[0]
    assert dead["status"] == "oom" and "OutOfMemoryError" in dead["reason"] and pd.isna(dead["latency_ms_p99"])
    assert back["config_id"].head(2).tolist() == ["b", "c"]  # top_n=2 = the two best within the bound


def test_pareto_front_and_plot(tmp_path):
    points = [(10, 100), (20, 300), (15, 50), (30, 250)]
    assert report.pareto_front(points) == [0, 1]
    frame = report.summary_frame([row(f"gpt3_x_c{i}", p99=lat, per_gpu=thr) for i, (lat, thr) in
                                  enumerate(points)], max_latency_ms=25)
    png = report.plot_latency_vs_throughput(frame, 25, tmp_path / "plot.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    failed = report.summary_frame([row("x", "failed")], 25)
    assert report.plot_latency_vs_throughput(failed, 25, tmp_path / "none.png") is None
