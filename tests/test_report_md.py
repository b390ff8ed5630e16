"""report.md rendered from hand-made inputs: the pick and why, the lead over the runner-up on the ranking
column, the ranked table, every plot linked, what did not run and why, the trust table; empty and partial
searches."""

import re

from hp_tool.results.report_md import (MAX_UNRANKED_ROWS, ModelError, Pick, Plot, RankMetric, ReportInputs,
                                       Unranked, lead_pct, render_report)

STEP = RankMetric("full_run_step_time_s", "full-run step time", "s", "median")
COLUMNS = ("rank", "trial_id", "full_run_step_time_s", "measured_step_time_mean_s")
FAST = Pick("gpt3_tp1_pp1_mbs4", "TP=1, PP=1, DP=2, MBS=4", 0.30, peak_memory_gib=1.25, memory_limit_gib=4.0,
            predicted_rank=3, candidates=12)
SECOND = Pick("gpt3_tp1_pp2_mbs2", "TP=1, PP=2, DP=1, MBS=2", 0.40, peak_memory_gib=1.0, memory_limit_gib=4.0)


def inputs(**changes) -> ReportInputs:
    base = dict(
        title="gpt3 tiny on 1 node(s)", metric=STEP, columns=COLUMNS,
        ranked=({"rank": 1, "trial_id": FAST.name, "full_run_step_time_s": 0.30, "measured_step_time_mean_s": 0.345},
                {"rank": 2, "trial_id": SECOND.name, "full_run_step_time_s": 0.40, "measured_step_time_mean_s": 0.46}),
        pick=FAST, runner_up=SECOND,
        unranked=(Unranked("gpt3_tp2_pp1_mbs4", "oom", "rank 0: OutOfMemoryError: | tried 2 GiB"),
                  Unranked("gpt3_tp2_pp2_mbs1", "skipped", "predicted 0.9 s, 2.2x the best measured"),
                  Unranked("gpt3_tp4_pp1_mbs1", "invalid", "num_attention_heads=4 over tp=8")),
        plots=(Plot("throughput.png", "Throughput"), Plot("predicted_vs_measured.png", "Predicted vs measured")),
        counts="2 of 4 selected trials succeeded (1 oom, 1 skipped, 2 ok).",
        errors=(ModelError("step time", "full vs predicted", 2, 41.5, 3.25),
                ModelError("tensor memory, traced", "tensor peak vs traced", 2, 7.0)),
        trust_note="Calibrated predictions are fitted in-sample.",
        files=("final_summary_1nodes.csv", "all_trials_1nodes.csv"))
    base.update(changes)
    return ReportInputs(**base)


def section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_headline_names_the_pick_its_lead_basis_and_headroom():
    text = render_report(inputs())
    head = text.split("## ")[0]
    assert "**Pick: gpt3_tp1_pp1_mbs4** — TP=1, PP=1, DP=2, MBS=4." in head
    # 0.40 / 0.30 - 1 = 33.3% faster; the runner-up's time is 25% longer, not 25% faster
    assert "33.3% faster than the runner-up, gpt3_tp1_pp2_mbs2, on `full_run_step_time_s`" in head
    assert "(full-run step time, median-based)" in head and "0.3 s against 0.4 s" in head
    assert "fits with 2.75 GiB headroom" in head and "1.25 GiB of 4 GiB per GPU" in head
    assert "predicted it 3rd of 12" in head
    assert "within a rerun's noise" not in head


def test_a_mean_based_rate_ranks_higher_first():
    rate = RankMetric("tokens_per_s_per_gpu", "tokens/s per GPU", "tokens/s", "mean", lower_is_better=False)
    fast, slow = Pick("a", "TP=1", 1500.0), Pick("b", "TP=2", 1200.0)
    assert lead_pct(rate, fast, slow) == 25.0
    text = render_report(inputs(metric=rate, pick=fast, runner_up=slow, ranked=()))
    assert "25.0% higher than the runner-up, b, on `tokens_per_s_per_gpu` (tokens/s per GPU, mean-based)" in text
    assert "from the mean of the timed steps): highest first." in text


def test_a_near_tie_says_so_and_names_the_runner_up_layout():
    close = Pick("gpt3_tp1_pp2_mbs2", "TP=1, PP=2, DP=1, MBS=2", 0.303)
    text = render_report(inputs(runner_up=close))
    assert "1.0% faster" in text and "within a rerun's noise" in text and "TP=1, PP=2, DP=1, MBS=2" in text


def test_memory_over_the_limit_is_not_called_a_fit():
    tight = Pick("x", "TP=1", 0.3, peak_memory_gib=4.5, memory_limit_gib=4.0)
    text = render_report(inputs(pick=tight, runner_up=None))
    assert "does NOT fit: short by 0.50 GiB" in text and "the only trial ranked" in text


def test_ranked_table_keeps_the_order_and_both_statistics():
    body = section(render_report(inputs()), "Ranked trials")
    rows = [line for line in body.splitlines() if line.startswith("| ") and "trial_id" not in line]
    assert rows[0] == "| 1 | gpt3_tp1_pp1_mbs4 | 0.3 | 0.345 |"
    assert rows[1] == "| 2 | gpt3_tp1_pp2_mbs2 | 0.4 | 0.46 |"
    assert ("Ranked by `full_run_step_time_s` (full-run step time in s, from the median of the timed steps): "
            "lowest first.") in body


def test_every_plot_is_embedded_with_a_relative_link():
    text = render_report(inputs())
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links == ["throughput.png", "predicted_vs_measured.png"]
    assert "[all_trials_1nodes.csv](all_trials_1nodes.csv)" in text


def test_skipped_pruned_and_failed_with_reasons():
    body = section(render_report(inputs()), "Skipped, pruned and failed")
    assert "3 without a rank (1 oom, 1 skipped, 1 invalid)" in body
    assert "| gpt3_tp2_pp2_mbs1 | skipped | predicted 0.9 s, 2.2x the best measured |" in body
    assert "OutOfMemoryError: \\| tried 2 GiB" in body  # a pipe in a reason cannot split the row


def test_trust_table_sets_calibrated_beside_raw():
    body = section(render_report(inputs()), "How far to trust the plan")
    assert "| step time | full vs predicted | 2 | 41.5% | 3.2% |" in body
    assert "| tensor memory, traced | tensor peak vs traced | 2 | 7.0% |  |" in body
    assert "fitted in-sample" in body


def test_a_search_with_nothing_ranked_yet():
    pending = (Unranked(f"t{i}", "not_run", "never ran, or still pending") for i in range(3))
    text = render_report(inputs(ranked=(), pick=None, runner_up=None, unranked=tuple(pending), plots=(),
                                errors=(ModelError("step time", "x", 0, None, None),),
                                counts="0 of 3 selected trials succeeded (3 not_run)."))
    assert "**No pick yet**" in text and "Pick:" not in text
    assert "No trial is ranked yet." in text and "3 without a rank (3 not_run)" in text
    assert "Nothing was measured yet" in text and "## Plots" not in text and "![" not in text


def test_every_candidate_ranked_says_so():
    text = render_report(inputs(unranked=()))
    assert "Every candidate ran and is ranked." in section(text, "Skipped, pruned and failed")


def test_a_large_grid_lists_the_first_unranked_and_counts_the_rest():
    reason = "TP*PP=4 does not divide the 2 GPUs"
    many = tuple(Unranked(f"c{i}", "invalid", reason) for i in range(MAX_UNRANKED_ROWS + 7))
    body = section(render_report(inputs(unranked=many)), "Skipped, pruned and failed")
    assert f"{MAX_UNRANKED_ROWS + 7} without a rank ({MAX_UNRANKED_ROWS + 7} invalid)" in body
    assert f"| c{MAX_UNRANKED_ROWS - 1} | invalid |" in body and f"| c{MAX_UNRANKED_ROWS} |" not in body
    assert "... and 7 more, each with its reason in the all-trials CSV." in body


def test_a_lead_of_several_times_reads_as_a_ratio_not_hundreds_of_percent():
    slow = Pick("gpt3_tp2_pp1_mbs1", "TP=2, PP=1, DP=1, MBS=1", 2.16)  # 7.2x the pick's 0.30 s
    text = render_report(inputs(runner_up=slow))
    assert "7.2x faster than the runner-up, gpt3_tp2_pp1_mbs1" in text and "620.0%" not in text
    rate = RankMetric("tokens_per_s_per_gpu", "tokens/s per GPU", "tokens/s", "mean", lower_is_better=False)
    text = render_report(inputs(metric=rate, pick=Pick("a", "TP=1", 3000.0), runner_up=Pick("b", "TP=2", 1000.0),
                                ranked=()))
    assert "3x higher than the runner-up, b" in text
