"""ZeRO stage, offload and engine as search dimensions: the memory model per stage and offload against hand
computations, host RAM pruning, the small-GPU preset's dry run, bad input, the DeepSpeed config, and a tiny
search whose grid spans both engines and two stages, end to end."""

import dataclasses
import csv
import json
import subprocess
import sys

import pytest

from hp_tool.architectures import count_parameters, layer_parameters
from hp_tool.vocab import INVALID, OVER_LIMIT, PRUNED, SELECTED
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import GIB, Hardware, Layout
from hp_tool.estimate.memory import (CHECKPOINT_GATHER_BYTES, HOST_PROCESS_OVERHEAD_GIB, estimate_memory,
                                     host_phases_gib, stage_parameters)
from hp_tool.estimate.speed import estimate_step_time
from hp_tool.families.llama import llama_shape
from hp_tool.planner import make_plan
from search_helpers import main_here


def run_main(tmp_path, *overrides):
    """`python3 main.py` with results under tmp_path/res, run in this process (search_helpers.main_here)."""
    return main_here(f"base_results_dir={tmp_path / 'res'}", *overrides, cwd=tmp_path)


def read_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


HW = Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
              inter_node_bandwidth_gbps=25, memory_overhead_gib=3.0, host_ram_gib=2048, pcie_bandwidth_gbps=25)
SHAPE, _ = llama_shape(7, 32000, 4096)


def lay(stage, offload="none", engine="deepspeed", dp=8):
    return Layout.of(tp=1, pp=1, dp=dp, mbs=1, act_ckpt_layers=32, global_batch_size=8 * dp, zero_stage=stage, offload=offload, engine=engine)


def test_gpu_memory_falls_with_each_stage_by_the_zero_table():
    mem = [estimate_memory(SHAPE, lay(z), HW) for z in range(4)]
    totals = [m.total_gib for m in mem]
    assert totals[0] > totals[1] > totals[2] > totals[3]
    psi = stage_parameters(SHAPE, 1, 1)[0]
    bucket = 2 * min(psi, 5e8)  # ZeRO-2 and 3 reduce through DeepSpeed's bucket of 5e8 16-bit elements
    assert mem[0].model_states_gib == pytest.approx(16 * psi / GIB)
    assert mem[1].model_states_gib == pytest.approx((4 * psi + 12 * psi / 8) / GIB)
    assert mem[2].model_states_gib == pytest.approx((2 * psi + 14 * psi / 8 + bucket) / GIB)
    gathered = 2 * 2 * layer_parameters(SHAPE)  # ZeRO-3 holds a gathered layer and the prefetched one
    assert mem[3].model_states_gib == pytest.approx((16 * psi / 8 + gathered + bucket) / GIB)
    # activations do not depend on the stage
    assert len({round(m.activations_gib, 9) for m in mem}) == 1


def test_offload_moves_states_to_host_ram_by_hand_computed_figures():
    psi = stage_parameters(SHAPE, 1, 1)[0]
    bucket = 2 * min(psi, 5e8)
    # ZeRO-Offload: the 16-bit weights (a ZeRO-3 shard and its gathered layers) and the reduction bucket; the
    # gradient partition waits in host RAM
    gpu = estimate_memory(SHAPE, lay(3, "optimizer"), HW).model_states_gib
    assert gpu == pytest.approx((2 * psi / 8 + 2 * 2 * layer_parameters(SHAPE) + bucket) / GIB)
    assert estimate_memory(SHAPE, lay(2, "optimizer"), HW).model_states_gib == pytest.approx((2 * psi + bucket) / GIB)
    # host RAM per node: 8 GPUs x (18 bytes per parameter of the shard + one process); rank 0's node adds
    # the gathered fp32 model 4·M while saving; a pretraining run loads no checkpoint
    full = host_phases_gib(SHAPE, lay(3, "optimizer_and_params"), 8)
    m = count_parameters(SHAPE)
    assert full.train_gib == pytest.approx(8 * (18 * psi / 8) / GIB + 8 * HOST_PROCESS_OVERHEAD_GIB) == full.load_gib
    assert full.save_rank0_gib == pytest.approx(full.train_gib + CHECKPOINT_GATHER_BYTES * m / GIB)
    assert host_phases_gib(SHAPE, lay(3, "optimizer"), 8).node_gib == pytest.approx(
        16 * psi / GIB + 8 * HOST_PROCESS_OVERHEAD_GIB)
    torch_offload = host_phases_gib(SHAPE, lay(3, "optimizer_and_params", "torch"), 8).node_gib
    assert torch_offload == pytest.approx(16 * psi / GIB + 8 * HOST_PROCESS_OVERHEAD_GIB)
    # REFERENCE §5 check value: 70B, 8-way, 8 GPUs per machine -> 18·M/N·K = 1.26 TB at M = 70e9 (Llama-2 70B's
    # 68.98e9 parameters: 1.24 TB)
    l70, _ = llama_shape(70, 32000, 4096)
    offloaded = host_phases_gib(l70, lay(3, "optimizer_and_params"), 8).train_gib - 8 * HOST_PROCESS_OVERHEAD_GIB
    assert offloaded * GIB / 1e12 == pytest.approx(1.26 * count_parameters(l70) / 70e9, rel=1e-9)
    assert host_phases_gib(SHAPE, lay(3), 8).node_gib == pytest.approx(8 * HOST_PROCESS_OVERHEAD_GIB)
    # a pretrained model loads tensor by tensor (6 bytes per element of the largest, per process) and
    # rank 0 gathers it in its 16-bit dtype
    pre = dataclasses.replace(SHAPE, pretrained=True)
    phases = host_phases_gib(pre, lay(3), 8)
    big = max(SHAPE.vocab_size, SHAPE.ffn_hidden_size) * SHAPE.hidden_size
    assert phases.load_gib == pytest.approx(phases.train_gib + 8 * 6 * big / GIB)
    assert phases.save_rank0_gib == pytest.approx(phases.train_gib + 2 * m / GIB)


def test_speed_model_charges_stage_3_gathers_and_offload_traffic():
    times = {(z, o): estimate_step_time(SHAPE, lay(z, o), HW, 1) for z, o in
             [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "optimizer"), (3, "optimizer_and_params")]}
    # 8 micro-batches: one all-reduce per step at ZeRO 0-1, a reduce-scatter per micro-batch at ZeRO-2,
    # two gathers and a reduce-scatter per micro-batch at ZeRO-3
    from hp_tool.estimate.speed import dp_collectives
    counts = [dp_collectives(SHAPE, lay(z, "none")) for z in (0, 1, 2, 3)]
    # DeepSpeed: ZeRO-2 reduce-scatters per micro-batch and gathers the updated weights once; ZeRO-3 gathers a
    # checkpointed layer again for its recompute (all 32 here)
    assert counts[0] == counts[1] == 2 < counts[2] == 8 + 1 < counts[3] == 4 * 8
    # exposed: the once-a-step all-reduce overlaps only the last micro-batch's backward, ZeRO-2's reduce-scatters
    # each micro-batch's; ZeRO-3 adds two gathers per micro-batch to ZeRO-2's traffic
    assert times[(0, "none")].dp_comm_s == times[(1, "none")].dp_comm_s > 0
    assert times[(3, "none")].dp_comm_s > 0 and times[(2, "none")].dp_comm_s > 0
    # where the traffic outruns the compute (a 0.5 GB/s link), ZeRO-3's extra gathers show
    slow = dataclasses.replace(HW, intra_node_bandwidth_gbps=0.5)
    assert estimate_step_time(SHAPE, lay(3), slow, 1).dp_comm_s > estimate_step_time(SHAPE, lay(2), slow, 1).dp_comm_s
    assert times[(3, "none")].offload_s == 0 < times[(3, "optimizer")].offload_s < \
        times[(3, "optimizer_and_params")].offload_s
    totals = [times[(3, o)].total_s for o in ("none", "optimizer", "optimizer_and_params")]
    assert totals == sorted(totals)


def plan(tmp_path, *overrides):
    cfg, name = compose(list(overrides))
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def test_a10g_preset_fits_only_sharded_or_offloaded_layouts_and_says_why_not(tmp_path):
    p = plan(tmp_path, "search_config=finetune/llama2_7b_a10g")
    selected = [c for c in p.candidates if c.status == SELECTED]
    assert selected and {c.engine for c in selected} <= {"torch", "deepspeed"}
    for c in selected:  # 108 GiB of unsharded states on 24 GiB cards: only heavy savers fit
        assert c.zero_stage == 3 or c.offload != "none"
        assert c.memory_gib <= 24 * 0.95 and c.host_memory_gib <= 64 * 0.95
    for c in p.candidates:
        assert c.status in (SELECTED, PRUNED, INVALID, "over_limit") and (c.status == SELECTED or c.reason)
    unsharded = [c for c in p.candidates if c.zero_stage == 0]
    assert unsharded and all(c.status in (PRUNED, INVALID) for c in unsharded)
    assert any(c.reason_key == "gpu.memory_gib" and "GiB per GPU >" in c.reason for c in unsharded)
    bad = [c for c in p.candidates if c.status == INVALID]
    reasons = " ".join(c.reason for c in bad)
    assert "needs ZeRO stage >= 1" in reasons and "parameter offload needs ZeRO stage 3" in reasons
    assert "DeepSpeed pipeline parallelism supports ZeRO stages 0-1" in reasons


def test_host_ram_prunes_offload_with_the_number_and_the_key(tmp_path):
    p = plan(tmp_path, "search_config=finetune/llama2_7b_a10g", "gpu.host_ram_gib=16")
    host = [c for c in p.candidates if c.reason_key == "gpu.host_ram_gib"]
    assert host and all(c.status == PRUNED and "GiB host RAM per node > 15.2 GiB usable" in c.reason for c in host)
    assert all(c.host_memory_gib <= 15.2 for c in p.candidates if c.status == SELECTED)



def test_a_trial_spans_the_nodes_its_offloaded_shards_need_so_a_run_that_fits_is_not_pruned(tmp_path):
    # 7B full fine-tuning, ZeRO-3 with parameters and optimizer offloaded over 6 nodes of 64 GiB host RAM: the
    # full run holds a sixth of the offloaded states per node (about 22 GiB) and fits; a one-node trial would
    # hold all of them (over 100 GiB). The trial takes the nodes its host RAM needs, not only its GPU memory.
    p = plan(tmp_path, "search_config=finetune/llama2_7b_a10g")
    cluster_nodes, usable = 6, 64 * 0.95
    offall = [c for c in p.candidates if c.offload == "optimizer_and_params" and c.pp == 1 and c.zero_stage == 3
              and c.status != INVALID]
    assert {c.engine for c in offall} == {"torch", "deepspeed"}
    assert not [c for c in offall if c.reason_key == "gpu.host_ram_gib"]
    ds = [c for c in offall if c.engine == "deepspeed"]
    assert any(c.status in (SELECTED, OVER_LIMIT) for c in ds)  # fits (the run limit goes to faster savers)
    for c in (c for c in offall if c.reason_key != "gpu.memory_gib"):  # one over GPU memory is not estimated further
        full_host = host_phases_gib(c.shape, c.full, 1, p.cluster.hw).node_gib
        assert full_host < usable and c.host_memory_gib <= usable
        assert 1 < c.trial_nodes <= cluster_nodes  # one node cannot hold the shards; more nodes do
    # with less host RAM than even the full run needs per node, the row is pruned on the full run's figure
    small = plan(tmp_path / "small", "search_config=finetune/llama2_7b_a10g", "gpu.host_ram_gib=16")
    pruned = [c for c in small.candidates if c.offload == "optimizer_and_params" and c.pp == 1 and c.zero_stage == 3
              and c.reason_key == "gpu.host_ram_gib"]
    assert pruned and all(c.trial_nodes == cluster_nodes for c in pruned)
@pytest.mark.parametrize("override, key, words", [
    ("search_config.train_settings.zero_stages=[4]", "search_config.train_settings.zero_stages", "unknown values [4]"),
    ("search_config.train_settings.offload=[disk]", "search_config.train_settings.offload", "unknown values"),
    ("search_config.train_settings.engines=[megatron]", "search_config.train_settings.engines", "unknown values"),
    ("gpu.host_ram_gib=null", "gpu.host_ram_gib", "needs the host RAM per node"),
    ("search_config.train_settings.dp_sharding=full", "search_config.train_settings.dp_sharding",
     "zero_stages=[N]: none -> [0], gradients -> [2], full -> [3]"),
])
def test_bad_saver_input_fails_before_anything_is_written(tmp_path, override, key, words):
    extra = ["search_config.train_settings.offload=[none,optimizer]"] if "host_ram" in override else []
    proc = run_main(tmp_path, "search_config=gpt3/tiny", "dry_run=true", override, *extra)
    assert proc.returncode == 2 and key in proc.stderr and words in proc.stderr and "Fix:" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_deepspeed_engine_missing_names_the_install_command(monkeypatch):
    # DeepSpeed is installed here; hide it from the check to see what a user without it gets.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    cfg, _ = compose(["search_config=gpt3/tiny", "search_config.train_settings.engines=[torch,deepspeed]"])
    with pytest.raises(ConfigError) as err:
        to_app_config(cfg)
    assert err.value.key == "search_config.train_settings.engines" and 'pip install "hp_tool[deepspeed]"' in str(err.value)


DS_CHECK = """
import json, os, sys
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
class DataParallel:  # the full run's data-parallel group, which cannot exist on this machine
    def __init__(self, n): self.n = n
    def get_data_parallel_world_size(self): return self.n
for cfg, dp in json.load(open(sys.argv[1])):
    parsed = DeepSpeedConfig(cfg, mpu=DataParallel(dp))  # raises on a bad key, value or batch arithmetic
    print(parsed.zero_optimization_stage, parsed.train_batch_size, parsed.gradient_accumulation_steps,
          parsed.zero_config.offload_optimizer is not None, parsed.optimizer_name)
"""


@pytest.mark.e2e
def test_ds_config_is_a_plain_deepspeed_config_deepspeed_parses(tmp_path):
    from hp_tool.contracts.ds_config import ds_config

    p = plan(tmp_path, "search_config=finetune/llama2_7b_a10g")
    cases = []
    for spec in p.specs:
        cfg = ds_config(spec)
        assert '"auto"' not in json.dumps(cfg)
        dp = spec.resources.num_nodes * spec.resources.gpus_per_node // (spec.parallel.tp * spec.parallel.pp)
        cases.append((cfg, dp))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = tmp_path / "check.py"
    script.write_text(DS_CHECK)
    from trial_helpers import free_port

    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "cases.json"), str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert len(lines) == len(p.specs)
    for (stage, batch, accum, offloaded, optimizer), spec in zip(lines, p.specs):
        assert int(stage) == spec.parallel.zero_stage and int(batch) == spec.training.global_batch_size
        assert int(accum) == spec.grad_accum_steps and offloaded == str(spec.parallel.offload != "none")
        assert optimizer == "adamw"


@pytest.mark.e2e
@pytest.mark.slow
def test_tiny_search_over_both_engines_and_two_stages_runs_and_ranks(tmp_path):
    """The orchestrator runs in this process (``main_here``: what is tested is the search over the grid, not the
    process); its four two-process trials fork from the warm process as under ``python3 main.py``, 5 steps each
    (3 untimed, 2 timed: a DeepSpeed ZeRO-0 step is the slow one on CPU). The analytic memory check (the traced
    one has its own tests, tests/test_memory_check.py): no trace workers beside the trials."""
    proc = run_main(tmp_path, "search_config=llama/tiny", "cluster=local", "memory_check=analytic",
                    "search_config.train_settings.engines=[torch,deepspeed]",
                    "search_config.train_settings.zero_stages=[0,3]", "search_config.train_settings.offload=[none]",
                    "search_config.train_settings.tensor_parallel_sizes=[1]",
                    "search_config.train_settings.pipeline_parallel_sizes=[1]",
                    "search_config.train_settings.micro_batch_sizes=[2]",
                    "search_config.train_settings.act_ckpt_layers=[0]",
                    "search_config.train_settings.max_steps_per_run=5",
                    "search_config.train_settings.search_strategy=exhaustive")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = tmp_path / "res" / "llama" / "tiny" / "final_results"
    rows = read_rows(final / "final_summary_1nodes.csv")
    assert sorted((r["engine"], r["zero_stage"]) for r in rows) == [
        ("deepspeed", "0"), ("deepspeed", "3"), ("torch", "0"), ("torch", "3")]
    assert [r["rank"] for r in rows] == ["1", "2", "3", "4"]
    times = [float(r["full_run_step_time_s"]) for r in rows]
    assert times == sorted(times) and all(r["status"] == "ok" for r in rows)
    ds_json = final / "ds_config_tiny_1nodes.json"
    if rows[0]["engine"] == "deepspeed":
        cfg = json.loads(ds_json.read_text())
        assert cfg["zero_optimization"]["stage"] == int(rows[0]["zero_stage"])
    else:
        assert not ds_json.exists()
