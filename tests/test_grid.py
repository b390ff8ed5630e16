"""The grid is the product of the dimension table's rows (hp_tool/candidates.py ``grid_dimensions``): a row added to
the table, and nothing else, is searched, priced and reported."""

from __future__ import annotations

import csv
import re
import sys

import pytest

from hp_tool import dimensions
from hp_tool.candidates import RULES, At, Rule, _nesting, build_grid, grid_dimensions, grid_values
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.dimensions import Dimension
from hp_tool.planner import make_plan
from hp_tool.plan_output import render_plan, write_plan
from hp_tool.recipe import LOSS_CHUNK_TOKENS
from hp_tool.vocab import SELECTED

# a dimension the shipped table does not search: the chunked loss's tokens per chunk (a recipe field the memory
# model prices and the engine runs, hp_tool/trial/models.py), as a row a user would add
CHUNK = Dimension("loss_chunk_tokens", "loss_chunk_tokens_list", int, LOSS_CHUNK_TOKENS, False, "chunk", "saver",
                  lambda v: f"_chunk{v}" if v != LOSS_CHUNK_TOKENS else "", lambda v: f"loss chunks of {v} tokens",
                  "use chunk sizes of at least one token", added=True)


@pytest.fixture
def with_row(monkeypatch):
    """The dimension table with ``CHUNK`` added, wherever a module holds the table."""
    shipped = dimensions.DIMENSIONS
    table = shipped + (CHUNK,)
    for module in list(sys.modules.values()):
        if getattr(module, "DIMENSIONS", None) is shipped:
            monkeypatch.setattr(module, "DIMENSIONS", table)
    monkeypatch.setitem(dimensions.BY_NAME, CHUNK.name, CHUNK)
    monkeypatch.setitem(dimensions.BY_KEY, CHUNK.key, CHUNK)
    return CHUNK


def _plan(tmp_path, chunks=None):
    cfg, name = compose(["search_config=finetune/tiny", "search_config.train_settings.losses=[chunked]",
                         "search_config.train_settings.tensor_parallel_sizes=[1]",
                         "search_config.train_settings.seq_lengths=[128]", "search_config.train_settings.limit_search_runs=50",
                         "search_config.train_settings.global_batch_tokens=1024"])
    app = to_app_config(cfg)
    if chunks is not None:  # the user's list of the new row, as its train_settings key would give it
        object.__setattr__(app.search_config.train_settings, CHUNK.key, chunks)
    return make_plan(app, name, tmp_path / name)


def test_a_row_added_to_the_table_is_searched_priced_and_reported(with_row, tmp_path):
    base = _plan(tmp_path / "base")
    plan = _plan(tmp_path / "row", chunks=[64, 4096])
    # searched: every layout once per chunk size
    assert len(plan.candidates) == 2 * len(base.candidates)
    assert CHUNK in grid_dimensions()
    chunks = {c.full.loss_chunk_tokens for c in plan.candidates}
    assert chunks == {64, 4096}
    # priced: the smaller chunk holds fewer logits, so every selected layout's memory differs by its chunk
    by_layout: dict[tuple, dict[int, float]] = {}
    for c in plan.candidates:
        if c.status == SELECTED:
            key = (c.mbs, c.act_ckpt_layers, c.zero_stage, c.full.act_ckpt_mode)
            by_layout.setdefault(key, {})[c.full.loss_chunk_tokens] = c.memory_gib
    pairs = [m for m in by_layout.values() if len(m) == 2]
    assert pairs and all(m[64] < m[4096] for m in pairs)
    # reported: plan.csv's column and the trial ids, the printed plan's header, the selected trials' specs
    write_plan(plan)
    with open(plan.results_dir / "candidate_configs" / "plan.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["loss_chunk_tokens"] for r in rows} == {"64", "4096"}
    assert all(("_chunk64" in r["trial_id"]) == (r["loss_chunk_tokens"] == "64") for r in rows)
    header = re.compile(r"\bchunk\b")  # the printed column's header (not "lchunk" of a trial id, nor "chunked")
    assert header.search(render_plan(plan, max_rows=50)) and not header.search(render_plan(base, max_rows=50))
    assert {s.parallel.loss_chunk_tokens for s in plan.specs} == {64, 4096}
    assert len({s.fingerprint() for s in plan.specs}) == len(plan.specs)


def test_a_row_without_a_list_searches_its_default_and_a_rule_picks_per_layout(with_row, tmp_path, monkeypatch):
    """Left null, the row searches its default (the plan is the shipped one); a rule in ``RULES`` picks its values
    per point of the product from the dimensions it reads, which the grid sets first."""
    base = _plan(tmp_path / "base")
    assert {c.full.loss_chunk_tokens for c in base.candidates} == {LOSS_CHUNK_TOKENS}

    def per_micro_batch(given, at: At):  # one chunk per micro-batch's sequence: what the rule reads decides
        return [at.layout.mbs * 16]

    monkeypatch.setitem(RULES, CHUNK.name, Rule(("mbs",), per_micro_batch))
    order = [d.name for d in grid_dimensions()]
    assert order.index("loss_chunk_tokens") > order.index("mbs")
    plan = _plan(tmp_path / "rule")
    assert len(plan.candidates) == len(base.candidates)
    assert all(c.full.loss_chunk_tokens == 16 * c.mbs for c in plan.candidates)


def test_the_grid_nests_each_rule_inside_what_it_reads_and_refuses_a_cycle():
    names = [d.name for d in grid_dimensions()]
    for name, rule in RULES.items():
        assert all(names.index(r) < names.index(name) for r in rule.reads), name
    assert "seq_length" not in names and "zero_stage" not in names  # the planner's, and searched per layout
    looped = (("tp", ("pp",)), ("pp", ("tp",)))
    with pytest.raises(ValueError, match="cycle"):
        _nesting(dimensions.DIMENSIONS, looped)


def test_a_list_given_is_searched_in_the_order_given():
    from hp_tool.config import TrainSettings
    from hp_tool.families.shape import Shape

    shape = Shape("llama", 8, 512, 8, 8, 1024, 32000, 2048)
    grid = build_grid(TrainSettings(micro_batch_sizes=[4, 1, 2], optimizers=["sgd", "adamw"]), shape, 0.1)
    at = At(shape, grid, None, None)
    assert grid_values(dimensions.BY_NAME["mbs"], at) == ([4, 1, 2], "")
    assert grid_values(dimensions.BY_NAME["optimizer"], at) == (["sgd", "adamw"], "")
    assert grid_values(dimensions.BY_NAME["fp8"], at) == ([False], "")  # null and no rule: its default


def test_train_settings_lists_come_from_the_rows_and_are_documented_once():
    """Each row's train_settings list is the schema's field (its values' type, null by default) and its doc is the
    one docs/configuration.md prints."""
    import dataclasses
    from pathlib import Path

    from hp_tool.config import TrainSettings

    fields = {f.name: f for f in dataclasses.fields(TrainSettings)}
    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    for d in dimensions.DIMENSIONS:
        f = fields[d.key]
        assert f.default is None and f.metadata["doc"] == d.doc and d.doc, d.key
        assert f"`search_config.train_settings.{d.key}` | List[{d.kind.__name__}] or null | `null` | " \
               f"{d.doc.replace('|', '/')} |" in page, d.key
