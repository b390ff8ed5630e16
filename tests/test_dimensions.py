"""The dimension table (hp_tool/dimensions.py) is what the trial id, the CSVs, the printed tables and the
recommendation are made from: each row must reach every one of them, and a layout is named in words by the
dimensions that varied, no more."""

import dataclasses

import pytest

from hp_tool.config import TrainSettings
from hp_tool.contracts.spec import ADDED_FIELD_DEFAULTS, ParallelSpec, TrainingSpec
from hp_tool.dimensions import DIMENSIONS, layout_columns, layout_words, trial_id, varied
from hp_tool.estimate.layout import Layout
from hp_tool.plan_output import plan_columns
from hp_tool.planner import FIXES
from hp_tool.results import collect


def test_every_dimension_reaches_its_setting_its_field_its_columns_and_its_fix():
    from hp_tool.contracts.spec import ModelSpec
    from hp_tool.estimate.layout import PART_OF

    settings = {f.name for f in dataclasses.fields(TrainSettings)}
    layout = set(PART_OF)
    sections = {"parallel": {f.name for f in dataclasses.fields(ParallelSpec)},
                "training": {f.name for f in dataclasses.fields(TrainingSpec)},
                "model": {f.name for f in dataclasses.fields(ModelSpec)}}
    for d in DIMENSIONS:
        assert d.key in settings, f"{d.name}: train_settings.{d.key} does not exist"
        assert d.name in layout or d.name == "seq_length", f"{d.name} is not a Layout field"
        assert d.name in sections[d.spec], f"{d.name} is not in the spec's {d.spec} section"
        assert d.column in plan_columns() and d.column in collect.TABLE_COLUMNS
        typed = {int: collect.INT_COLUMNS, bool: collect.BOOL_COLUMNS, str: collect.TEXT_COLUMNS}[d.kind]
        assert d.column in typed and collect._cell(d.column, "1" if d.kind is int else "True") is not None
        assert FIXES[d.key] == d.fix and d.fix
    assert layout_columns().index("dp") == layout_columns().index("pp") + 1


def test_fields_added_later_keep_old_fingerprints_at_their_defaults():
    spec = ParallelSpec()
    added = {name for name in ADDED_FIELD_DEFAULTS if name != "loss_chunk_tokens"}
    assert added == {"cp", "loss", "activation_offload", "sequence_parallel", "act_ckpt_mode", "master_weights",
                     "compile"}
    assert all(getattr(spec, name) == ADDED_FIELD_DEFAULTS[name] for name in added)


def test_trial_ids_name_each_token_in_its_place_and_leave_defaults_out():
    base = dict(tp=2, pp=4, mbs=1, act_ckpt_layers=8)
    assert trial_id("gpt3", "5b", base) == "gpt3_5b_tp2_pp4_mbs1_ac8_torch_z3_noff"
    every = dict(base, seq_length=8192, method="qlora", sequence_parallel=True, virtual_stages=2, ep=4, cp=2,
                 engine="deepspeed", zero_stage=1, offload="optimizer", optimizer="sgd_momentum",
                 act_ckpt_mode="selective", loss="chunked", activation_offload=True)
    assert trial_id("mixtral", "46.7b", every, lora_rank=8) == \
        "mixtral_46.7b_s8192_qlora8_tp2sp_pp4_vp2_ep4_cp2_mbs1_ac8_ds_z1_offopt_sgdm_sac_lchunk_aoff"
    assert trial_id("gpt3", "5b", dict(base, master_weights="bf16")) == "gpt3_5b_tp2_pp4_mbs1_ac8_torch_z3_noff_bf16w"
    assert trial_id("mixtral", "46.7b", dict(base, ep=1)) == "mixtral_46.7b_tp2_pp4_ep1_mbs1_ac8_torch_z3_noff"


def test_a_layout_in_words_names_what_varied_and_what_differs_from_the_default():
    rows = [dict(seq_length=4096, method="full", tp=2, pp=1, dp=4, mbs=1, act_ckpt_layers=0, engine="torch",
                 zero_stage=3, offload="none", optimizer="adamw", cp=cp, loss="chunked", sequence_parallel=False,
                 activation_offload=False, virtual_stages=1, act_ckpt_mode="full", ep=None) for cp in (1, 2)]
    named = {d.name for d in varied(rows)}
    assert {"cp", "loss"} <= named  # cp varied; the loss is chunked everywhere, not the default
    assert not named & {"seq_length", "method", "offload", "optimizer", "sequence_parallel", "ep"}
    words = layout_words(rows[1], varied(rows))
    assert words.startswith("TP=2, PP=1, DP=4, CP=2, MBS=1") and "chunked loss" in words and "offload" not in words
    assert layout_words(rows[0], varied(rows, also=("seq_length", "method"))).startswith(
        "4096 tokens per sequence, full fine-tuning, TP=2")


def test_a_mode_without_checkpointed_layers_is_not_named():
    row = dict(tp=1, pp=1, dp=2, mbs=4, act_ckpt_layers=0, engine="torch", zero_stage=0, act_ckpt_mode="full")
    rows = [row, dict(row, act_ckpt_layers=4, act_ckpt_mode="selective")]
    assert "checkpointing" not in layout_words(row, varied(rows)).replace("no activation checkpointing", "")
    assert "selective checkpointing" in layout_words(rows[1], varied(rows))


def test_a_layout_and_its_trial_spec_convert_field_by_field():
    """Every field of a layout's degrees and recipe is a field of the same name of the TrialSpec section it names
    (parallel unless its metadata says training or model), and layouts that set every field off its default (but
    the engine and offload) come back whole from the specs they write (four layouts: the rules forbid some pairs,
    such as LoRA or the chunked loss with TP, sequence or context parallelism with PP, experts with CP)."""
    from hp_tool.contracts.spec import ModelSpec, RunSpec, ResourcesSpec, TrialSpec, section_values
    from hp_tool.recipe import SECTIONS, Adapters, Degrees, Recipe

    sections = {"parallel": ParallelSpec, "training": TrainingSpec, "model": ModelSpec}
    for name, section in SECTIONS.items():
        assert name in {f.name for f in dataclasses.fields(sections[section])}, (name, section)
    assert {SECTIONS[n] for n in ("global_batch_size", "optimizer", "precision")} == {"training"}
    assert {SECTIONS[n] for n in ("method", "lora")} == {"model"}
    odd = Layout.of(tp=2, pp=3, dp=5, mbs=7, act_ckpt_layers=4, global_batch_size=70, zero_stage=2,
                    virtual_stages=2, optimizer="sgd", act_ckpt_mode="selective",
                    master_weights="bf16", precision="fp16")
    long = Layout.of(dp=3, mbs=2, global_batch_size=12, cp=2, act_ckpt_layers=12, loss="chunked",
                     loss_chunk_tokens=1024, activation_offload=True, method="lora",
                     lora=Adapters(8, 16.0, 0.0, ("q_proj", "v_proj")))
    split = Layout.of(tp=2, sequence_parallel=True)
    experts = Layout.of(dp=2, global_batch_size=2, ep=2, fp8=True, compile=True)
    defaults = {**{f.name: f.default for f in dataclasses.fields(Degrees)},
                **{f.name: f.default for f in dataclasses.fields(Recipe)}}
    at_default = [{k for k, v in layout.values().items() if v == defaults[k]} for layout in (odd, long, split, experts)]
    assert set.intersection(*at_default) == {"engine", "offload"}
    for layout in (odd, long, split, experts):
        model = ModelSpec("mixtral" if layout.ep > 1 else "llama", 12, 256, 8, 8, 704, 1024, 8192,
                          num_experts=2 if layout.ep > 1 else 0, top_k=1 if layout.ep > 1 else 0,
                          **section_values(layout, "model"))
        spec = TrialSpec(model=model, parallel=ParallelSpec.of(layout),
                         training=TrainingSpec(**section_values(layout, "training")),
                         resources=ResourcesSpec(num_nodes=1, gpus_per_node=layout.gpus), run=RunSpec())
        assert spec.layout() == layout


@pytest.mark.parametrize("dimension", [d for d in DIMENSIONS if d.kind is not bool], ids=lambda d: d.key)
def test_every_dimensions_list_is_checked_before_planning(dimension):
    """A value a dimension cannot take is refused naming its train_settings key (integers below the least,
    names outside the known ones); the least itself is accepted."""
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.errors import ConfigError

    key = f"search_config.train_settings.{dimension.key}"
    bad = f"[{dimension.least - 1}]" if not dimension.choices else "[9]" if dimension.kind is int else "[bogus]"
    cfg, _ = compose(["search_config=finetune/tiny", f"{key}={bad}"])
    with pytest.raises(ConfigError) as err:
        to_app_config(cfg)
    assert err.value.key == key
    good = f"[{dimension.choices[0]}]" if dimension.choices else f"[{max(dimension.least, 1)}]"
    to_app_config(compose(["search_config=finetune/tiny", f"{key}={good}"])[0])


def test_table_cells_leave_a_mode_without_checkpointed_layers_blank():
    from hp_tool.dimensions import cell

    assert cell("act_ckpt_mode", {"act_ckpt_layers": 0, "act_ckpt_mode": "full"}) == ""
    assert cell("act_ckpt_mode", {"act_ckpt_layers": 4, "act_ckpt_mode": "selective"}) == "selective"
    assert cell("sequence_parallel", {"sequence_parallel": True}) == "yes"
    assert cell("ep", {"ep": None}) == "" and cell("dp", {"dp": 8}) == "8"
