"""Grid properties: kept candidates are valid and fit, overrides are respected, every rejection has a reason."""

import pytest

from hp_tool.vocab import INVALID, OVER_LIMIT, PRUNED, SELECTED
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import Layout
from hp_tool.estimate.memory import estimate_memory
from hp_tool.plan_output import plan_csv_text
from hp_tool.planner import make_plan


def plan(tmp_path, *overrides):
    cfg, name = compose(list(overrides))
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def assert_valid(p, c):
    s, gpus = p.model.shape, p.cluster.gpus
    assert s.num_attention_heads % c.tp == 0
    assert s.num_layers % c.pp == 0
    assert gpus == c.tp * c.pp * c.dp
    assert p.base.training.global_batch_size % (c.mbs * c.dp) == 0
    assert 0 <= c.act_ckpt_layers <= s.num_layers // c.pp
    usable = p.cluster.hw.gpu_memory_gib * (1 - 0.05)
    assert c.memory_gib <= usable and c.full_memory_gib <= usable


@pytest.mark.parametrize("name", ["gpt3/126m", "gpt3/5b", "gpt3/20b", "gpt3/175b", "gpt3/unknown_size"])
def test_selected_candidates_are_valid_fit_and_ordered(tmp_path, name):
    p = plan(tmp_path, f"search_config={name}")
    selected = [c for c in p.candidates if c.status == SELECTED]
    assert 0 < len(selected) <= 30  # limit_search_runs of the shipped configs
    for c in selected:
        assert_valid(p, c)
    ranks = sorted(selected, key=lambda c: c.rank)
    times = [c.step_time_s for c in ranks]
    assert times == sorted(times)
    assert [s.trial_id for s in p.specs] == [
        f"gpt3_{p.model.label}_tp{c.tp}_pp{c.pp}{f'_vp{c.virtual_stages}' if c.virtual_stages > 1 else ''}"
        f"_mbs{c.mbs}_ac{c.act_ckpt_layers}_torch_z{c.zero_stage}_"
        f"{dict(none='noff', optimizer='offopt', optimizer_and_params='offall')[c.offload]}"
        f"{'_sac' if c.full.act_ckpt_mode == 'selective' else ''}{'_compiled' if c.full.compile else ''}"
        for c in ranks]
    for c in p.candidates:
        if c.status != SELECTED:
            assert c.reason and c.reason_key.startswith(("search_config.", "gpu."))
        if c.status == PRUNED:
            assert max(c.memory_gib, c.full_memory_gib) > p.cluster.hw.gpu_memory_gib * 0.95
        if c.status == OVER_LIMIT:  # beyond the limit, or displaced by the best of a regime value kept first
            assert c.rank > 30 or "kept first" in c.reason
    # the best of each regime value within 2x of the best is among the selected (rank_candidates' coverage)
    best = ranks[0].step_time_s
    for c in p.candidates:
        if c.status == OVER_LIMIT and c.step_time_s <= 2 * best:
            assert any(s.tp == c.tp and s.step_time_s <= c.step_time_s for s in selected)


def test_5b_heuristic_grid(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/5b")
    assert {c.tp for c in p.candidates} == {1, 2, 4}
    assert {c.pp for c in p.candidates} == {1}
    assert {c.mbs for c in p.candidates} == {1, 2, 3, 4, 6, 8}
    assert {c.act_ckpt_layers for c in p.candidates} == {0, 8, 16, 24}  # 8 // PP steps for 1-11.3B


def test_overrides_are_respected(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/5b",
             "search_config.train_settings.tensor_parallel_sizes=[1,2]",
             "search_config.train_settings.micro_batch_sizes=[1,2,4]",
             "search_config.train_settings.act_ckpt_layers=[0,4]")
    assert {c.tp for c in p.candidates} == {1, 2}
    assert {c.mbs for c in p.candidates} == {1, 2, 4}
    assert {c.act_ckpt_layers for c in p.candidates} == {0, 4}
    layouts = {(c.tp, c.pp, c.mbs, c.act_ckpt_layers) for c in p.candidates}
    assert len(layouts) == 2 * 1 * 3 * 2
    # zero_stages/offload null: one searched saver per layout, lighter ones listed only when they do not fit
    for layout in layouts:
        rows = [c for c in p.candidates if (c.tp, c.pp, c.mbs, c.act_ckpt_layers) == layout]
        assert sum(c.status != PRUNED for c in rows) == 1


def test_invalid_override_values_are_kept_with_reasons(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/5b", "search_config.train_settings.tensor_parallel_sizes=[1,3]",
             "search_config.train_settings.pipeline_parallel_sizes=[1,5]")
    tp3 = [c for c in p.candidates if c.tp == 3]
    pp5 = [c for c in p.candidates if c.pp == 5 and c.tp == 1]
    assert tp3 and all(c.status == INVALID and "TP=3 does not divide the 32 heads" in c.reason for c in tp3)
    assert pp5 and all(c.status == INVALID and "PP=5 does not divide the 24 layers" in c.reason for c in pp5)


def test_tiny_demo_grid(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/tiny")
    selected = [c for c in p.candidates if c.status == SELECTED]
    assert 6 <= len(selected) <= 12
    assert any(c.tp == 2 for c in selected) and any(c.pp == 2 for c in selected)
    for spec in p.specs:  # every trial fits on the 2 local processes
        assert spec.resources.num_nodes * spec.resources.gpus_per_node == 2
        assert spec.parallel.tp * spec.parallel.pp * spec.parallel.dp == 2


def test_memory_pruning_with_margin(tmp_path):
    tight = plan(tmp_path, "search_config=gpt3/5b", "gpu.memory_gib=40")
    roomy = plan(tmp_path, "search_config=gpt3/5b", "gpu.memory_gib=80")
    n_pruned = lambda p: sum(c.status == PRUNED for c in p.candidates)  # noqa: E731
    assert n_pruned(tight) > n_pruned(roomy)
    margin = plan(tmp_path, "search_config=gpt3/5b", "gpu.memory_gib=40",
                  "search_config.train_settings.memory_margin=0.3")
    assert n_pruned(margin) > n_pruned(tight)


def test_limit_search_runs_caps_selection(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/5b", "search_config.train_settings.limit_search_runs=3")
    assert len(p.specs) == 3
    assert sum(c.status == OVER_LIMIT for c in p.candidates) > 0


@pytest.mark.parametrize("override, key", [
    ("search_config.train_settings.tensor_parallel_sizes=[3]", "search_config.train_settings.tensor_parallel_sizes"),
    ("search_config.train_settings.pipeline_parallel_sizes=[5,7]", "search_config.train_settings.pipeline_parallel_sizes"),
    ("search_config.train_settings.global_batch_size=1001", "search_config.train_settings.global_batch_size"),
    ("search_config.train_settings.act_ckpt_layers=[25]", "search_config.train_settings.act_ckpt_layers"),
    ("gpu.memory_gib=4", "gpu.memory_gib"),
])
def test_nothing_runnable_is_a_clear_error(tmp_path, override, key):
    with pytest.raises(ConfigError) as exc:
        plan(tmp_path, "search_config=gpt3/5b", override)
    assert exc.value.key == key
    assert not (tmp_path / "gpt3").exists()


def test_trial_runs_on_fewest_whole_nodes_it_fits_on(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/175b")
    usable = p.cluster.hw.gpu_memory_gib * 0.95
    grown = 0
    for spec, c in zip(p.specs, sorted((c for c in p.candidates if c.status == SELECTED), key=lambda c: c.rank)):
        mp = spec.parallel.tp * spec.parallel.pp
        fewest = -(-mp // 8)
        assert spec.resources.num_nodes == c.trial_nodes >= fewest
        for nodes in range(fewest, spec.resources.num_nodes):  # every smaller whole-replica trial is over
            if (nodes * 8) % mp == 0 or nodes == fewest:
                dp = nodes * 8 // mp
                lay = Layout.of(tp=c.tp, pp=c.pp, dp=dp, mbs=c.mbs, act_ckpt_layers=c.act_ckpt_layers, global_batch_size=c.trial_global_batch_size // c.trial_dp * dp, zero_stage=c.zero_stage, offload=c.offload, engine=c.engine, virtual_stages=c.virtual_stages, act_ckpt_mode=c.full.act_ckpt_mode)
                assert estimate_memory(p.model.shape, lay, p.cluster.hw).total_gib > usable
        grown += spec.resources.num_nodes > fewest
        assert spec.full_run.num_nodes == 128
        per_replica_full = spec.full_run.global_batch_size // spec.full_run.dp
        assert spec.training.global_batch_size // spec.parallel.dp == per_replica_full


def test_interleaving_follows_nemo_for_pp_above_2_and_the_user_list_otherwise(tmp_path):
    """Heuristic (virtual_pipeline_sizes null): PP <= 2 runs one chunk per rank; a decoder-only PP > 2 also
    searches 2 and one layer per chunk (NeMo's num_layers / PP); checkpointed layers come in multiples of
    the chunks. The user's list is searched as given, invalid values kept with their reason."""
    p = plan(tmp_path, "search_config=gpt3/20b")  # 44 layers
    by_pp = {}
    for c in p.candidates:
        by_pp.setdefault(c.pp, set()).add(c.virtual_stages)
    assert all(vs == {1} for pp, vs in by_pp.items() if pp <= 2)
    assert by_pp[4] == {1, 11}  # 11 layers per stage: 2 does not divide them
    assert all(c.act_ckpt_layers % c.virtual_stages == 0 for c in p.candidates)
    chosen = plan(tmp_path, "search_config=gpt3/5b",  # 24 layers
                  "search_config.train_settings.pipeline_parallel_sizes=[1,2,4]",
                  "search_config.train_settings.virtual_pipeline_sizes=[1,2,4]",
                  "search_config.train_settings.act_ckpt_layers=[0,3]")
    assert {c.virtual_stages for c in chosen.candidates if c.pp == 1} == {1}
    assert {c.virtual_stages for c in chosen.candidates if c.pp == 4} == {1, 2, 4}
    pp4 = [c for c in chosen.candidates if c.pp == 4 and c.virtual_stages == 4 and c.tp == 1 and c.mbs <= 2]
    assert pp4 and all(c.status == INVALID and c.reason_key.endswith("virtual_pipeline_sizes")
                       and "do not divide the 6 layers per pipeline stage" in c.reason for c in pp4)
    odd = [c for c in chosen.candidates if c.pp == 2 and c.virtual_stages == 2 and c.act_ckpt_layers == 3
           and c.tp == 1 and c.mbs <= 2]
    assert odd and all(c.status == INVALID and c.reason_key.endswith("act_ckpt_layers") for c in odd)
    runnable = [c for c in chosen.candidates if c.virtual_stages == 2 and c.status == SELECTED]
    assert runnable
    specs = {s.trial_id: s for s in chosen.specs}
    for c in runnable:
        spec = specs.get(f"gpt3_5b_tp{c.tp}_pp{c.pp}_vp2_mbs{c.mbs}_ac{c.act_ckpt_layers}_torch_z{c.zero_stage}_"
                         f"{dict(none='noff', optimizer='offopt', optimizer_and_params='offall')[c.offload]}")
        if spec is not None:  # within limit_search_runs: the trial runs the interleaved layout
            assert spec.parallel.virtual_stages == 2 and spec.layout().virtual_stages == 2


def test_interleaving_lowers_the_predicted_bubble_and_raises_first_stage_memory(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/5b", "search_config.train_settings.pipeline_parallel_sizes=[4]",
             "search_config.train_settings.virtual_pipeline_sizes=[1,2]",
             "search_config.train_settings.tensor_parallel_sizes=[1]",
             "search_config.train_settings.micro_batch_sizes=[1]",
             "search_config.train_settings.act_ckpt_layers=[0]", "search_config.train_settings.zero_stages=[1]",
             "search_config.train_settings.offload=[none]")
    (plain,) = [c for c in p.candidates if c.virtual_stages == 1]
    (inter,) = [c for c in p.candidates if c.virtual_stages == 2]
    assert inter.compute_time_s < plain.compute_time_s  # bubble / v
    assert inter.comm_time_s > plain.comm_time_s  # v times the stage crossings
    assert inter.full_memory_gib > plain.full_memory_gib  # the warm-up runs further ahead


def compile_note(c) -> str:
    """A candidate's note without the run limit's word on it (``kept for coverage``)."""
    return "; ".join(part for part in (c.note or "").split("; ") if part and not part.startswith("kept for coverage"))


def test_layers_compile_by_default_where_the_engine_compiles_them_on_a_gpu_and_say_why_not_elsewhere(tmp_path):
    p = plan(tmp_path, "search_config=gpt3/5b", "search_config.train_settings.engines=[torch,deepspeed]")
    valid = [c for c in p.candidates if c.status != INVALID or c.reason_key.endswith("global_batch_size")]
    compiled = {c.full.compile for c in valid if c.engine == "torch" and c.tp == 1}
    assert compiled == {True} and all(not compile_note(c) for c in valid if c.full.compile)
    eager = [c for c in valid if not c.full.compile]
    assert {c.engine for c in eager} == {"torch", "deepspeed"} and all(c.tp > 1 for c in eager if c.engine == "torch")
    for c in eager:  # the reason the engine cannot: DeepSpeed's, or TP's
        note = compile_note(c)
        assert note.startswith("eager: ") and ("deepspeed" in note if c.engine == "deepspeed" else f"TP={c.tp}" in note)
    assert "eager: the deepspeed engine does not compile the layers" in plan_csv_text(p)
    # CPU processes run eager, saying so; a user's list is searched as given, with no note
    cpu = plan(tmp_path / "cpu", "search_config=gpt3/tiny")
    assert all(not c.full.compile and "CPU processes" in c.note for c in cpu.candidates)
    both = plan(tmp_path / "both", "search_config=gpt3/5b", "search_config.train_settings.compile=[false,true]")
    assert {c.full.compile for c in both.candidates if c.tp == 1} == {False, True}
    assert all(not compile_note(c) for c in both.candidates)
