"""Family-neutral rules over a ``Shape``: how a pipeline splits the model, which layers a stage recomputes,
and the whole model's parameter and FLOP counts composed from its family's per-layer, embedding and head
counts (hp_tool/families/). Pure functions, no torch.

FLOPs: every matmul counted per token (Narayanan et al. 2021 for GPT; Llama's grouped-query attention and
SwiGLU counted as they are; T5/mT5's encoder, decoder self- and cross-attention and logits as NeMo counts
them, REFERENCE §10). Encoder-decoder models: the pipeline splits the 2·L layers, the encoder on the first
PP/2 stages and the decoder on the rest (NeMo's split rank), so PP is 1 or even with PP/2 dividing L.
"""

from __future__ import annotations

from typing import Optional

from hp_tool.families.methods import head_training_flops, layer_training_flops
from hp_tool.families import family
from hp_tool.families.decoder import expert_forward_flops, skipped_expert_parameters
from hp_tool.families.registry import Matmul
from hp_tool.families.shape import Shape
from hp_tool.recipe import Adapters


def pipeline_problem(shape: Shape, pp: int) -> Optional[str]:
    """Why ``pp`` pipeline stages cannot split ``shape``, or None. The one rule for the planner, the base
    config and the TrialSpec."""
    if shape.encoder_decoder:
        if pp > 1 and (pp % 2 or shape.num_layers % (pp // 2)):
            return (f"PP={pp} cannot split the encoder and decoder stacks ({shape.num_layers} layers each): "
                    f"the encoder takes the first PP/2 stages and the decoder the rest, so PP is 1 or an even "
                    f"number whose half divides {shape.num_layers}")
        return None
    if shape.num_layers % pp:
        return f"PP={pp} does not divide the {shape.num_layers} layers"
    return None


def interleave_problem(shape: Shape, pp: int, virtual_stages: int, act_ckpt_layers: int,
                       microbatches: int) -> Optional[tuple[str, str]]:
    """(what is at fault: "virtual_stages", "act_ckpt_layers" or "microbatches", why) when interleaved 1F1B
    cannot run ``virtual_stages`` model chunks per pipeline rank, else None. The one rule for the planner
    and the TrialSpec. Chunk k of rank r is virtual stage r + k·PP; each holds layers/(PP·v) layers and
    recomputes act_ckpt_layers/v of them; torch's ScheduleInterleaved1F1B splits the step's micro-batches
    into rounds of about PP and needs the rounds to divide them."""
    v = virtual_stages
    if v < 1:
        return "virtual_stages", f"{v} virtual stages per pipeline rank: at least 1"
    if v == 1:
        return None
    if pp == 1:
        return "virtual_stages", f"{v} virtual stages interleave a pipeline, and PP=1 has none"
    if shape.encoder_decoder:
        return "virtual_stages", (f"interleaved pipelining runs decoder-only models; {shape.family} splits its "
                                  "encoder and decoder over the stages")
    per_stage = shape.pipeline_layers // pp
    if per_stage % v:
        return "virtual_stages", f"{v} virtual stages do not divide the {per_stage} layers per pipeline stage"
    if act_ckpt_layers % v:
        return "act_ckpt_layers", (f"{act_ckpt_layers} checkpointed layers per stage do not split over {v} "
                                   f"virtual stages (each chunk recomputes the same number)")
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return "microbatches", (f"interleaved 1F1B runs {microbatches} micro-batches per step in {rounds} "
                                f"rounds (micro-batches // PP), which must divide them")
    return None


def stage_layer_counts(shape: Shape, pp: int, stage: int) -> tuple[int, int]:
    """(encoder layers, decoder layers) on pipeline ``stage`` of ``pp``; a decoder-only model's layers
    count as decoder layers."""
    per_stage = shape.pipeline_layers // pp
    if not shape.encoder_decoder:
        return 0, per_stage
    first = stage * per_stage
    encoder = max(0, min(first + per_stage, shape.num_layers) - first)
    return encoder, per_stage - encoder


def checkpointed_layer_counts(shape: Shape, pp: int, stage: int, act_ckpt_layers: int) -> tuple[int, int]:
    """(encoder, decoder) layers recomputed on ``stage`` for ``act_ckpt_layers`` per stage: the first ones of
    each stack on it; a stage holding both stacks (PP=1) divides them, the encoder taking the odd one."""
    encoder, decoder = stage_layer_counts(shape, pp, stage)
    if encoder and decoder:
        k_enc = min(encoder, act_ckpt_layers - act_ckpt_layers // 2)
        return k_enc, min(decoder, act_ckpt_layers - k_enc)
    return min(encoder, act_ckpt_layers), min(decoder, act_ckpt_layers)


def selective_keeps_matmul(position: int) -> bool:
    """Whether selective checkpointing's per-op policy keeps the output of the ``position``-th matmul of a
    layer's forward (1 = the first it runs): the odd ones, as torchtitan's policy saves every matmul but every
    second one. The one rule for the engine's policy (hp_tool/trial/selective_checkpoint.py) and the estimates."""
    return position % 2 == 1


def selective_kept_matmuls(shape: Shape) -> tuple[Matmul, ...]:
    """The matmuls of a layer (the family's ``layer_matmuls``, in forward order) whose outputs the selective
    policy keeps: the 1st, 3rd, 5th ... (Llama: q, v, gate and down of q, k, v, o, gate, up, down)."""
    return tuple(m for i, m in enumerate(shape.facts.arch.layer_matmuls(shape), start=1) if selective_keeps_matmul(i))


def selective_recompute_flops_per_sample(shape: Shape) -> float:
    """Forward FLOPs a selectively checkpointed layer runs again in backward, one sample: the matmuls whose
    outputs the policy does not keep (Llama: k, o and up) and a mixture of experts' routed experts (grouped
    matmuls, which it neither counts nor keeps); not the attention, whose output it keeps."""
    kept = selective_kept_matmuls(shape)
    redone = sum(2 * m.inputs * m.outputs for m in shape.facts.arch.layer_matmuls(shape) if m not in kept)
    return shape.seq_length * redone + expert_forward_flops(shape)


def layer_parameters(shape: Shape, encoder: bool = False) -> int:
    """Parameters of one transformer layer (of the encoder stack when ``encoder``, for T5/mT5)."""
    return shape.facts.arch.layer_parameters(shape, encoder)


def embedding_parameters(shape: Shape) -> int:
    """Input embedding parameters (word, plus learned positions for GPT; T5 counts its encoder's relative
    position table here)."""
    return shape.facts.arch.embedding_parameters(shape)


def head_parameters(shape: Shape) -> int:
    """Final norm plus output projection (GPT and T5 tie the projection to the word embedding; T5 counts
    both stacks' final norms and its decoder's relative position table here)."""
    return shape.facts.arch.head_parameters(shape)


def vocab_parallel_parameters(shape: Shape, tp: int, pp: int) -> tuple[float, float]:
    """(embedding, head) parameters one TP rank holds, as the engine shards them: the [vocab, hidden]
    matrices split over TP (vocab-parallel), learned positions and the final norm whole. GPT and T5 tie
    their head to the embedding; with PP > 1 the last stage keeps its own copy of that matrix."""
    vh = shape.vocab_size * shape.hidden_size
    embed = embedding_parameters(shape) - vh + vh / tp
    head = float(head_parameters(shape))
    if not shape.tied_head:
        head += vh / tp - vh
    elif pp > 1:
        head += vh / tp
    return embed, head


def stage_layer_parameters(shape: Shape, pp: int, stage: int) -> int:
    """Parameters of the transformer layers on pipeline ``stage`` (before tensor parallelism)."""
    encoder, decoder = stage_layer_counts(shape, pp, stage)
    return encoder * layer_parameters(shape, encoder=True) + decoder * layer_parameters(shape)


def count_parameters(shape: Shape) -> int:
    """Parameter count of the whole model (all stages, unsharded)."""
    return stage_layer_parameters(shape, 1, 0) + embedding_parameters(shape) + head_parameters(shape)


def expert_parameters(shape: Shape) -> int:
    """One layer's routed experts' parameters (a mixture of experts; 0 for a dense model): what expert
    parallelism splits and ZeRO shards over the data-parallel ranks holding the same experts."""
    return shape.facts.arch.expert_parameters(shape)


def stage_expert_parameters(shape: Shape, pp: int, stage: int, ep: int = 1) -> float:
    """Routed-expert parameters one GPU holds on pipeline ``stage``: 1/EP of its layers' experts, never split
    by TP (the torch engine runs whole experts on every TP rank: expert TP 1); 0 for a dense model."""
    return sum(stage_layer_counts(shape, pp, stage)) * expert_parameters(shape) / ep


def active_parameters(shape: Shape) -> int:
    """Parameters one token runs through: all of them for a dense model; a mixture of experts counts top_k of
    each layer's experts (Mixtral-8x7B: 12.9B of 46.7B)."""
    return count_parameters(shape) - shape.pipeline_layers * skipped_expert_parameters(shape)


def layer_forward_flops_per_sample(shape: Shape, encoder: bool = False) -> float:
    """Forward matmul FLOPs of one transformer layer for one sample (attention over the full sequence; of
    the encoder stack when ``encoder``); the family's formula."""
    return shape.facts.arch.layer_forward_flops(shape, encoder)


def model_flops_per_step(shape: Shape, global_batch_size: int, lora: Optional[Adapters] = None) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward for full training; what a LoRA or
    QLoRA step with adapters ``lora`` computes otherwise: families/methods.py), recomputation excluded.

    For GPT with ffn = 4h this equals 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)).
    """
    layers = shape.num_layers * layer_training_flops(shape, layer_forward_flops_per_sample(shape), lora)
    if shape.encoder_decoder:
        layers += shape.num_layers * layer_training_flops(shape, layer_forward_flops_per_sample(shape, encoder=True),
                                                          lora)
    logits = head_training_flops(2 * shape.target_length * shape.hidden_size * shape.vocab_size, lora)
    return global_batch_size * (layers + logits)


def recompute_flops_per_step(shape: Shape, global_batch_size: int, act_ckpt_layers: int, pp: int,
                             mode: str = "full") -> float:
    """Extra FLOPs of one step from re-running the forward of ``act_ckpt_layers`` layers on each of the
    ``pp`` stages (checkpointed_layer_counts says which): the whole forward in mode ``full``, what the per-op
    policy does not keep in mode ``selective`` (``selective_recompute_flops_per_sample``)."""
    per_layer = layer_forward_flops_per_sample(shape) if mode == "full" else selective_recompute_flops_per_sample(shape)
    per_sample = 0.0
    for stage in range(pp):
        k_enc, k_dec = checkpointed_layer_counts(shape, pp, stage, act_ckpt_layers)
        per_sample += k_dec * per_layer
        if k_enc:
            per_sample += k_enc * layer_forward_flops_per_sample(shape, encoder=True)
    return float(global_batch_size * per_sample)


def shape_for_size(family_name: str, size_b: float, vocab: int, seq: int,
                   decoder_seq: Optional[int] = None) -> tuple[Shape, float]:
    """The family's shape and learning rate for a model of ``size_b`` billion parameters."""
    return family(family_name).sizing.shape_for_size(size_b, vocab, seq, decoder_seq)


def lr_for(family_name: str, size_b: float) -> float:
    """The family's learning rate for a model of ``size_b`` billion parameters (explicit shapes too)."""
    return family(family_name).sizing.lr_for(size_b)
