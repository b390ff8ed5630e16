"""GPUs without bf16 (V100, T4): their presets plan, bf16 on them is refused before anything is written,
and a null precision picks the GPU's own (bf16, else fp16).
"""

from pathlib import Path

import pytest

from hp_tool.cli import compose
from hp_tool.config import to_app_config, training_precision
from hp_tool.contracts.spec import load_spec
from hp_tool.errors import ConfigError
from hp_tool.planner import make_plan
from search_helpers import main_here

REPO = Path(__file__).resolve().parent.parent
NO_BF16 = {"v100_16gb": (15.78, 125, 15.7, 150), "v100_32gb": (31.74, 125, 15.7, 150), "t4": (14.56, 65, 8.1, 16)}
PRECISION = "search_config.train_settings.precision"


def main(tmp_path, *args):
    """`python3 main.py` with results under tmp_path/res, run in this process (search_helpers.main_here)."""
    return main_here(f"base_results_dir={tmp_path / 'res'}", *args, cwd=tmp_path)


def load(*overrides):
    cfg, name = compose(list(overrides))
    return to_app_config(cfg), name


# ------------------------------------------------------------------------------ presets and precision

@pytest.mark.e2e
@pytest.mark.parametrize("gpu", sorted(NO_BF16))
def test_a_gpu_without_bf16_plans_a_dry_run_in_fp16(tmp_path, gpu):
    node = ["search_config.train_settings.gpus_per_node=4"] if gpu == "t4" else []
    proc = main(tmp_path, f"gpu={gpu}", "search_config=llama/llama2_7b", "dry_run=true", f"{PRECISION}=fp16", *node)
    assert proc.returncode == 0, proc.stderr
    memory, fp16, _, _ = NO_BF16[gpu]
    base = load_spec(next((tmp_path / "res" / "llama" / "llama2_7b").glob("base_cfg_*.yaml")))
    assert base.training.precision == "fp16" and base.resources.peak_tflops_per_gpu == fp16
    assert (base.resources.gpu, base.resources.gpu_memory_gib) == (gpu, memory)


@pytest.mark.parametrize("gpu", sorted(NO_BF16))
def test_bf16_on_a_gpu_without_it_names_key_value_and_fix_and_writes_nothing(tmp_path, gpu):
    proc = main(tmp_path, f"gpu={gpu}", "search_config=llama/llama2_7b", "dry_run=true")  # the preset's bf16
    assert proc.returncode == 2
    assert f"{PRECISION}='bf16': gpu={gpu} has no bf16" in proc.stderr
    assert f"Fix: set {PRECISION}=fp16 (trained with dynamic loss scaling) or fp32" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("gpu, precision, peak", [("t4", "fp16", 65), ("v100_32gb", "fp16", 125),
                                                  ("a100_80gb", "bf16", 312)])
def test_null_precision_is_bf16_where_the_gpu_has_it_else_fp16(tmp_path, gpu, precision, peak):
    app, search = load(f"gpu={gpu}", "search_config=gpt3/1b", f"{PRECISION}=null")
    assert app.search_config.train_settings.precision is None and training_precision(app) == precision
    plan = make_plan(app, search, tmp_path)
    assert plan.cluster.hw.peak_tflops == peak and {c.full.precision for c in plan.candidates} == {precision}
    assert plan.base.training.precision == precision
    assert {s.training.precision for s in plan.specs} == {precision}


@pytest.mark.parametrize("gpu", sorted(NO_BF16))
def test_presets_carry_their_datasheet_figures(gpu):
    memory, fp16, fp32, intra = NO_BF16[gpu]
    g = load(f"gpu={gpu}", "search_config=gpt3/tiny")[0].gpu
    figures = (g.memory_gib, g.peak_tflops.fp16, g.peak_tflops.fp32, g.intra_node_bandwidth_gbps)
    assert figures == (memory, fp16, fp32, intra)
    assert g.peak_tflops.bf16 is None and not g.supports("bf16") and g.supports("fp16")


# ------------------------------------------------------------------- workstation and small-lab GPUs

# preset -> (datasheet label GB, dense bf16 TFLOPS with FP32 accumulate, memory bandwidth GB/s)
WORKSTATION = {"rtx_3090": (24, 71, 936), "rtx_4090": (24, 165.2, 1008), "rtx_a5000": (24, 111.1, 768),
               "rtx_a6000": (48, 154.8, 768), "rtx_6000_ada": (48, 364.2, 960), "l40s": (48, 362, 864)}
SMALL = sorted(g for g, (label, _, _) in WORKSTATION.items() if label == 24)
LARGE = sorted(g for g, (label, _, _) in WORKSTATION.items() if label == 48)
TS = "search_config.train_settings"


def one_gpu_plan(tmp_path, gpu, model, method):
    """A one-GPU fine-tuning question at 2048 tokens without offload: make_plan's answer, or its ConfigError
    when no layout fits."""
    cfg, name = compose([f"search_config=finetune/{model}", f"gpu={gpu}", f"{TS}.num_nodes=1", f"{TS}.gpus_per_node=1",
                         f"{TS}.methods=[{method}]", f"{TS}.seq_lengths=[2048]", f"{TS}.global_batch_tokens=16384",
                         f"{TS}.offload=[none]"])
    return make_plan(to_app_config(cfg), name, tmp_path / f"{gpu}_{model}_{method}")


def fitting(plan):
    return [c for c in plan.candidates if c.status == "selected"]


@pytest.mark.parametrize("gpu", sorted(WORKSTATION))
def test_each_workstation_preset_composes_with_its_datasheet_figures_and_sources(gpu):
    app, _ = load(f"gpu={gpu}", "search_config=finetune/tiny")
    g = app.gpu
    label, bf16, bandwidth = WORKSTATION[gpu]
    assert g.name == gpu and g.supports("bf16") and app.gpu.default_precision() == "bf16"
    assert (g.peak_tflops.bf16, g.peak_tflops.fp16, g.memory_bandwidth_gbps) == (bf16, bf16, bandwidth)
    assert 0.9 * label < g.memory_gib < label  # what torch reports: a little under the board's GiB
    assert g.peak_tflops.fp32 < g.peak_tflops.bf16 and g.host_ram_gib and g.price_per_gpu_hour
    text = (REPO / "hp_tool/conf/gpu" / f"{gpu}.yaml").read_text()
    assert "Sources:" in text and "example only" in text and "not fitted" in text
    for line in text.splitlines():
        if line.split("#")[0].strip().endswith(":") or not line.strip() or line.startswith("#"):
            continue
        assert "#" in line, line  # every value names its source


@pytest.mark.parametrize("gpu", sorted(WORKSTATION))
def test_llama2_7b_full_fine_tuning_needs_more_than_one_card_but_lora_and_qlora_fit(tmp_path, gpu):
    """Unsharded Adam holds 16 bytes a parameter (over 100 GiB for 6.7B): no single card here fits full
    fine-tuning without offload, while LoRA (16-bit frozen base) and QLoRA (4-bit base) fit, QLoRA smaller."""
    with pytest.raises(ConfigError) as err:
        one_gpu_plan(tmp_path, gpu, "llama2_7b", "full")
    assert err.value.key == "gpu.memory_gib" and "no valid layout fits in memory" in str(err.value)
    lora, qlora = (fitting(one_gpu_plan(tmp_path, gpu, "llama2_7b", m)) for m in ("lora", "qlora"))
    assert lora and qlora
    assert min(c.memory_gib for c in qlora) < min(c.memory_gib for c in lora) < 0.95 * WORKSTATION[gpu][0]


def test_48gb_cards_fit_llama2_13b_lora_where_the_24gb_cards_do_not(tmp_path):
    """Llama-2 13B's 16-bit frozen weights alone are 24 GiB: LoRA on one card needs a 48 GB one; QLoRA fits
    the 24 GB cards too."""
    for gpu in SMALL:
        with pytest.raises(ConfigError) as err:
            one_gpu_plan(tmp_path, gpu, "llama2_13b", "lora")
        assert err.value.key == "gpu.memory_gib"
        assert fitting(one_gpu_plan(tmp_path, gpu, "llama2_13b", "qlora"))
    for gpu in LARGE:
        plan = one_gpu_plan(tmp_path, gpu, "llama2_13b", "lora")
        usable = 0.95 * plan.cluster.hw.gpu_memory_gib
        assert fitting(plan) and all(24 < c.memory_gib <= usable for c in fitting(plan))


def test_a_geforce_cards_half_rate_tensor_math_predicts_slower_steps_than_the_pro_card_of_its_die(tmp_path):
    """The RTX 4090 and the RTX 6000 Ada are both AD102; the GeForce card's BF16 with FP32 accumulate runs at
    half rate, so the same QLoRA layout is predicted slower on it."""
    def fastest(gpu):
        return min(c.step_time_s for c in fitting(one_gpu_plan(tmp_path, gpu, "llama2_7b", "qlora")) if c.mbs == 1)
    assert fastest("rtx_4090") > 1.3 * fastest("rtx_6000_ada")
