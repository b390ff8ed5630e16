"""LoRA and QLoRA as searched methods: adapter counts equal peft's, memory per method against the trace, the
same losses in every layout, a search over the three methods and the adapters saved in peft's format.
Trials run on 2 CPU processes (gloo, fp32; QLoRA on bitsandbytes' CPU path)."""

import csv
import dataclasses
from pathlib import Path

import pytest
import torch

from hp_tool.architectures import count_parameters
from hp_tool.cli import compose
from hp_tool.config import to_app_config
from hp_tool.contracts.spec import DataSpec, LoraSpec
from hp_tool.families.methods import trainable_parameters
from hp_tool.hf_config import load_hf_model
from hp_tool.planner import make_plan
from hp_tool.recipe import Adapters
from search_helpers import main_here
from trial_helpers import launched, read_metrics, tiny_spec, torchrun, write_spec

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_count(config: dict, rank: int, targets) -> int:
    """Trainable parameters peft reports for LoRA on transformers' own model (built on the meta device)."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=list(targets)))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# The covering set: each model type's code path once (llama, qwen2's biases, phi3's fused linears, gemma2, gemma3);
# Mistral's layers are Llama's (the matrix tier, -m matrix).
@pytest.mark.e2e
@pytest.mark.parametrize("name, rank, targets", [("llama2_7b", 8, ("q_proj", "v_proj")), ("tiny", 4, ALL),
                                                 ("qwen2_5_7b", 16, ALL),
                                                 pytest.param("mistral_7b", 64, ("o_proj", "down_proj"),
                                                              marks=pytest.mark.matrix),
                                                 ("phi3_mini_4k", 16, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
                                                 ("gemma2_9b", 16, ALL), ("gemma3_12b", 8, ("q_proj", "k_proj", "v_proj"))])
def test_adapter_counts_equal_pefts(name, rank, targets):
    hf = load_hf_model(name)
    shape = hf.shape(512)
    n = trainable_parameters(shape, Adapters(rank, target_modules=targets), count_parameters(shape))
    assert n == peft_count(hf.config, rank, targets)
    if name == "llama2_7b":
        assert n == 4_194_304  # peft's printout for Llama-2 7B, r=8 on q_proj and v_proj (REFERENCE §13)


def plan(tmp_path, *overrides):
    cfg, name = compose(list(overrides))
    return make_plan(to_app_config(cfg), name, tmp_path / name)


def test_per_gpu_memory_orders_full_over_lora_over_qlora(tmp_path):
    """Llama-2 7B on one A10G 24 GiB per node: full fine-tuning fits only sharded or offloaded, LoRA fits on
    one GPU unsharded, QLoRA in less."""
    p = plan(tmp_path, "search_config=finetune/llama2_7b_a10g", "search_config.train_settings.methods=[full,lora,qlora]",
             "dry_run=true",
             "search_config.train_settings.precision=bf16", "search_config.train_settings.seq_lengths=[2048]")
    same = {}
    for c in p.candidates:
        if c.full_memory_gib is not None:
            same.setdefault((c.engine, c.pp, c.mbs, c.act_ckpt_layers, c.zero_stage, c.offload), {})[c.full.method] = c
    trios = [v for k, v in same.items() if len(v) == 3]
    assert trios
    for trio in trios:
        assert trio["full"].full_memory_gib > trio["lora"].full_memory_gib > trio["qlora"].full_memory_gib
    lora_alone = [c for c in p.candidates if c.full.method == "lora" and c.status in ("selected", "over_limit")
                  and c.zero_stage == 0 and c.offload == "none"]
    assert lora_alone and not any(c.full.method == "full" and c.zero_stage == 0 and c.status == "selected"
                                  for c in p.candidates)
    from hp_tool.plan_output import plan_rows

    by_method = {r["method"]: r for r in plan_rows(p)}
    assert by_method["lora"]["trainable_parameters"] < by_method["full"]["trainable_parameters"] == 6_738_415_616
    assert by_method["qlora"]["lora_rank"] == 16 and by_method["full"]["lora_rank"] is None


# The covering set: FSDP2 (ZeRO-3, the torch engine's sharded data parallelism); LoRA replicated over GPUs (ZeRO 0
# and 1) is traced by test_lora_replicated_over_gpus_keeps_no_copy_of_its_frozen_base. One process, DDP and ZeRO-1
# on CPU are the matrix tier (-m matrix).
@pytest.mark.e2e
@pytest.mark.parametrize("layout", [pytest.param({}, marks=pytest.mark.matrix),
                                    pytest.param({"dp": 2, "zero_stage": 0}, marks=pytest.mark.matrix),
                                    pytest.param({"dp": 2, "zero_stage": 1}, marks=pytest.mark.matrix),
                                    {"dp": 2, "zero_stage": 3}],
                         ids=["one", "ddp", "zero1", "fsdp2"])
def test_lora_memory_model_matches_the_trace(layout):
    from hp_tool.estimate.memory import estimate_memory
    from hp_tool.trial.memterms import target_hardware, target_layout, with_layout
    from hp_tool.trial.trace.replay import trace_stage

    spec = with_layout(tiny_spec("llama", gbs=16), **layout)
    model = dataclasses.replace(spec.model, num_layers=8, hidden_size=256, ffn_hidden_size=704, seq_length=256,
                                method="lora", lora=LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=list(ALL)))
    spec = dataclasses.replace(spec, model=model)
    traced = trace_stage(spec, 0, "cpu").peak_bytes
    e = estimate_memory(spec.model.shape(), target_layout(spec, "cpu"), target_hardware("cpu"))
    assert (e.total_gib - e.overhead_gib) * 2**30 == pytest.approx(traced, rel=0.03)


def lora_spec(**layout):
    spec = tiny_spec("llama", max_steps=3, **layout)
    lora = LoraSpec(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, method="lora", lora=lora))


def one_batch_data(folder: Path) -> DataSpec:
    """A token file of exactly one global batch of the tiny spec (8 windows of 65 tokens): every step of a run
    reads the same batch, so a later step's loss differs from the first only by what the updates changed."""
    from hp_tool.trial.data import synthetic_stream

    spec, path = lora_spec(), folder / "one_batch.bin"
    window = spec.model.seq_length + 1
    tokens = synthetic_stream(spec.training.seed, spec.model.vocab_size, spec.training.global_batch_size * window)
    tokens.astype("uint16").tofile(path)
    return DataSpec(source="file", path=str(path), dtype="uint16")


# The layouts each method trains in, all on the one-batch file. "one" (one process) is each method's reference.
# QLoRA's 4-bit base takes no sharding of its weights (ZeRO 0-1, the torch engine).
LAYOUTS = {"lora": {"one": {}, "ddp": dict(dp=2, zero_stage=0), "fsdp2": dict(dp=2, zero_stage=3),
                    "pp": dict(pp=2, zero_stage=0), "ds_z2": dict(dp=2, engine="deepspeed", zero_stage=2),
                    "ds_z3": dict(dp=2, engine="deepspeed", zero_stage=3)},
           "qlora": {"one": dict(zero_stage=0), "ddp": dict(dp=2, zero_stage=0), "zero1": dict(dp=2, zero_stage=1),
                     "pp": dict(pp=2, zero_stage=0)}}


@pytest.fixture(scope="module")
def adapter_losses(tmp_path_factory):
    """``losses(method, layout)``: the per-step losses of the tiny adapter spec trained by ``method`` in the named
    layout on the one-batch file, each run once per session (trial_helpers.launched: one process in this
    process, more as torchrun's ranks) and shared by the tests that compare them."""
    data = one_batch_data(tmp_path_factory.mktemp("one_batch"))

    def losses(method: str, layout: str) -> list[float]:
        spec = lora_spec(**LAYOUTS[method][layout])
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, method=method),
                                   training=dataclasses.replace(spec.training, data=data))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread, as each rank runs (a one-process spec runs in this process)
        try:
            run = launched(tmp_path_factory, spec)
        finally:
            torch.set_num_threads(threads)
        assert run.returncode == 0, f"{method} in {layout}: " + run.stderr[-3000:]
        return [m["loss"] for m in read_metrics(run.out)]

    return losses


# The covering set (the default run): each parallelism once per engine with LoRA (torch: FSDP2's data parallelism
# and the pipeline; DeepSpeed: ZeRO-3) and QLoRA's 4-bit base once, in data parallelism with ZeRO-1 (the most it
# takes). The rest of the product (LoRA in DDP and DeepSpeed's ZeRO-2, QLoRA in DDP and a pipeline) is the matrix
# tier (-m matrix).
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "pp", "ds_z3", pytest.param("ddp", marks=pytest.mark.matrix),
                                    pytest.param("ds_z2", marks=pytest.mark.matrix)])
def test_lora_trains_the_same_in_every_layout(adapter_losses, layout):
    assert adapter_losses("lora", layout) == pytest.approx(adapter_losses("lora", "one"), rel=1e-4)


@pytest.mark.e2e
def test_lora_adapters_train(adapter_losses):
    """The adapters trained: the same batch costs less after two updates (with frozen adapters, exactly as much)."""
    one = adapter_losses("lora", "one")
    assert one[2] < one[0]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero1", pytest.param("ddp", marks=pytest.mark.matrix),
                                    pytest.param("pp", marks=pytest.mark.matrix)])
def test_qlora_trains_the_same_in_its_layouts(adapter_losses, layout):
    """QLoRA through bitsandbytes' NF4 Linear4bit (its CPU path): the 4-bit base gives the same losses in every
    layout it runs as in one process (DDP, ZeRO-1, PP; quantisation is deterministic, so rel 1e-4 holds as for
    LoRA). Covering set: ZeRO-1 (see test_lora_trains_the_same_in_every_layout)."""
    assert adapter_losses("qlora", layout) == pytest.approx(adapter_losses("qlora", "one"), rel=1e-4)


@pytest.mark.e2e
def test_qlora_is_close_to_but_not_lora(adapter_losses):
    """The 4-bit base is quantised: QLoRA's first loss is close to LoRA's on the same batch (within 1%), not it."""
    first, qlora_first = adapter_losses("lora", "one")[0], adapter_losses("qlora", "one")[0]
    assert qlora_first != first and qlora_first == pytest.approx(first, rel=0.01)


@pytest.mark.e2e
def test_adapters_save_in_pefts_format(tmp_path):
    from test_finetune_trials import make_checkpoint, spec_for

    config = make_checkpoint(tmp_path / "model")
    spec = spec_for(tmp_path / "model", config, dp=2, zero_stage=3)
    lora = LoraSpec(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, method="lora", lora=lora),
                               training=dataclasses.replace(spec.training, lr=1e-2),
                               run=dataclasses.replace(spec.run, max_steps=2, save_dir=str(tmp_path / "adapter")))
    proc = torchrun(write_spec(spec, tmp_path), tmp_path / "out", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    tuned = PeftModel.from_pretrained(base, tmp_path / "adapter")
    adapters = {n: p for n, p in tuned.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * 2 * 4  # A and B of q_proj and v_proj in 4 layers
    assert all(p.abs().max() > 0 for n, p in adapters.items() if "lora_B" in n)  # B trained away from zero
    merged = tuned.merge_and_unload().state_dict()
    moved = [k for k in before if not torch.equal(before[k], merged[k])]
    assert moved and all("q_proj" in k or "v_proj" in k for k in moved)  # only the adapted weights change


BAD = [
    ("search_config.train_settings.lora.rank=0", "search_config.train_settings.lora.rank", "at least 1"),
    # these two check against transformers' model, whose first import in a process takes seconds
    pytest.param("search_config.train_settings.lora.rank=40", "search_config.train_settings.lora.rank",
                 "narrowest adapted width (32)", marks=pytest.mark.e2e),
    pytest.param("search_config.train_settings.lora.target_modules=[q_proj,wq]",
                 "search_config.train_settings.lora.target_modules", "['wq'] are not linear modules",
                 marks=pytest.mark.e2e),
    ("search_config.train_settings.methods=[qlora]", "search_config.train_settings.precision", "not in fp32"),
]


@pytest.mark.parametrize("override, key, words", BAD)
def test_bad_method_input_fails_before_anything_is_written(tmp_path, override, key, words):
    proc = main_here("search_config=finetune/tiny", "dry_run=true", f"base_results_dir={tmp_path / 'res'}",
                     "search_config.train_settings.methods=[full,lora]", override, cwd=tmp_path)
    assert proc.returncode == 2 and key in proc.stderr and words in proc.stderr and "Fix:" in proc.stderr
    assert not (tmp_path / "res").exists()


def test_qlora_layouts_the_4bit_weights_cannot_take_are_invalid(tmp_path):
    p = plan(tmp_path, "search_config=finetune/llama2_7b_a10g", "search_config.train_settings.methods=[qlora]",
             "search_config.train_settings.precision=bf16", "search_config.train_settings.seq_lengths=[2048]")
    bad = [c for c in p.candidates if c.engine == "deepspeed" or c.zero_stage > 1 or c.offload != "none"]
    assert bad and all(c.status == "invalid" for c in bad)
    assert any("not sharded by FSDP2 or DeepSpeed" in c.reason for c in bad)
    assert p.specs and all(s.model.method == "qlora" and s.parallel.zero_stage <= 1 for s in p.specs)


@pytest.mark.e2e
@pytest.mark.slow
def test_tiny_search_ranks_trials_of_the_three_methods(finetune_methods_search):
    """finetune/tiny over full, LoRA and QLoRA, one trial each, searched for real (tests/shared_finetune_searches.py:
    the command line as a process, cluster=local, 2 CPU processes a trial)."""
    search = finetune_methods_search
    [run] = search.runs
    assert run.returncode == 0, run.output
    summary = list(csv.DictReader(open(search.final / "final_summary_1nodes.csv")))
    assert {r["method"] for r in summary} == {"full", "lora", "qlora"} and all(r["trainable_parameters"] for r in summary)
    rows = list(csv.DictReader(open(search.final / "all_trials_1nodes.csv")))
    ranked = [r for r in rows if r["rank"]]
    assert {r["method"] for r in ranked} == {"full", "lora", "qlora"} and all(r["status"] == "ok" for r in ranked)
    lora = next(r for r in ranked if r["method"] == "lora")
    # rank 16 on the 7 linears of 4 layers: 16 x (in + out) summed = 16 x 1168 per layer
    assert "_lora16_" in lora["trial_id"] and int(lora["trainable_parameters"]) == 4 * 16 * 1168
    # MFU counts what each method computes (families/methods.py): model FLOPs per token as the planner's
    from hp_tool.architectures import model_flops_per_step
    from hp_tool.contracts.spec import load_spec

    full = next(r for r in ranked if r["method"] == "full")
    per_token = {r["method"]: float(r["model_tflops_per_gpu"]) / float(r["tokens_per_s_per_gpu"]) for r in (full, lora)}
    models = {r["method"]: load_spec(search.results / "candidate_configs" / f"{r['trial_id']}.yaml").model
              for r in (full, lora)}
    expected = model_flops_per_step(models["lora"].shape(), 1, models["lora"].adapters) / \
        model_flops_per_step(models["full"].shape(), 1)
    assert per_token["lora"] / per_token["full"] == pytest.approx(expected, rel=1e-3) and expected != 1


def test_nf4_bits_per_parameter_match_bitsandbytes_storage():
    """4 bits per value, an 8-bit absmax per block of 64, one fp32 constant (and its offset) per 256 blocks:
    the analytic 4.127 bits against what bitsandbytes really stores for a quantised weight."""
    import bitsandbytes as bnb

    from hp_tool.families.methods import NF4_BITS

    n_out, n_in = 512, 2048
    weight = bnb.nn.Params4bit(torch.randn(n_out, n_in, dtype=torch.float16), requires_grad=False, quant_type="nf4",
                               compress_statistics=True).to("cpu")
    state = weight.quant_state
    stored = weight.numel() * weight.element_size() + state.absmax.numel() * state.absmax.element_size()
    stored += state.state2.absmax.numel() * state.state2.absmax.element_size()  # the second level's fp32 scales
    bits = 8 * stored / (n_out * n_in)
    assert NF4_BITS == pytest.approx(4.127, abs=1e-3) and bits == pytest.approx(NF4_BITS, rel=0.002)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_16_bit_adapter_trial_holds_its_frozen_base_in_16_bits(method):
    """As peft users load a base (torch_dtype=bfloat16): the frozen weights in the compute dtype, the adapters in
    fp32; on a CPU (no compute dtype) everything stays fp32. Built on meta, as the engine builds it before any
    storage exists, so no fp32 copy of the base is ever allocated."""
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    from hp_tool.trial.rank import OnMeta, build_rank_model

    spec = lora_spec(zero_stage=0)
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, method=method))
    from hp_tool.trial.methods import four_bit_weights

    stage = build_rank_model(spec, None, 0, OnMeta(), torch.bfloat16).stage
    on_gpu, four_bit = dict(stage.named_parameters()), four_bit_weights(stage)  # QLoRA quantises its own
    assert bool(four_bit) == (method == "qlora")
    adapters = {n for n in on_gpu if ".lora_" in n}
    assert adapters and all(on_gpu[n].dtype == torch.float32 and on_gpu[n].requires_grad for n in adapters)
    base = {n: p for n, p in on_gpu.items() if n not in adapters and p not in four_bit}
    assert base and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base.values())
    on_cpu = build_rank_model(spec, None, 0, OnMeta(), None).stage.parameters()
    assert {p.dtype for p in on_cpu if p.is_floating_point()} == {torch.float32}


def test_lora_7b_on_one_gpu_holds_a_16_bit_base_and_no_copy_of_it(tmp_path):
    """Llama-2 7B LoRA r16 on one 80 GB GPU, bf16: the states are the 16-bit base (2 bytes a parameter) and the
    adapters' fp32 weights, gradients, moments and bf16 casts (18 bytes each); not an fp32 base plus autocast's
    bf16 copy of it (6 bytes a parameter: 38 GiB where 13 GiB is held)."""
    from hp_tool.estimate.memory import estimate_memory

    p = plan(tmp_path, "search_config=finetune/llama2_7b", "gpu=h100_80gb", "dry_run=true",
             "search_config.train_settings.methods=[lora]", "search_config.train_settings.seq_lengths=[2048]",
             "search_config.train_settings.engines=[torch]", "search_config.train_settings.num_nodes=1",
             "search_config.train_settings.gpus_per_node=1")
    one = next(c for c in p.candidates if c.full.gpus == 1 and c.full.zero_stage == 0 and c.full.offload == "none")
    states = estimate_memory(one.shape, one.full, p.cluster.hw).model_states_gib * 2**30
    adapters = trainable_parameters(one.shape, one.full.lora, 6_738_415_616)
    assert states == pytest.approx(2 * 6_738_415_616 + 18 * adapters, rel=0.01)


@pytest.mark.e2e
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_lora_replicated_over_gpus_keeps_no_copy_of_its_frozen_base(zero_stage):
    """LoRA over 2 data-parallel GPUs (ZeRO 0-1, torch's replicate) holds what one GPU does, not a second,
    unsharded compute copy of the frozen base besides it (replicate leaves the frozen parameters alone): traced
    for a bf16 GPU on fake tensors, a model whose base outweighs its activations, and the memory model agrees."""
    from hp_tool.estimate.memory import estimate_memory
    from hp_tool.trial.memterms import target_hardware, target_layout, with_layout
    from trace_cache import trace_stage  # the one-GPU trace, traced once for both stages

    def traced_and_analytic(**layout):
        spec = with_layout(tiny_spec("llama", gbs=4), **layout)
        spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training, precision="bf16"))
        spec = dataclasses.replace(spec, model=dataclasses.replace(
            spec.model, num_layers=4, hidden_size=1024, ffn_hidden_size=2816, seq_length=32, num_attention_heads=8,
            num_kv_heads=8, method="lora", lora=LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=list(ALL))))
        e = estimate_memory(spec.model.shape(), target_layout(spec, "cuda"), target_hardware("cuda"))
        return trace_stage(spec, 0, "cuda").peak_bytes, (e.total_gib - e.overhead_gib) * 2**30

    one, one_analytic = traced_and_analytic()
    two, two_analytic = traced_and_analytic(dp=2, zero_stage=zero_stage)
    base = 4 * 12 * 1024 * 1024 * 2  # the layers' bf16 linears: 96 MiB
    assert two == pytest.approx(one, abs=0.1 * base)
    assert two_analytic == pytest.approx(two, rel=0.03) and one_analytic == pytest.approx(one, rel=0.03)
