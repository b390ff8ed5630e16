"""Long-context planning: the loss without whole logits, activation offload, sequence and context parallelism in
the memory and step-time models, the grid's heuristics, trial ids, CSV columns and the bad inputs a user can
give. Pure planning: no process is started (the engine's losses are tests/test_context_parallel.py and
tests/test_chunked_loss.py; traced memory tests/test_trace_long_context.py)."""

import csv
import dataclasses

import pytest

from hp_tool.candidates import (CHUNKED_LOSS_FROM, At, Grid, build_grid, context_parallel_sizes, grid_values,
                                loss_values, sequence_parallel_values)
from hp_tool.dimensions import BY_NAME
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.contracts.spec import ModelSpec, ParallelSpec, ResourcesSpec, TrainingSpec, TrialSpec
from hp_tool.dimensions import trial_id
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import GB, GIB, Hardware, Layout
from hp_tool.estimate.memory import (estimate_memory, host_phases_gib, logits_bytes, loss_freed_bytes,
                                     offloaded_activation_bytes, stage_activation_bytes)
from hp_tool.estimate.speed import activation_offload_s, cp_comm_s, estimate_step_time
from hp_tool.families.shape import Shape
from hp_tool.fingerprint import fingerprint_of
from hp_tool.planner import make_plan
from hp_tool.plan_output import write_plan

# Llama-3 8B at 32K tokens (REFERENCE §9, §15)
L8B = Shape("llama", 32, 4096, 32, 8, 14336, 128256, 32768)
A100 = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
                inter_node_bandwidth_gbps=25, memory_overhead_gib=3, host_ram_gib=2048, pcie_bandwidth_gbps=25)


def lay(**kw) -> Layout:
    base = dict(tp=1, pp=1, dp=1, mbs=1, act_ckpt_layers=0, global_batch_size=2)
    return Layout.of(**{**base, **kw})


# ---- the loss ----

def test_the_whole_logits_loss_holds_what_reference_says_and_the_chunked_one_a_chunk():
    """REFERENCE §15: one 32K sequence over 128,256 tokens is 16.8 GB of fp32 logits, the gradient as much again,
    plus the 16-bit logits (bf16: 2 + 4 + 4 bytes per logit). The chunked loss holds the hidden states' gradient,
    the head's fp32 gradient and one 4096-token chunk (8 bytes of fp32 logits and softmax, 2 of bf16)."""
    logits = 32768 * 128256
    whole_loss, chunked_loss = logits_bytes(L8B, lay(), A100), logits_bytes(L8B, lay(loss="chunked"), A100)
    assert whole_loss / 1e9 == pytest.approx(3 * 16.8, abs=0.1)  # 12 bytes a logit: 3x REFERENCE's fp32 logits
    assert whole_loss == logits * 12  # bf16 logits, fp32 upcast, log-softmax, gradient: traced
    chunked = 32768 * 4096 * 2 + 4 * 128256 * 4096 + 4096 * 128256 * 12
    assert chunked_loss == chunked
    assert whole_loss / chunked_loss > 5  # 50.4 GB against 8.7 GB
    # a chunk never holds more tokens than the micro-batch has
    short = dataclasses.replace(L8B, seq_length=1024)
    assert logits_bytes(short, lay(loss="chunked"), A100) == 1024 * 4096 * 2 + 4 * 128256 * 4096 + 1024 * 128256 * 12
    # the peak follows: the last stage's logits term is the loss's
    full, chunk = estimate_memory(L8B, lay(), A100), estimate_memory(L8B, lay(loss="chunked"), A100)
    assert full.logits_gib - chunk.logits_gib == pytest.approx((logits * 12 - chunked) / GIB)
    assert full.activations_gib == chunk.activations_gib and full.model_states_gib == chunk.model_states_gib


# ---- context parallelism ----

def test_context_parallel_divides_a_ranks_tokens_and_shards_states_over_dp_times_cp():
    """CP2 x DP1 on 2 GPUs shards the states as DP2 does (ZeRO over DP x CP), and holds half the activations and
    half the whole-logits loss of a micro-batch, plus what the ring keeps (its fp32 output per layer; its working
    memory fits under the freed logits here); the 4 micro-batches of DP1 are 2 per replica at DP2."""
    cp2, dp2 = lay(cp=2, global_batch_size=4), lay(dp=2, global_batch_size=4)
    assert cp2.gpus == dp2.gpus == 2 and cp2.zero_ranks == dp2.zero_ranks == 2
    assert cp2.num_microbatches == 4 and dp2.num_microbatches == 2
    m_cp, m_dp = estimate_memory(L8B, cp2, A100), estimate_memory(L8B, dp2, A100)
    assert m_cp.model_states_gib == pytest.approx(m_dp.model_states_gib)
    ring = 32 * 4 * 16384 * 4096  # 32 layers' fp32 ring output over the rank's 16384 tokens
    assert m_cp.activations_gib == pytest.approx(m_dp.activations_gib / 2 + ring / GIB)
    assert m_cp.logits_gib == pytest.approx(m_dp.logits_gib / 2)
    # the same tokens per GPU per step: the same FLOPs per GPU
    t_cp, t_dp = estimate_step_time(L8B, cp2, A100, 1), estimate_step_time(L8B, dp2, A100, 1)
    assert t_cp.compute_s == pytest.approx(t_dp.compute_s, rel=0.01)


def test_the_rings_key_value_passes_cost_only_what_the_attention_does_not_hide():
    """Per layer and micro-batch: CP - 1 hops forward, CP hops of twice the bytes backward, each hop of the rank's
    keys and values (2 x tokens/CP x 1024 x 2 bytes) against the attention over one block. At 32K on NVLink the
    attention hides it; over a slow link at a short sequence it shows, by the hand-computed amount."""
    assert cp_comm_s(L8B, lay(cp=2), A100) == 0.0
    short = dataclasses.replace(L8B, seq_length=2048)
    slow = dataclasses.replace(A100, intra_node_bandwidth_gbps=1.0)
    layout = lay(cp=2)
    local = 1024
    hop = 2 * local * 1024 * 2 / 1e9  # seconds at 1 GB/s
    from hp_tool.estimate.speed import attention_efficiency

    attention = 4 * local * local * 4096 / (312e12 * attention_efficiency(short, layout, slow))
    per_layer = 1 * max(0, hop - attention) + 2 * max(0, 2 * hop - 2.5 * attention)
    assert cp_comm_s(short, layout, slow) == pytest.approx(2 * 32 * per_layer)
    assert cp_comm_s(short, lay(), slow) == 0.0
    # a checkpointed layer's recompute passes the blocks once more
    assert cp_comm_s(short, lay(cp=2, act_ckpt_layers=32), slow) > cp_comm_s(short, layout, slow)


# ---- activation offload ----

def test_activation_offload_moves_the_saved_activations_to_host_ram_at_pcie_time():
    base, off = lay(act_ckpt_layers=8), lay(act_ckpt_layers=8, activation_offload=True)
    m0, m1 = estimate_memory(L8B, base, A100), estimate_memory(L8B, off, A100)
    moved = offloaded_activation_bytes(L8B, off, A100)
    assert offloaded_activation_bytes(L8B, base, A100) == 0
    # what stays is one layer's working set: less than the stored activations by all but that layer
    assert 0 < m1.activations_gib < m0.activations_gib / 5
    # what stays is the MLP's four saved products (bf16, FFN width) and its norm's fp32 input; the rest moved
    assert m1.activations_gib * GIB == pytest.approx(4 * 2 * 32768 * 14336 + 4 * 32768 * 4096)
    # the checkpointed layer's recompute stays on the GPU, a fifth of what moved at most; it runs in backward, once
    # the loss has freed its logits (50 GiB here), under which it hides
    recompute = stage_activation_bytes(L8B, base, A100, 0)[1]
    assert 0 < recompute < moved / 5
    assert recompute < loss_freed_bytes(L8B, base, A100) and m0.activations_gib * GIB == pytest.approx(moved)
    # the host holds each GPU's offloaded activations
    h0, h1 = host_phases_gib(L8B, base, 8, A100), host_phases_gib(L8B, off, 8, A100)
    assert h1.train_gib - h0.train_gib == pytest.approx(8 * moved / GIB)
    # and each micro-batch copies them down and back up over PCIe (2 micro-batches)
    assert activation_offload_s(L8B, off, A100) == pytest.approx(2 * 2 * moved / (25 * GB))
    assert estimate_step_time(L8B, off, A100, 1).total_s - estimate_step_time(L8B, base, A100, 1).total_s == \
        pytest.approx(activation_offload_s(L8B, off, A100))


# ---- sequence parallelism ----

def test_sequence_parallel_divides_the_norms_activations_by_tp_and_keeps_tp_traffic():
    """Llama's layer keeps two norms' inputs (2 x s x h x 2 bytes) and their outputs; with SP (TP 2) those are
    on sequence shards: halved. The attention and MLP activations were already split by TP."""
    tp2, sp = lay(tp=2), lay(tp=2, sequence_parallel=True)
    m0, m1 = estimate_memory(L8B, tp2, A100), estimate_memory(L8B, sp, A100)
    assert m1.activations_gib < m0.activations_gib
    assert estimate_step_time(L8B, tp2, A100, 1).tp_comm_s == estimate_step_time(L8B, sp, A100, 1).tp_comm_s


# ---- rules and bad inputs ----

TINY = ModelSpec(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=128, vocab_size=256, seq_length=96)


def spec(model=TINY, **parallel) -> TrialSpec:
    p = ParallelSpec(**parallel)
    world = p.tp * p.pp * p.cp * p.dp
    return TrialSpec(model=model, parallel=p, training=TrainingSpec(global_batch_size=p.dp * p.mbs),
                     resources=ResourcesSpec(gpus_per_node=world))


@pytest.mark.parametrize("parallel, key, words", [
    (dict(cp=5), "parallel.cp", "2*CP=10 equal chunks"),
    (dict(cp=2, engine="deepspeed", zero_stage=2), "parallel.cp", "only the torch engine"),
    (dict(cp=2, pp=2), "parallel.cp", "without pipeline stages"),
    (dict(sequence_parallel=True), "parallel.sequence_parallel", "TP=1"),
    (dict(tp=2, sequence_parallel=True, cp=2), None, None),  # 96 / 2 = 48 tokens a rank, split over TP 2: runs
    (dict(loss="chunked", tp=2), "parallel.loss", "TP 1"),
    (dict(loss="sampled"), "parallel.loss", "is not a known loss"),
    (dict(activation_offload=True, engine="deepspeed", zero_stage=2), "parallel.activation_offload", "deepspeed"),
])
def test_a_layout_the_savers_cannot_run_is_refused_naming_the_key(parallel, key, words):
    if key is None:
        spec(**parallel)
        return
    with pytest.raises(ConfigError) as err:
        spec(**parallel)
    assert err.value.key == key and words in str(err.value)


def test_context_parallel_on_an_attention_the_ring_does_not_split_names_the_family():
    gpt3 = ModelSpec(family="gpt3", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4,
                     ffn_hidden_size=256, vocab_size=256, seq_length=64)
    with pytest.raises(ConfigError, match="gpt3") as err:
        spec(gpt3, cp=2)
    assert err.value.key == "parallel.cp"
    with pytest.raises(ConfigError, match="sequence-parallel plan for gpt3"):
        spec(gpt3, tp=2, sequence_parallel=True)


def test_sequence_parallel_needs_tp_to_divide_each_ranks_tokens():
    with pytest.raises(ConfigError, match="TP=4, which does not divide them") as err:
        spec(dataclasses.replace(TINY, seq_length=102, num_attention_heads=4, num_kv_heads=4), tp=4,
             sequence_parallel=True, cp=1)
    assert err.value.key == "parallel.sequence_parallel"


def plan_of(tmp_path, *overrides):
    cfg, name = compose(list(overrides))
    return make_plan(to_app_config(cfg), name, tmp_path)


def test_activation_offload_without_a_host_ram_figure_fails_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError) as err:
        plan_of(tmp_path, "search_config=finetune/tiny", "gpu.host_ram_gib=null",
                "search_config.train_settings.activation_offload=[false,true]")
    assert err.value.key == "gpu.host_ram_gib" and "activation offload" in str(err.value)
    assert not any(tmp_path.iterdir())


def test_only_invalid_context_parallel_sizes_fail_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        plan_of(tmp_path, "search_config=finetune/tiny", "search_config.train_settings.seq_lengths=[90]",
                "search_config.train_settings.global_batch_tokens=360",
                "search_config.train_settings.context_parallel_sizes=[2]")
    assert err.value.key.endswith("context_parallel_sizes") and "2*CP=4 equal chunks" in str(err.value)


# ---- the grid ----

def test_heuristic_grid_at_long_context():
    """At 32K: CP 1, 2 and 4 (each rank keeps >= 8192 tokens, within 8 GPUs); the chunked loss where it runs (TP 1
    on the torch engine), the whole-logits one elsewhere; SP wherever TP > 1; activation offload searched beside
    none with a host RAM figure. At 4K: CP 1, whole logits, no offload."""
    from hp_tool.config import TrainSettings

    ts = TrainSettings(seq_length=32768)
    assert context_parallel_sizes(ts, L8B, 8) == [1, 2, 4]
    assert context_parallel_sizes(ts, L8B, 2) == [1, 2]
    gpt3 = Shape("gpt3", 32, 4096, 32, 32, 16384, 51200, 32768)
    assert context_parallel_sizes(ts, gpt3, 8) == [1]
    grid = build_grid(ts, L8B, 8.0, host_ram_known=True)
    assert grid.given("activation_offload") == [False, True]
    assert build_grid(ts, L8B, 8.0, host_ram_known=False).given("activation_offload") == [False]
    hw = A100

    def long_context(g, shape, layout):
        at = At(shape, g, hw, layout)
        return [(sp, loss) for sp in sequence_parallel_values(g.given("sequence_parallel"), at)
                for loss in loss_values(g.given("loss"), at)]

    assert long_context(grid, L8B, lay()) == [(False, "chunked")]
    assert long_context(grid, L8B, lay(tp=2)) == [(True, "full")]
    assert long_context(grid, L8B, lay(engine="deepspeed")) == [(False, "full")]
    short = dataclasses.replace(L8B, seq_length=CHUNKED_LOSS_FROM // 2)
    assert long_context(grid, short, lay()) == [(False, "full")]
    assert build_grid(TrainSettings(seq_length=4096), short, 8.0).given("activation_offload") == [False]
    # lists given are searched in full
    explicit = dataclasses.replace(grid, lists={**grid.lists, "sequence_parallel": [False, True],
                                                "loss": ["full", "chunked"]})
    assert len(long_context(explicit, L8B, lay(tp=2))) == 4
    assert grid_values(BY_NAME["loss"], At(L8B, explicit, hw, lay(tp=2))) == (["full", "chunked"], "")
    assert isinstance(grid, Grid)


def test_trial_ids_name_the_savers_in_use_and_old_layouts_keep_their_ids_and_fingerprints():
    assert trial_id("llama", "8.03b", dict(tp=2, pp=1, mbs=1, act_ckpt_layers=32, seq_length=32768, cp=2,
                                     sequence_parallel=True, loss="chunked", activation_offload=True)) == "llama_8.03b_s32768_tp2sp_pp1_cp2_mbs1_ac32_torch_z3_noff_lchunk_aoff"
    assert trial_id("llama", "8.03b", dict(tp=2, pp=1, mbs=1, act_ckpt_layers=32, seq_length=4096)) == "llama_8.03b_s4096_tp2_pp1_mbs1_ac32_torch_z3_noff"
    s = spec()
    d = s.to_dict()
    old = {k: v for k, v in d["parallel"].items()
           if k not in ("cp", "loss", "loss_chunk_tokens", "activation_offload", "sequence_parallel", "act_ckpt_mode",
                         "master_weights", "compile")}
    assert s.fingerprint() == fingerprint_of({
        "model": {k: v for k, v in d["model"].items() if k != "fp8"}, "parallel": old, "training": d["training"],
        "run": {k: v for k, v in d["run"].items() if k != "output_dir"},
        "resources": {k: d["resources"][k] for k in ("num_nodes", "gpus_per_node")}})
    assert spec(cp=2).fingerprint() != spec(dp=2).fingerprint()


def test_a_long_context_plan_writes_every_saver_into_the_plan_and_the_specs(tmp_path):
    """The 32K preset on 2 GPUs: fitting layouts use context parallelism, sequence parallelism, the chunked loss and
    activation offload; plan.csv names each as its spec runs it."""
    plan = plan_of(tmp_path, "search_config=finetune/llama3_8b_32k",
                   "search_config.train_settings.gpus_per_node=2", "search_config.train_settings.limit_search_runs=200")
    write_plan(plan)
    rows = list(csv.DictReader(open(plan.results_dir / "candidate_configs" / "plan.csv")))
    chosen = [r for r in rows if r["plan_status"] == "selected"]
    assert {r["cp"] for r in chosen} == {"1", "2"}
    assert {r["sequence_parallel"] for r in chosen} == {"True", "False"}
    assert {r["loss"] for r in chosen} == {"full", "chunked"}
    assert {r["activation_offload"] for r in chosen} == {"True", "False"}
    specs = {s.trial_id: s for s in plan.specs}
    for r in chosen:
        p = specs[r["trial_id"]].parallel
        assert (str(p.cp), str(p.sequence_parallel), p.loss, str(p.activation_offload)) == \
            (r["cp"], r["sequence_parallel"], r["loss"], r["activation_offload"])
        assert p.tp * p.cp * p.dp * p.pp == 2
    # a layout that needs the whole logits at 32K on one GPU's TP 1 does not fit
    assert any(r["loss"] == "full" and r["tp"] == "1" and r["plan_status"] == "pruned" for r in rows)


@pytest.mark.e2e
def test_a_tiny_search_over_the_savers_trains_and_ranks_each(finetune_savers_search):
    """finetune/tiny at 256 tokens on 2 CPU processes, end to end: the chunked and the whole-logits loss, CP 1 and
    2, and TP 2 with sequence parallelism (the heuristic's choice), all with activation offload (which on CPU
    processes runs its hooks but moves nothing), are planned, trained for real and ranked; every trial's id and
    row name the savers it ran. The search is tests/shared_finetune_searches.py's (its per-epoch columns are
    tests/test_finetune.py's)."""
    search = finetune_savers_search
    [run] = search.runs
    assert run.returncode == 0, run.output
    with open(search.final / "all_trials_1nodes.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["status"] == "ok"]
    savers = sorted((r["tp"], r["cp"], r["sequence_parallel"], r["loss"]) for r in rows)
    assert savers == [("1", "1", "False", "chunked"), ("1", "1", "False", "full"), ("1", "2", "False", "chunked"),
                      ("1", "2", "False", "full"), ("2", "1", "True", "full")]
    assert sorted(int(r["rank"]) for r in rows) == [1, 2, 3, 4, 5]
    for r in rows:
        assert ("_cp2_" in r["trial_id"]) == (r["cp"] == "2") and ("_lchunk" in r["trial_id"]) == (r["loss"] == "chunked")
        assert ("tp2sp" in r["trial_id"]) == (r["sequence_parallel"] == "True")
        assert r["activation_offload"] == "True" and r["trial_id"].endswith("_aoff")
        assert float(r["measured_step_time_s"]) > 0 and float(r["final_loss"]) > 0
