"""Memory-saving dimensions of a layout: the trial engine, the ZeRO sharding stage and CPU offload.

One place for their names, for which combinations can run, and for how a trial id spells them; the
planner, the TrialSpec check and both trial engines call these. Pure, no torch.

Stages, as ZeRO (Rajbhandari et al. 2020) numbers them, over the data-parallel group:
  0  nothing sharded (torch: DDP)
  1  optimizer states sharded (torch: DDP with ZeroRedundancyOptimizer)
  2  + gradients sharded (torch: FSDP2 keeping parameters gathered between forward and backward)
  3  + parameters sharded (torch: FSDP2 full shard)
Offload moves the optimizer states (and with ``optimizer_and_params`` the parameters) to host RAM; the
optimizer step then runs on the CPU. The torch engine offloads through FSDP2's ``CPUOffloadPolicy``,
which always moves parameters, gradients and optimizer states together; DeepSpeed uses its
``offload_optimizer`` / ``offload_param``.
"""

from __future__ import annotations

from typing import Optional

from hp_tool.engine_facts import engine_facts
from hp_tool.families import family
from hp_tool.vocab import ACT_CKPT_MODES, LOSSES, OFFLOAD_CODES


# The memory savers from lightest to heaviest, as the heuristic (zero_stages / offload null) tries them;
# a lighter one is never predicted slower (candidates.py picks one per layout).
SAVING_ORDER = ((0, "none"), (1, "none"), (2, "none"), (3, "none"),
                (1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "optimizer_and_params"))


def layout_suffix(engine: str, zero_stage: int, offload: str) -> str:
    """How a trial id names these dimensions, e.g. ``torch_z3_noff``, ``ds_z2_offopt``."""
    return f"{engine_facts(engine).code}_z{zero_stage}_{OFFLOAD_CODES[offload]}"


def family_problem(family_name: str, engine: str) -> Optional[tuple[str, str]]:
    """(the train_settings key at fault, why) when ``engine`` cannot train a ``family_name`` model, else
    None: the family's record lists the engines that train it."""
    facts = family(family_name)
    if engine not in facts.trial.engines:
        return "engines", facts.trial.engines_note or f"{engine} does not train {family_name} models"
    return None


def method_problem(method: str, engine: str, tp: int, zero_stage: int, offload: str,
                   moe: bool = False) -> Optional[str]:
    """Why a layout cannot train with ``method``, or None: the torch engine's TP plan splits nn.Linear
    modules, which peft's LoRA layers wrap; bitsandbytes' 4-bit weights (QLoRA) are not sharded by FSDP2 or
    DeepSpeed and stay on the GPU; bitsandbytes quantises nn.Linear modules only, and a mixture of experts'
    experts are 3-D parameters."""
    if method == "full":
        return None
    if moe and method == "qlora":
        return ("qlora on a mixture of experts: bitsandbytes quantises nn.Linear modules, and the experts (most "
                "of the weights) are 3-D parameters it would leave in 16 bits")
    facts = engine_facts(engine)
    if tp > 1 and not facts.adapters_with_tp:
        return f"{method} with TP={tp}: the torch engine's TP plan splits nn.Linear modules, which peft's LoRA layers wrap"
    if method == "qlora" and (zero_stage not in facts.qlora_zero_stages or offload != "none"):
        return ("qlora runs on the torch engine with ZeRO 0-1 and no offload: bitsandbytes' 4-bit weights are "
                "not sharded by FSDP2 or DeepSpeed")
    return None


def expert_problem(num_experts: int, ep: int, dp: int, tp: int, engine: str) -> Optional[str]:
    """Why a layout cannot run a mixture of experts with its experts split over ``ep`` ranks, or None. EP
    takes whole experts (it divides their count) from the data-parallel ranks (it divides DP); only the torch
    engine splits experts (transformers' expert-parallel all-to-all dispatch; with TP each TP rank dispatches
    its slice of the tokens). DeepSpeed's AutoTP cannot split transformers' 3-D expert tensors."""
    facts = engine_facts(engine)
    if num_experts and not facts.experts_with_tp and tp > 1:
        return (f"a mixture of experts on deepspeed with TP={tp}: DeepSpeed's AutoTP cannot split transformers' "
                "expert tensors (partition styles moe_tp_experts, packed_colwise); use TP 1 or engine torch")
    if ep == 1:
        return None
    if not num_experts:
        return f"EP={ep} on a dense model (no experts to split): use EP 1"
    if num_experts % ep:
        return f"EP={ep} does not divide the {num_experts} experts"
    if dp % ep:
        return f"EP={ep} does not divide the DP={dp} ranks it spans"
    if not facts.expert_parallel:
        return (f"EP={ep} on engine {engine}: only the torch engine splits experts (DeepSpeed shards them with "
                "ZeRO as any weight, at EP 1)")
    return None


def expert_saver_problem(ep: int, zero_stage: int, offload: str) -> Optional[str]:
    """Why the torch engine cannot split experts over ``ep`` ranks at this ZeRO stage, or None: ZeRO-1's
    sharded optimizer spans the whole DP group, whose ranks hold different experts; ZeRO 0, 2 and 3 (with
    FSDP2's offload too) wrap the experts over the ranks holding the same ones."""
    if ep > 1 and zero_stage == 1:
        return (f"EP={ep} with ZeRO 1: the torch engine's sharded optimizer spans the whole DP group, whose ranks "
                "hold different experts; use ZeRO 0, 2 or 3")
    return None


def master_weights_problem(master_weights: str, engine: str, offload: str) -> Optional[str]:
    """Why an engine cannot hold its trained weights as ``master_weights``, or None: bf16 weights with bf16
    optimizer states and no fp32 copy on an engine that trains them so (the torch engine), without offload."""
    if master_weights == "fp32":
        return None
    if not engine_facts(engine).bf16_master:
        return f"master_weights bf16: the {engine} engine keeps an fp32 master copy of its 16-bit weights"
    if offload != "none":
        return f"master_weights bf16 with offload {offload}: bf16 weights are planned on the GPU, without offload"
    return None


def optimizer_problem(optimizer: str, engine: str, zero_stage: int, offload: str) -> Optional[str]:
    """Why an engine cannot run ``optimizer`` with this ZeRO stage and offload, or None: offloaded states
    are stepped by DeepSpeed's CPU Adam (deepspeed) or on the host (torch), where bitsandbytes' 8-bit
    AdamW does not run; the torch engine's ZeRO-1 shards AdamW and SGD (torch's ZeroRedundancyOptimizer)."""
    if optimizer == "adamw":
        return None
    facts = engine_facts(engine)
    if offload != "none" and optimizer not in facts.offloaded_optimizers:
        return f"{optimizer} with offload {offload}: {facts.offload_step_note}"
    if zero_stage == 1 and facts.zero1_optimizers is not None and optimizer not in facts.zero1_optimizers:
        return "the torch engine's ZeRO-1 shards AdamW and SGD, not bitsandbytes' 8-bit AdamW"
    return None


def combination_problem(engine: str, zero_stage: int, offload: str, tp: int, pp: int) -> Optional[tuple[str, str]]:
    """(the train_settings key at fault, why) when engine x stage x offload x TP/PP cannot run, else None."""
    if offload != "none" and zero_stage == 0:
        return "offload", f"offload={offload} needs ZeRO stage >= 1 (the offloaded optimizer states are partitioned)"
    if offload == "optimizer_and_params" and zero_stage < 3:
        return "offload", f"parameter offload needs ZeRO stage 3 (stage {zero_stage} keeps whole parameters on the GPU)"
    facts = engine_facts(engine)
    if offload not in facts.offloads:
        return "offload", facts.offload_note
    if offload != "none" and zero_stage < facts.offload_min_zero_stage:
        return "offload", (f"the {engine} engine offloads at ZeRO stage {facts.offload_min_zero_stage} or above (FSDP2 "
                           f"shards the gradients the host steps), not {zero_stage}")
    if pp > 1 and facts.pp_zero_stages is None:
        if zero_stage >= 2:
            return "zero_stages", f"DeepSpeed pipeline parallelism supports ZeRO stages 0-1, not {zero_stage}"
        return "engines", f"hp_tool's DeepSpeed engine runs without pipeline parallelism (PP={pp}): use the torch engine"
    if tp > 1 and zero_stage not in facts.tp_zero_stages:
        return "zero_stages", "DeepSpeed's tensor parallelism (AutoTP) composes with ZeRO stages 0-2, not 3"
    return None


def sequence_problem(family_name: str, seq_length: int, tp: int, pp: int, cp: int, ep: int, sequence_parallel: bool,
                     loss: str, activation_offload: bool, engine: str) -> Optional[tuple[str, str]]:
    """(the Layout field at fault, why) when the long-context savers cannot run this way, else None.

    - chunked loss: the torch engine at TP 1 (with TP the vocabulary-parallel loss already splits the logits
      over TP, and DeepSpeed runs transformers' own loss);
    - sequence parallel: TP > 1 on the torch engine without PP, for a family whose layers the engine's
      sequence-parallel plan knows, the sequence (each CP rank's part of it) divisible by TP;
    - context parallel: the torch engine, a family whose attention the engine's ring splits, without PP or
      expert parallelism, the sequence divisible into 2·CP equal chunks (two per rank, for the causal mask's
      balance);
    - activation offload: the torch engine (``torch.autograd.graph.save_on_cpu``)."""
    facts, runs = family(family_name), engine_facts(engine)
    if loss not in LOSSES:
        return "loss", f"unknown loss {loss!r} (use one of {list(LOSSES)})"
    if loss == "chunked" and (tp > 1 or not runs.chunked_loss):
        return "loss", (f"the chunked loss runs on the torch engine with TP 1 (here engine {engine}, TP {tp}; with TP "
                        "the vocabulary-parallel loss already splits the logits over TP)")
    if cp > 1:
        if not runs.context_parallel:
            return "cp", f"CP={cp} on engine {engine}: only the torch engine splits the sequence"
        if not facts.trial.context_parallel:
            return "cp", (f"CP={cp} for {family_name}: the engine's ring attention splits causal decoder-only "
                          f"attention with rotary positions (Llama-style families), not {family_name}'s")
        if pp > 1:
            return "cp", f"CP={cp} with PP={pp}: the torch engine runs context parallelism without pipeline stages"
        if ep > 1:
            return "cp", f"CP={cp} with EP={ep}: the torch engine does not split experts and the sequence together"
        if seq_length % (2 * cp):
            return "cp", (f"CP={cp} needs the {seq_length}-token sequence in 2*CP={2 * cp} equal chunks (two per "
                          "rank balance the causal mask's work)")
    if sequence_parallel:
        if tp == 1 or not runs.sequence_parallel or pp > 1:
            return "sequence_parallel", (f"sequence parallelism splits the sequence over TP on the torch engine "
                                         f"without PP (here TP={tp}, PP={pp}, engine {engine})")
        if not facts.trial.sequence_parallel:
            return "sequence_parallel", f"the torch engine has no sequence-parallel plan for {family_name}'s layers"
        if (seq_length // cp) % tp:
            return "sequence_parallel", (f"sequence parallelism splits each rank's {seq_length // cp} tokens over "
                                         f"TP={tp}, which does not divide them")
    if activation_offload and not runs.activation_offload:
        return "activation_offload", f"the {engine} engine does not offload activations (use engine torch)"
    return None


def master_on_host(engine: str, offload: str) -> bool:
    """Whether the optimizer's offload keeps the fp32 master on the host and the trained weights on the GPU in the
    compute dtype: the torch engine's (optim.HostOffloadedOptimizer), whose weights are otherwise the master. The
    engine holds its weights by it (hp_tool/trial/rank.py) and the memory model prices it."""
    return offload == "optimizer" and engine_facts(engine).fp32_weights


def compile_problem(compile: bool, engine: str, tp: int) -> Optional[str]:
    """Why the layers cannot run under torch.compile this way, or None: the torch engine compiles them
    (DeepSpeed's own compile is not wired in), at TP 1 (compiled layers of DTensor weights failed in their first
    backward with torch 2.13: ``'Tensor' object has no attribute '_local_tensor'``)."""
    if not compile:
        return None
    if not engine_facts(engine).compiles:
        return f"the {engine} engine does not compile the layers (use engine torch)"
    if tp > 1:
        return f"torch.compile at TP={tp}: the torch engine compiles layers at TP 1 (its DTensor layers fail compiled)"
    return None


def fp8_problem(family_name: str, fp8: bool, engine: str, tp: int, method: str, precision: str,
                fp8_peak_tflops: Optional[float], gpu: str, sequence_parallel: bool = False) -> Optional[str]:
    """Why Float8 linears (torchao's dynamic tensorwise scaling) cannot train this way, or None: a GPU with fp8
    tensor cores (the gpu preset's ``peak_tflops.fp8``: H100, H200, L4, L40S; not A100, V100 or CPU processes),
    then the layout's own rule (``fp8_layout_problem``)."""
    if fp8 and fp8_peak_tflops is None:
        return (f"gpu={gpu} has no fp8 tensor cores (gpu.peak_tflops.fp8 is null): fp8 linears need an H100, H200, "
                "L4 or L40S")
    return fp8_layout_problem(family_name, fp8, engine, tp, method, precision, sequence_parallel)


def fp8_layout_problem(family_name: str, fp8: bool, engine: str, tp: int, method: str, precision: str,
                       sequence_parallel: bool = False) -> Optional[str]:
    """Why a layout cannot train its linears in Float8, whatever the GPU, or None (a ``Layout`` rule):
    - the torch engine (which converts the linears before TP and FSDP2 wrap them; at TP > 1 it splits them with
      torchao's Float8 parallel styles, hp_tool/trial/parallel.py ``tp_styles``), bf16 compute; not with sequence
      parallelism (torchao's row-wise style gathers the output's gradient over the sequence in fp8: a trial of
      it has not run, as gloo carries no fp8 tensor);
    - full training (an adapter method's frozen base is no Float8 training linear) of a family whose linears the
      planner knows (``Family.arch.linear_shapes``: their casts are priced per linear)."""
    if not fp8:
        return None
    if not engine_facts(engine).fp8_linears:
        return f"the {engine} engine does not convert linears to Float8 (use engine torch)"
    if tp > 1 and sequence_parallel:
        return (f"fp8 linears at TP={tp} with sequence parallelism: torchao's row-wise style gathers the output's "
                "gradient over the sequence in fp8, which hp_tool has not run (use sequence_parallel false)")
    if precision != "bf16":
        return f"fp8 linears compute the rest of the model in bf16, not {precision}"
    if method != "full":
        return f"fp8 linears train full models: {method}'s frozen base is not converted"
    if family(family_name).arch.linear_shapes is None:
        return f"fp8 linears are priced per linear module, which the planner does not list for {family_name}"
    return None


def checkpoint_mode_problem(family_name: Optional[str], act_ckpt_mode: str, act_ckpt_layers: int, engine: str,
                            cp: int = 1, activation_offload: bool = False, method: str = "full") -> Optional[str]:
    """Why the checkpointed layers cannot be recomputed in ``act_ckpt_mode``, else None. ``full`` always runs;
    ``selective`` (torchtitan's per-op policy, hp_tool/trial/selective_checkpoint.py) needs:

    - checkpointed layers (with none, nothing is recomputed and the mode means nothing);
    - the torch engine (DeepSpeed checkpoints whole layers its own way);
    - a family whose layers' matmuls the family record lists (``Family.arch.layer_matmuls``), so that the memory
      model knows which outputs the policy keeps (not T5/mT5, whose attention is not one SDPA kernel);
    - CP 1: the ring attention is not a kernel the policy keeps, so it would recompute every ring pass;
    - no activation offload: the policy's kept outputs stay on the GPU, outside the offload's hooks;
    - full training: LoRA's adapter matmuls and QLoRA's 4-bit ones change which outputs the policy keeps.

    ``family_name`` None: the family's rule is not judged (a search's settings, before the model is known)."""
    if act_ckpt_mode not in ACT_CKPT_MODES:
        return f"unknown checkpointing mode {act_ckpt_mode!r} (use one of {list(ACT_CKPT_MODES)})"
    if act_ckpt_mode == "full":
        return None
    if act_ckpt_layers == 0:
        return ("selective checkpointing with act_ckpt_layers=0: no layer is checkpointed, so nothing is recomputed "
                "selectively")
    if not engine_facts(engine).selective_checkpointing:
        return (f"selective checkpointing on engine {engine}: DeepSpeed runs its own activation checkpointing of "
                "whole layers; the per-op policy runs on the torch engine")
    if family_name is not None and family(family_name).arch.layer_matmuls is None:
        return (f"selective checkpointing for {family_name}: its layers' attention is not one SDPA kernel, and "
                "hp_tool does not model which of their op outputs the per-op policy keeps")
    if cp > 1:
        return (f"selective checkpointing with CP={cp}: the ring attention is not a kernel the per-op policy keeps, "
                "so each checkpointed layer would run its ring passes again")
    if activation_offload:
        return ("selective checkpointing with activation offload: the outputs the per-op policy keeps stay on the "
                "GPU, outside the offload's hooks")
    if method != "full":
        return (f"selective checkpointing with method {method}: the adapters' matmuls change which outputs the "
                "per-op policy keeps, which hp_tool does not model")
    return None
