"""A layout's two parts: its parallel degrees (how the run splits over GPUs) and its training recipe (what every
rank does with its share: engine, memory savers, checkpointing, loss, optimizer, weights, precision, method).
``hp_tool/estimate/layout.py``'s ``Layout`` joins them; the TrialSpec holds their fields by name (each field's
section: parallel unless its ``spec`` metadata names another). Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

BYTES_PER_VALUE = {"bf16": 2, "fp16": 2, "fp32": 4}
# tokens per chunk of the chunked loss by default: 4096 x a 128K vocabulary x 4 bytes = 2.1 GiB of fp32 logits
LOSS_CHUNK_TOKENS = 4096


# which TrialSpec section holds a layout field that is not in its parallel section (``section``)
def _in(section: str, default):
    return field(default=default, metadata={"spec": section})


@dataclass(frozen=True)
class Degrees:
    """How a layout splits the run over GPUs: the parallel degrees, the micro-batch and the global batch
    (torchtitan's ParallelDims). GPUs = TP x PP x CP x DP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    mbs: int = 1  # sequences per forward pass per data-parallel replica
    global_batch_size: int = _in("training", 1)  # sequences per optimizer step over all replicas
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    ep: int = 1  # expert parallel: an MoE model's experts split over ep of the dp ranks
    cp: int = 1  # context parallel: each sequence split over cp ranks (ring attention)

    @property
    def gpus(self) -> int:
        """GPUs of the layout: TP x PP x CP x DP."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def zero_ranks(self) -> int:
        """Ranks holding the same weights, over which ZeRO shards them and the gradients are reduced: the DP
        replicas and, within each, the CP ranks (which split the sequence, not the weights)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Data-parallel ranks holding each expert: DP / EP (the group ZeRO shards the experts over)."""
        return max(1, self.zero_ranks // self.ep)

    def shard(self, params: float, experts: float = 0.0) -> float:
        """One data-parallel rank's share of ``params`` local parameters, ``experts`` of them routed experts:
        the dense ones split over the ZeRO ranks (DP x CP), the experts over the DP / EP ranks holding the
        same ones."""
        return (params - experts) / max(1, self.zero_ranks) + experts / self.edp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel replica."""
        return self.global_batch_size // (self.mbs * self.dp)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp


# LoRA's adapter dropout unless the search sets one: 0, peft's and torchtune's default (above 0 each adapter keeps
# its own dropped-out input and mask, and drops it out forward and backward)
LORA_DROPOUT = 0.0


@dataclass(frozen=True)
class Adapters:
    """A LoRA / QLoRA method's low-rank adapters (peft's LoraConfig; a TrialSpec's ``model.lora``)."""

    rank: int = 16
    alpha: float = 32.0
    # dropout on the adapters' input: above 0 each adapter keeps its own dropped-out input and mask for
    # backward (families/methods.py)
    dropout: float = LORA_DROPOUT
    target_modules: tuple[str, ...] = ()  # the linear modules adapted in every layer


@dataclass(frozen=True)
class Recipe:
    """What every rank does with its share of the run, whatever the degrees: the engine and its memory savers,
    checkpointing, the loss, the optimizer and weights, the compute precision and what trains (the method and
    its adapters)."""

    engine: str = "torch"  # torch | deepspeed
    zero_stage: int = 3  # ZeRO stage over the data-parallel group (hp_tool/sharding.py)
    offload: str = "none"  # none | optimizer | optimizer_and_params
    act_ckpt_layers: int = 0  # layers per pipeline stage whose activations are recomputed
    # how they are recomputed: full (whole, only their input kept) | selective (torchtitan's per-op policy;
    # hp_tool/vocab.py ACT_CKPT_MODES, hp_tool/sharding.py checkpoint_mode_problem)
    act_ckpt_mode: str = "full"
    sequence_parallel: bool = False  # with TP: norms on sequence shards
    # long context (hp_tool/sharding.py sequence_problem): the loss over chunks of tokens, saved activations in
    # host RAM
    loss: str = "full"  # full | chunked (hp_tool/vocab.py LOSSES)
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS  # tokens per chunk of the chunked loss
    activation_offload: bool = False
    # the layers under torch.compile (each transformer layer wrapped in torch.compile after checkpointing, before
    # FSDP2, as torchtitan does; hp_tool/trial/parallel.py compile_layers, hp_tool/estimate/speed.py FUSED_ELEMENTWISE)
    compile: bool = False
    optimizer: str = _in("training", "adamw")  # hp_tool/vocab.py OPTIMIZERS
    # what holds the trained weights (hp_tool/vocab.py MASTER_WEIGHTS): fp32 masters, or bf16 with bf16 optimizer
    # states (hp_tool/sharding.py master_weights_problem)
    master_weights: str = "fp32"
    precision: str = _in("training", "bf16")  # the compute precision: bf16 | fp16 | fp32
    method: str = _in("model", "full")  # what trains: full | lora | qlora (families/methods.py)
    lora: Optional[Adapters] = _in("model", None)  # the adapters: given exactly for lora and qlora
    # the layers' linears in Float8 (torchao's dynamic tensorwise scaling), the rest in the compute precision
    # (hp_tool/sharding.py fp8_problem, hp_tool/estimate/speed.py fp8_cast_s, hp_tool/trial/converters.py)
    fp8: bool = _in("model", False)

    def __post_init__(self) -> None:
        if (self.lora is not None) != (self.method != "full"):
            raise ValueError(f"a recipe's adapters (lora={self.lora}) are given exactly for the adapter methods "
                             f"(lora, qlora), and its method is {self.method}")

    @property
    def bytes_per_value(self) -> int:
        """Bytes of one value in the compute precision."""
        return BYTES_PER_VALUE[self.precision]

    @property
    def adapted(self) -> bool:
        """Whether a frozen base trains through adapters (lora, qlora)."""
        return self.method != "full"


# the TrialSpec section holding each field of a layout's degrees and recipe, by name
SECTIONS = {f.name: f.metadata.get("spec", "parallel") for part in (Degrees, Recipe) for f in fields(part)}
