"""The host CPUs of a node (gpu.host_cpu_cores): every GPU preset names them, the config refuses a bad value
naming the key, resolve_cluster carries them onto Hardware, and the offloaded optimizer's CPU step is priced
from them (hp_tool/estimate/speed.py cpu_adam_params_per_s). Planning only: fast tier."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from hp_tool.base_config import resolve_cluster
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.errors import ConfigError
from hp_tool.estimate.layout import Hardware, Layout
from hp_tool.estimate.speed import (CPU_ADAM_MAX_PARAMS_PER_S, CPU_ADAM_PARAMS_PER_S,
                                    CPU_ADAM_PARAMS_PER_S_PER_THREAD, _local_parameters, cpu_adam_params_per_s,
                                    estimate_step_time, offload_s)
from hp_tool.families.shape import Shape
from hp_tool.recipe import Adapters

GPU_DIR = Path(__file__).resolve().parent.parent / "hp_tool" / "conf" / "gpu"
PRESETS = sorted(p.stem for p in GPU_DIR.glob("*.yaml"))
LLAMA_7B = Shape("llama", 32, 4096, 32, 32, 11008, 32000, 2048)
KEY = "gpu.host_cpu_cores"


def hardware(threads, gpus_per_node=8) -> Hardware:
    return Hardware(gpus_per_node=gpus_per_node, gpu_memory_gib=24, peak_tflops=125, intra_node_bandwidth_gbps=32,
                    inter_node_bandwidth_gbps=1.5625, memory_overhead_gib=1.5, host_ram_gib=768,
                    host_cpu_cores=threads)


def zero3(offload: str, engine: str = "deepspeed", dp: int = 8) -> Layout:
    return Layout.of(tp=1, pp=1, dp=dp, mbs=1, act_ckpt_layers=32, global_batch_size=8 * dp, zero_stage=3, offload=offload, engine=engine)


def app(*overrides: str):
    cfg, _ = compose(["search_config=gpt3/tiny", *overrides])
    return to_app_config(cfg)


# ---------------------------------------------------------------------------------------------- presets

@pytest.mark.e2e  # a sweep of every shipped preset
@pytest.mark.parametrize("preset", PRESETS)
def test_every_gpu_preset_names_its_hosts_cpu_threads_with_a_source(preset):
    """Each shipped preset (but the CPU budget preset, whose machine varies) gives its node's threads, with the
    node in the comment as its other keys give theirs; resolve_cluster carries the value onto Hardware."""
    line = next((l for l in (GPU_DIR / f"{preset}.yaml").read_text().splitlines()
                 if l.startswith("host_cpu_cores:")), None)
    threads = app(f"gpu={preset}").gpu.host_cpu_cores
    if preset == "cpu":
        assert threads is None
    else:
        assert line is not None and "#" in line and "(" in line.split("#", 1)[1], line
        assert threads is not None and threads >= 1
    assert resolve_cluster(app(f"gpu={preset}")).hw.host_cpu_cores == threads


@pytest.mark.parametrize("preset, threads", [("a10g", 192), ("a10g_g5_4xlarge", 16), ("l4", 192),
                                             ("v100_16gb", 64), ("v100_32gb", 96), ("h100_80gb", 224),
                                             ("a100_80gb", 256), ("t4", 48)])
def test_presets_carry_their_instances_threads(preset, threads):
    """The nodes the presets' comments name (REFERENCE §17 and the instance pages): g5.48xlarge and g6.48xlarge 192,
    g5.4xlarge 16, p3.16xlarge 64, p3dn.24xlarge 96, DGX H100 224, DGX A100 256, g4dn.12xlarge 48."""
    assert app(f"gpu={preset}").gpu.host_cpu_cores == threads


@pytest.mark.parametrize("value", [0, -8, "many", "16 vCPUs"])
def test_a_bad_host_cpu_cores_is_refused_naming_the_key(value):
    """As a preset file or a config dictionary gives it: a zero, a negative count or words."""
    cfg, _ = compose(["search_config=gpt3/tiny", "gpu=a10g"])
    plain = OmegaConf.to_container(cfg)
    plain["gpu"]["host_cpu_cores"] = value
    with pytest.raises(ConfigError) as err:
        to_app_config(plain)
    assert err.value.key == KEY, err.value
    if isinstance(value, int):
        assert "positive number of CPU threads" in str(err.value)
        assert "vCPUs" in err.value.fix and "null" in err.value.fix


@pytest.mark.parametrize("value", ["0", "-8"])
def test_a_bad_host_cpu_cores_on_the_command_line_is_refused_naming_the_key(value):
    cfg, _ = compose(["search_config=gpt3/tiny", "gpu=a10g", f"{KEY}={value}"])
    with pytest.raises(ConfigError) as err:
        to_app_config(cfg)
    assert err.value.key == KEY and "positive number of CPU threads" in str(err.value)


def test_null_host_cpu_cores_is_accepted_and_reaches_hardware_as_unknown():
    a = app("gpu=a10g", f"{KEY}=null")
    assert a.gpu.host_cpu_cores is None and resolve_cluster(a).hw.host_cpu_cores is None


# --------------------------------------------------------------------------------------------- the rule

def test_cpu_adam_rate_is_per_thread_up_to_the_memory_bandwidth_ceiling():
    assert cpu_adam_params_per_s(hardware(None)) == CPU_ADAM_PARAMS_PER_S
    assert cpu_adam_params_per_s(hardware(96)) == pytest.approx(CPU_ADAM_PARAMS_PER_S)  # the paper's own host
    assert cpu_adam_params_per_s(hardware(16)) == pytest.approx(16 * CPU_ADAM_PARAMS_PER_S_PER_THREAD)
    assert cpu_adam_params_per_s(hardware(192)) == pytest.approx(2 * CPU_ADAM_PARAMS_PER_S)
    assert cpu_adam_params_per_s(hardware(256)) == cpu_adam_params_per_s(hardware(1024)) == CPU_ADAM_MAX_PARAMS_PER_S


@pytest.mark.parametrize("offload", ["optimizer", "optimizer_and_params"])
@pytest.mark.parametrize("engine", ["deepspeed", "torch"])
def test_the_same_offload_layout_is_slower_on_a_16_thread_node_by_its_cpu_adam_share(offload, engine):
    """One g5.4xlarge-like node of 16 threads against a g5.48xlarge-like one of 192, one GPU each: the step
    differs by exactly the CPU step of the rank's shard at the two rates, nothing else."""
    layout = zero3(offload, engine, dp=1)
    small, big = hardware(16, gpus_per_node=1), hardware(192, gpus_per_node=1)
    t_small, t_big = estimate_step_time(LLAMA_7B, layout, small, 1), estimate_step_time(LLAMA_7B, layout, big, 1)
    shard = _local_parameters(LLAMA_7B, layout)
    cpu_share = shard / (16 * CPU_ADAM_PARAMS_PER_S_PER_THREAD) - shard / (192 * CPU_ADAM_PARAMS_PER_S_PER_THREAD)
    assert t_small.total_s - t_big.total_s == pytest.approx(cpu_share, rel=1e-9)
    assert t_small.offload_s - t_big.offload_s == pytest.approx(cpu_share, rel=1e-9)
    assert dataclasses.replace(t_small, offload_s=0) == dataclasses.replace(t_big, offload_s=0)
    assert cpu_share > 5.0  # a 7B model's CPU step: 10 s on 16 threads, under 1 s on 192


def test_null_host_cpu_cores_keeps_the_reference_figure_exactly():
    """Unknown threads price the node at the paper's 4e9 parameters per second, shared by its GPUs, as before."""
    layout = zero3("optimizer")
    hw = hardware(None)
    shard = layout.shard(_local_parameters(LLAMA_7B, layout))
    # DeepSpeed moves each of the 8 micro-batches' 16-bit gradients down (ZeRO-Offload adds them on the host) and
    # the updated 16-bit weights up once
    pcie = (8 * 2 + 2) * shard / (hw.pcie_bandwidth_gbps * 1e9)
    assert offload_s(LLAMA_7B, layout, hw) == pytest.approx(pcie + shard / (4e9 / 8), rel=1e-12)
    assert offload_s(LLAMA_7B, layout, hardware(96)) == pytest.approx(offload_s(LLAMA_7B, layout, hw), rel=1e-12)


def test_no_offload_does_not_depend_on_the_host():
    layout = zero3("none")
    assert estimate_step_time(LLAMA_7B, layout, hardware(16), 1) == estimate_step_time(LLAMA_7B, layout,
                                                                                      hardware(192), 1)


def test_lora_offload_steps_only_the_adapters_on_the_host():
    """Under LoRA the frozen base has no gradients and no optimizer states: the CPU step covers the adapters,
    so a 16-thread host costs a LoRA layout far less than a full one."""
    layout = zero3("optimizer_and_params", "torch", dp=1)
    lora = layout.replace(method="lora", lora=Adapters(16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))
    small, big = hardware(16, gpus_per_node=1), hardware(192, gpus_per_node=1)
    full_gap = offload_s(LLAMA_7B, layout, small) - offload_s(LLAMA_7B, layout, big)
    lora_gap = offload_s(LLAMA_7B, lora, small) - offload_s(LLAMA_7B, lora, big)
    assert 0 < lora_gap < full_gap / 100


def test_gpu_preset_files_parse_with_a_number_or_null():
    for preset in PRESETS:
        data = yaml.safe_load((GPU_DIR / f"{preset}.yaml").read_text())
        value = data.get("host_cpu_cores", "absent")
        assert value is None or isinstance(value, (int, float)), (preset, value)


def test_the_collector_prices_the_full_run_with_the_same_host_as_the_planner(tmp_path):
    """The base config written with the plan carries the node's threads, so the collector's full-run
    extrapolation steps the optimizer at the planner's rate (6 x g5.4xlarge: 16 threads, not the default)."""
    from hp_tool.estimate.speed import offload_s
    from hp_tool.plan_output import write_plan
    from hp_tool.planner import make_plan
    from hp_tool.results.full_run import load_full_run

    cfg, name = compose(["search_config=finetune/llama2_7b_a10g"])
    plan = make_plan(to_app_config(cfg), name, tmp_path / "res")
    write_plan(plan)
    full = load_full_run(tmp_path / "res")
    assert full.hw.host_cpu_cores == plan.cluster.hw.host_cpu_cores == 16
    offloaded = next(c for c in plan.candidates if c.offload != "none" and c.step_time_s is not None)
    shape, layout = offloaded.shape, offloaded.full
    assert offload_s(shape, layout, full.hw) == pytest.approx(offload_s(shape, layout, plan.cluster.hw))
    assert offload_s(shape, layout, full.hw) > offload_s(shape, layout, dataclasses.replace(full.hw, host_cpu_cores=None))


def test_the_host_memory_bounds_cpu_adam_where_its_threads_would_step_faster():
    """CPU Adam streams about 30 bytes per parameter through host memory, at STREAM's 73% of its peak: a 256-thread
    host with 8 channels of DDR4-3200 (204.8 GB/s) steps what its memory carries (5e9 parameters per second), not
    what its threads would (1.1e10); a DGX H100 (224 threads, 614.4 GB/s) steps at its threads' rate; an unknown
    host memory keeps the 2-socket DDR4-3200 ceiling. Every GPU preset names its host's memory."""
    from hp_tool.estimate.speed import CPU_ADAM_MAX_PARAMS_PER_S, CPU_ADAM_PARAMS_PER_S_PER_THREAD, cpu_adam_params_per_s

    def hw(threads, gbps):
        return Hardware(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_bandwidth_gbps=300,
                        inter_node_bandwidth_gbps=25, memory_overhead_gib=3, host_cpu_cores=threads,
                        host_memory_bandwidth_gbps=gbps)

    assert cpu_adam_params_per_s(hw(256, 204.8)) == pytest.approx(0.73 * 204.8e9 / 30)
    assert cpu_adam_params_per_s(hw(224, 614.4)) == pytest.approx(224 * CPU_ADAM_PARAMS_PER_S_PER_THREAD)
    assert cpu_adam_params_per_s(hw(256, None)) == pytest.approx(CPU_ADAM_MAX_PARAMS_PER_S) == pytest.approx(1e10, rel=0.01)
    for path in sorted((Path(__file__).parent.parent / "hp_tool" / "conf" / "gpu").glob("*.yaml")):
        gbps = yaml.safe_load(path.read_text())["host_memory_bandwidth_gbps"]
        assert (gbps is None) == (path.stem == "cpu"), path.stem
