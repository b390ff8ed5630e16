"""One Layout, one set of rules, one family registry: every validity rule names the Layout field at fault,
and the planner, the TrialSpec and the inference grid read them; every family hp_tool plans has a pure
record and a torch half, and nothing else compares family names."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hp_tool.contracts.spec import load_spec
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import Layout
from hp_tool.families import family, family_names
from hp_tool.families.shape import Shape
from search_helpers import main_here

ROOT = Path(__file__).resolve().parents[1]
# 24 query heads over 8 kv heads, 12 layers: TP 3 divides the query heads but not the kv heads
GQA = Shape("llama", 12, 768, 24, 8, 2048, 1000, 128)
T5 = Shape("t5", 4, 256, 4, 4, 640, 1000, 64, 64, 32)


def fields(layout: Layout, shape: Shape, gpus_per_node=None) -> list[tuple[str, str]]:
    return [(p.field, p.rule) for p in layout.problems(shape, gpus_per_node)]


def test_a_valid_layout_has_no_problems():
    assert fields(Layout.of(tp=2, pp=3, dp=2, mbs=2, act_ckpt_layers=4, global_batch_size=16), GQA, 8) == []


@pytest.mark.parametrize("layout, gpn, expected, words", [
    (Layout.of(tp=3, pp=1, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=4), None, [("tp", "heads")], "TP=3 does not divide the 8 key/value heads (24 query heads)"),
    (Layout.of(tp=16, pp=1, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=4), 8, [("tp", "heads"), ("tp", "node")], "TP=16 does not divide the 24 heads"),
    (Layout.of(tp=8, pp=1, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=4), 4, [("tp", "node")], "TP=8 spans nodes (4 GPUs per node)"),
    (Layout.of(tp=1, pp=5, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=4), None, [("pp", "pipeline")], "PP=5 does not divide the 12 layers"),
    (Layout.of(tp=1, pp=2, dp=1, mbs=1, act_ckpt_layers=7, global_batch_size=4), None, [("act_ckpt_layers", "checkpointing")], "7 checkpointed layers exceed the 6"),
    (Layout.of(tp=1, pp=1, dp=3, mbs=2, act_ckpt_layers=0, global_batch_size=8), None, [("global_batch_size", "batch")], "GBS=8 not divisible by MBS*DP=2*3"),
    (Layout.of(tp=1, pp=3, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=6, virtual_stages=3), None, [("virtual_stages", "interleave")], "do not divide the 4"),
    (Layout.of(tp=1, pp=1, dp=2, mbs=1, act_ckpt_layers=0, global_batch_size=4, zero_stage=0, offload="optimizer"), None, [("offload", "savers")], "needs ZeRO"),
    (Layout.of(tp=2, pp=1, dp=2, mbs=1, act_ckpt_layers=0, global_batch_size=4, zero_stage=3, engine="deepspeed"), None, [("zero_stage", "savers")], "AutoTP"),
])
def test_each_rule_names_its_field(layout, gpn, expected, words):
    problems = layout.problems(GQA, gpn)
    assert [(p.field, p.rule) for p in problems] == expected
    assert words in problems[0].reason


def test_the_family_record_decides_the_engines():
    torch_t5 = Layout.of(tp=1, pp=2, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=2)
    assert fields(torch_t5, T5) == []
    assert fields(torch_t5.replace(pp=1, engine="deepspeed"), T5) == [("engine", "family")]
    assert family("t5").trial.engines == ("torch",) and "deepspeed" in family("llama").trial.engines


def test_the_trial_spec_maps_a_problem_to_its_own_key(tmp_path):
    text = (f"trial_id: t\nmodel: {{family: llama, num_layers: 12, hidden_size: 768, num_attention_heads: 24, "
            f"num_kv_heads: 8, ffn_hidden_size: 2048, vocab_size: 1000, seq_length: 128}}\n"
            f"parallel: {{tp: 3, pp: 1, dp: 1, mbs: 1}}\ntraining: {{global_batch_size: 4}}\n"
            f"resources: {{num_nodes: 1, gpus_per_node: 3}}\n")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_spec(path)
    assert exc.value.key == "parallel.tp" and "8 key/value heads" in str(exc.value)
    path.write_text(text.replace("tp: 3", "tp: 1").replace("gpus_per_node: 3", "gpus_per_node: 1")
                    .replace("global_batch_size: 4", "global_batch_size: 3").replace("mbs: 1", "mbs: 2"))
    with pytest.raises(ConfigError) as exc:
        load_spec(path)
    assert exc.value.key == "training.global_batch_size" and "MBS*DP=2*1" in str(exc.value)


def test_an_unknown_family_names_the_key_and_the_known_ones():
    with pytest.raises(ConfigError) as exc:
        family("falcon")
    assert exc.value.key == "model.family" and all(n in str(exc.value) for n in ("gpt3", "llama", "t5", "mt5"))


@pytest.mark.e2e
def test_every_planned_family_has_a_torch_half():
    code = ("from hp_tool.families import family_names; from hp_tool.trial.families import known_families; "
            "print(sorted(family_names()) == sorted(known_families()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "True"
    assert set(family_names(planner_only=True)) == {"gpt3", "llama", "t5", "mt5", "moe"}


@pytest.mark.e2e
def test_no_family_name_is_compared_outside_the_registry_folders():
    out = subprocess.run([sys.executable, "benchmarks/architecture_metrics.py"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert "family-branch sites outside the registry folders: 0 in 0 files" in out
    assert "import cycles (module-level, function-level and type-only edges): 0 by file, 0 by folder" in out
    assert "imports running back up the floors: 0 by file, 0 by folder" in out


@pytest.mark.e2e
def test_the_plan_reports_what_each_stage_removed(tmp_path):
    proc = main_here("search_config=gpt3/5b", "dry_run=true", f"base_results_dir={tmp_path}",
                     "search_config.train_settings.tensor_parallel_sizes=[1,3]",
                     "search_config.train_settings.limit_search_runs=5", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    line = next(row for row in out.splitlines() if row.startswith("Plan: "))
    n = {k: int(v) for v, k in re.findall(r"(\d+) (candidates|invalid|estimated|selected)", line)}
    over = int(re.search(r"(\d+) over the run limit", line).group(1))
    gpu = int(re.search(r"(\d+) pruned on GPU memory", line).group(1))
    host = int(re.search(r"(\d+) on host RAM", line).group(1))
    assert "tensor_parallel_sizes" in line and n["invalid"] > 0  # TP=3 does not divide 32 heads
    assert n["invalid"] + n["estimated"] == n["candidates"]
    assert gpu + host + over + n["selected"] == n["estimated"] and n["selected"] == 5
