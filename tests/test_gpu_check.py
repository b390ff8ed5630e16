"""benchmarks/gpu_check.py without running a search: the CLI runs it builds (every override composes into a
valid config), the tables it reads from the searches' CSVs (each column by name), the tally that sets its
exit code, and the page. The rehearsal itself (python3 benchmarks/gpu_check.py --rehearse) trains for real
and takes about 5-10 minutes on 2 CPU cores, so no test runs it."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config

REPO = Path(__file__).resolve().parent.parent
TS, IS = "search_config.train_settings", "search_config.inference_settings"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


gc = load_gpu_check()


def by_name(searches) -> dict:
    return {s.name: s for s in searches}


def value(search, key: str) -> str:
    """The value ``search`` gives ``key`` (exactly one override sets it)."""
    found = [o.split("=", 1)[1] for o in search.overrides if o.split("=", 1)[0] == key]
    assert len(found) == 1, (key, search.overrides)
    return found[0]


def test_a_gpu_check_runs_full_adapters_and_inference_on_one_gpu_of_the_7b_shape(tmp_path):
    runs = by_name(gc.searches("h200", tmp_path))
    assert list(runs) == ["adapters", "recipe", "inference", "full"]  # the offloaded full trial, most host RAM, last
    full, adapters, inference = runs["full"], runs["adapters"], runs["inference"]
    for s in runs.values():
        assert value(s, "gpu") == "h200" and value(s, "cluster") == "local"
        assert value(s, f"{TS}.gpus_per_node") == "1" and value(s, f"{TS}.num_nodes") == "1"
        assert value(s, "base_results_dir") == str(tmp_path / s.name)
        assert s.argv()[:2] == ["python3", "main.py"]
    assert value(full, "search_config") == value(adapters, "search_config") == "finetune/llama2_7b"
    assert value(full, f"{TS}.methods") == "[full]" and value(full, f"{TS}.zero_stages") == "[3]"
    assert value(full, f"{TS}.offload") == "[none,optimizer,optimizer_and_params]"
    assert value(full, f"{TS}.micro_batch_sizes") == "[2]" and value(full, f"{TS}.act_ckpt_layers") == "[32]"
    assert value(adapters, f"{TS}.methods") == "[lora,qlora]"
    assert value(adapters, f"{TS}.micro_batch_sizes") == "[2,8]" and value(adapters, f"{TS}.act_ckpt_layers") == "[0]"
    assert not any(o.startswith(f"{TS}.precision=") for o in adapters.overrides)  # the GPU's own: bf16
    for s in (full, adapters):
        assert value(s, f"{TS}.search_strategy") == "exhaustive" and value(s, f"{TS}.max_steps_per_run") == "6"
        assert value(s, f"{TS}.max_minutes_per_run") == "3" and value(s, f"{TS}.seq_lengths") == "[2048]"
    assert inference.inference and value(inference, "search_config") == "llama/llama2_7b"
    assert value(inference, "run_training_hp_search") == "false"
    assert value(inference, "run_inference_hp_search") == "true"
    assert value(inference, f"{IS}.max_batch_sizes") == "[1,16]"
    assert value(inference, f"{IS}.tensor_parallel_sizes") == "[1]"


@pytest.mark.parametrize("gpu, model", [("h100_80gb", "qwen3_0_6b"), ("cpu", "tiny")])
def test_the_recipe_search_crosses_fp8_and_compile_on_full_fine_tuning_one_gpu_trains_whole(gpu, model, tmp_path):
    """fp8 linears and torch.compile each on and off (4 layouts), full fine-tuning without offload; on an H100 all
    four are valid, on CPU the fp8 ones are refused (no fp8 tensor cores) and the compiled one runs."""
    from hp_tool.planner import make_plan

    recipe = by_name(gc.searches(gpu, tmp_path))["recipe"]
    assert value(recipe, "search_config") == "finetune/custom"
    assert value(recipe, "search_config.model.hf_config") == model
    assert value(recipe, f"{TS}.fp8") == "[false,true]" and value(recipe, f"{TS}.compile") == "[false,true]"
    assert value(recipe, f"{TS}.methods") == "[full]" and value(recipe, f"{TS}.offload") == "[none]"
    app = to_app_config(compose(list(recipe.overrides))[0])
    rows = [c for c in make_plan(app, "recipe", tmp_path).candidates if c.status != "invalid"]
    both = {(False, False), (False, True), (True, False), (True, True)}
    assert {(c.full.fp8, c.full.compile) for c in rows} == (both if gpu != "cpu" else {(False, False), (False, True)})


def test_the_rehearsal_is_the_same_check_on_cpu_with_the_tiny_model(tmp_path):
    runs = by_name(gc.searches("cpu", tmp_path, minutes_per_trial=3))
    assert value(runs["full"], "search_config") == "finetune/tiny"
    assert value(runs["inference"], "search_config") == "llama/tiny"  # the same shape (4 layers, hidden 64)
    assert value(runs["full"], f"{TS}.act_ckpt_layers") == "[4]"  # every layer, as at 7B
    assert value(runs["adapters"], f"{TS}.precision") == "bf16"  # QLoRA is refused in tiny's fp32
    assert not any(o.startswith(f"{TS}.precision=") for o in runs["full"].overrides)
    assert all(value(s, f"{TS}.max_minutes_per_run") == "3" and value(s, "gpu") == "cpu" for s in runs.values())
    assert [s.name for s in gc.searches("h100_80gb", tmp_path)] == list(runs)


def test_the_offloaded_layouts_are_planned_for_the_host_the_check_runs_on(tmp_path):
    host = gc.Host(ram_gib=125.84, cpu_threads=16)
    for s in gc.searches("h100_80gb", tmp_path, host=host):
        assert value(s, "gpu.host_ram_gib") == "125.8" and value(s, "gpu.host_cpu_cores") == "16"
        app = to_app_config(compose(list(s.overrides))[0])
        assert (app.gpu.host_ram_gib, app.gpu.host_cpu_cores) == (125.8, 16)
    assert not any(o.startswith("gpu.host") for s in gc.searches("h100_80gb", tmp_path) for o in s.overrides)
    mine = gc.this_host()
    assert mine.cpu_threads == os.cpu_count() and 0.1 < mine.ram_gib < 1e5


def test_a_results_folder_inside_the_repository_is_shown_relative_to_it():
    s = by_name(gc.searches("h200", gc.REPO / "results" / "gpu_check" / "h200"))["full"]
    assert value(s, "base_results_dir") == "results/gpu_check/h200/full"


@pytest.mark.parametrize("gpu", ["h200", "h100_80gb", "cpu"])
def test_every_override_composes_into_a_valid_config(gpu, tmp_path):
    for s in gc.searches(gpu, tmp_path):
        cfg, name = compose(list(s.overrides))
        app = to_app_config(cfg)
        assert name == s.search_config and app.gpu.name == gpu
        assert app.search_config.train_settings.gpus_per_node == 1
        assert app.run_inference_hp_search == s.inference


def row(**cells) -> dict:
    """A CSV row as csv.DictReader gives it: every value a string, empty when not measured."""
    return {k: "" if v is None else str(v) for k, v in cells.items()}


TRAINING = [
    row(trial_id="t_ok", method="full", zero_stage=3, offload="none", mbs=2, act_ckpt_layers=32, fp8=True,
        compile=False, status="ok", predicted_step_time_s=1.5, measured_step_time_s=2.25, step_time_error_pct=50.0,
        predicted_memory_gib=100.0, traced_memory_gib=120.5, peak_memory_gib=110.25,
        predicted_tensor_memory_gib=90.0, traced_tensor_memory_gib=95.5, peak_tensor_memory_gib=99.75,
        mfu=0.4321, predicted_tokens_per_s_per_gpu=12000, tokens_per_s_per_gpu=8000, reason=None),
    row(trial_id="t_off", method="full", zero_stage=3, offload="optimizer_and_params", mbs=1, act_ckpt_layers=32,
        fp8=False, compile=False, status="timeout", predicted_step_time_s=6.0, measured_step_time_s=None,
        step_time_error_pct=None,
        predicted_memory_gib=5.0, traced_memory_gib=None, peak_memory_gib=None, mfu=None,
        reason="reached max_minutes_per_run=1.5 | in the first forward\nno step"),
    row(trial_id="t_big", method="lora", zero_stage=0, offload="none", mbs=8, act_ckpt_layers=0, fp8=False,
        compile=True, status="pruned",
        predicted_step_time_s=2.0, predicted_memory_gib=214.6, reason="predicted 214.6 GiB > 132.8 GiB usable"),
]
INFERENCE = [
    row(config_id="llama_6.74b_tp1_pp1_bs16", batch_size=16, tp=1, status="ok", predicted_memory_gib=15.9,
        latency_ms_p50=400.0, latency_ms_p99=450.0, time_to_first_token_ms=30.0, tokens_per_s=800.0,
        tokens_per_s_per_gpu=800.0, reason=None),
    row(config_id="llama_6.74b_tp1_pp1_bs1", batch_size=1, tp=1, status="failed", predicted_memory_gib=15.6,
        latency_ms_p50=None, reason="CUDA error"),
]


def parse(table: str) -> list[dict]:
    """A markdown table back into {header: cell} rows (cells with an escaped pipe kept whole)."""
    lines = table.strip().splitlines()
    split = lambda line: [c.strip().replace("\\|", "|") for c in line.strip("|").split(" | ")]  # noqa: E731
    header = split(lines[0])
    return [dict(zip(header, split(line))) for line in lines[2:]]


def test_the_training_table_takes_each_column_by_name():
    got = parse(gc.markdown_table(TRAINING, gc.TRAINING_COLUMNS))
    assert got[0] == {
        "method": "full", "ZeRO": "3", "offload": "none", "MBS": "2", "ckpt": "32", "fp8": "True", "compiled": "False",
        "status": "ok",
        "step s pred": "1.5", "step s meas": "2.25", "step err %": "+50.0", "GiB analytic": "100.00",
        "GiB traced": "120.50", "GiB meas": "110.25", "tensor GiB analytic": "90.00", "tensor GiB traced": "95.50",
        "tensor GiB meas": "99.75", "MFU": "0.432", "tok/s/GPU pred": "12,000", "tok/s/GPU meas": "8,000",
        "reason": "-"}
    assert got[1]["status"] == "timeout" and got[1]["step s meas"] == "-" and got[1]["GiB analytic"] == "5.00"
    assert got[1]["reason"] == "reached max_minutes_per_run=1.5 | in the first forward no step"
    assert got[2]["status"] == "pruned" and got[2]["GiB analytic"] == "214.60" and got[2]["tensor GiB meas"] == "-"


def test_the_inference_table_takes_each_column_by_name_and_shows_a_latency_prediction_once_the_csv_has_one():
    got = parse(gc.markdown_table(INFERENCE, gc.inference_columns(INFERENCE)))
    assert got[0] == {"batch": "16", "TP": "1", "status": "ok", "GiB pred": "15.90", "latency p50 ms": "400",
                      "latency p99 ms": "450", "TTFT ms": "30", "tok/s": "800", "tok/s/GPU": "800", "reason": "-"}
    assert got[1]["latency p50 ms"] == "-" and got[1]["reason"] == "CUDA error"
    predicted = [dict(r, predicted_latency_ms_p50="380") for r in INFERENCE]
    header = parse(gc.markdown_table(predicted, gc.inference_columns(predicted)))[0]
    assert header["latency_ms_p50 pred"] == "380" and list(header)[-1] == "reason"


def test_a_long_reason_is_cut_and_an_empty_cell_is_a_dash():
    assert gc.cell("", "gib") == "-" and gc.cell(None, "text") == "-"
    long = gc.cell("x" * 1000, "reason")
    assert len(long) == gc.REASON_CHARS and long.endswith("...")


def test_the_tally_counts_launched_trials_and_what_measured():
    t = gc.tally(TRAINING, INFERENCE)
    assert (t.launched, t.measured) == (4, 2)  # the pruned trial was never launched
    assert [f.split(":")[0] for f in t.failed] == ["t_off", "llama_6.74b_tp1_pp1_bs1"]
    over = [row(config_id="c", status="over_memory", reason="needs 200 GiB")]
    assert gc.tally([], over).launched == 0


def run_of(name: str, rows, inference=False, code=0, error=""):
    return gc.SearchRun(gc.Search(name, "finetune/llama2_7b", ("gpu=h200", f"x={name}"), inference), code, 12.0,
                        rows, error)


def test_a_check_passes_only_when_every_search_wrote_its_table_and_every_launched_trial_measured():
    ok_training, ok_inference = TRAINING[:1] + TRAINING[2:], INFERENCE[:1]
    assert gc.passed([run_of("full", ok_training), run_of("inference", ok_inference, inference=True)])
    assert not gc.passed([run_of("full", TRAINING), run_of("inference", ok_inference, inference=True)])
    assert not gc.passed([run_of("full", ok_training), run_of("adapters", None, code=2)])
    assert not gc.passed([run_of("full", TRAINING[2:])])  # nothing launched


def test_the_page_has_the_verdict_tables_versions_command_and_each_cli_run():
    runs = [run_of("full", TRAINING), run_of("adapters", None, code=2, error="hp_tool: error: bad key\n"),
            run_of("inference", INFERENCE, inference=True), gc.SearchRun(gc.Search("later", "x", ("a=1",)))]
    page = gc.render_page(gc.Page("h200", "python3 benchmarks/gpu_check.py --gpu h200", "2026-01-02T03:04:05+00:00",
                                  {"torch": "2.11.0+cu130", "device": "NVIDIA H200 x 1"}, runs, 330.0))
    assert page.startswith("# GPU check: h200\n")
    assert "FAIL: 2 of 4 launched trials and inference configs measured a step; 2026-01-02T03:04:05+00:00, " \
           "5.5 minutes." in page
    assert "\n    python3 benchmarks/gpu_check.py --gpu h200\n" in page
    assert "- t_off: timeout (reached max_minutes_per_run=1.5" in page
    assert "| torch | 2.11.0+cu130 |" in page and "| device | NVIDIA H200 x 1 |" in page
    assert "`full` (exit 0, 12 s):\n\n    python3 main.py gpu=h200 x=full\n" in page
    assert "`adapters` (exit 2, 12 s)" in page and "hp_tool: error: bad key" in page
    assert "`later` (not run)" in page
    assert page.index("## Training") < page.index("## Inference") < page.index("## Versions")


def test_arguments():
    args = gc.parse_args(["--rehearse"])
    assert args.gpu == "cpu" and args.out == gc.REPO / "docs" / "validation" / "cpu.md"
    assert args.work_dir == gc.REPO / "results" / "gpu_check" / "cpu"
    args = gc.parse_args(["--gpu", "h100_80gb", "--out", "x.md", "--minutes-per-trial", "2"])
    assert (args.gpu, args.out, args.minutes_per_trial) == ("h100_80gb", Path("x.md"), 2.0)
    with pytest.raises(SystemExit):
        gc.parse_args([])


def test_a_column_the_csv_lacks_is_named_not_shown_as_unmeasured():
    renamed = [{("traced_gib" if k == "traced_memory_gib" else k): v for k, v in r.items()} for r in TRAINING]
    text = gc.render_tables([run_of("full", renamed), run_of("inference", INFERENCE, inference=True)])
    assert "Not in the CSV, shown as -: traced_memory_gib.\n" in text
    assert text.count("Not in the CSV") == 1  # the inference CSV has every column it shows
    assert gc.render_tables([run_of("full", None)]).count("(no table)") == 2


@pytest.mark.e2e
def test_a_search_that_fails_at_start_up_is_on_the_page_and_the_check_exits_1(tmp_path, monkeypatch):
    """The I/O path in seconds: one real CLI run with a key the schema lacks (exit 2, no table)."""
    bad = gc.Search("full", "finetune/tiny", ("search_config=finetune/tiny", "gpu=cpu", "no_such_key=1"))
    monkeypatch.setattr(gc, "searches", lambda gpu, work_dir, minutes=None, host=None: [bad])
    monkeypatch.setattr(gc, "versions", lambda: {"torch": "x"})
    out = tmp_path / "page.md"
    assert gc.main(["--rehearse", "--searches", "full", "--work-dir", str(tmp_path / "work"), "--out", str(out)]) == 1
    page = out.read_text()
    assert page.startswith("# GPU check: cpu\n\nFAIL: 0 of 0 launched")
    assert "`full` (exit 2, " in page and "no_such_key" in page.split("No table; the output ended with:")[1]
    assert "no_such_key" in (tmp_path / "work" / "full.log").read_text()


def test_the_searches_run_in_the_order_given(tmp_path, monkeypatch):
    """A short GPU lease runs the search never yet seen on a GPU first: --searches full,adapters keeps that order."""
    ran = []
    monkeypatch.setattr(gc, "versions", lambda: {"torch": "x"})
    monkeypatch.setattr(gc, "run_search", lambda search, work_dir: ran.append(search.name) or gc.SearchRun(search))
    gc.main(["--rehearse", "--searches", "full,adapters", "--work-dir", str(tmp_path), "--out", str(tmp_path / "p.md")])
    assert ran == ["full", "adapters"]
