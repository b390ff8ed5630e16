"""Heuristic tables are data: rows of (upper bound on model size in billions, values).

One lookup serves every table. Sources: NeMo's auto-configurator tables.
"""

from __future__ import annotations

from typing import Sequence, Tuple, TypeVar

V = TypeVar("V")
Table = Sequence[Tuple[float, V]]


def lookup(table: Table[V], size_b: float, inclusive: bool = False) -> V:
    """Values of the first row whose bound exceeds ``size_b`` (or equals it when ``inclusive``).

    Sizes above the last bound take the last row: the tables end at the largest sizes anyone trains.
    """
    for bound, values in table:
        if size_b < bound or (inclusive and size_b == bound):
            return values
    return table[-1][1]


# GPT-3: size < bound -> (hidden, heads, lr)
GPT3_SHAPE: Table[tuple[int, int, float]] = [
    (0.25, (768, 12, 6e-4)),
    (0.5, (1024, 16, 3e-4)),
    (1, (1536, 16, 2.5e-4)),
    (2, (2048, 16, 2e-4)),
    (3, (2560, 32, 1.6e-4)),
    (4.5, (3072, 32, 1.4e-4)),
    (8, (4096, 32, 1.2e-4)),
    (15, (5120, 40, 1e-4)),
    (25, (6144, 48, 1e-4)),
    (52, (8192, 64, 8e-5)),
    (105, (10240, 80, 7e-5)),
    (205, (12288, 96, 6e-5)),
    (405, (20480, 128, 5e-5)),
    (805, (20480, 128, 4e-5)),
    (1105, (25600, 160, 3e-5)),
]

# GPT-3, 80 GB GPUs, seq 2048: size <= bound -> (global batch size, starting TP, starting PP)
GPT3_GBS_TP_PP: Table[tuple[int, int, int]] = [
    (1, (256, 1, 1)),
    (4, (1024, 1, 1)),
    (8, (2048, 2, 1)),
    (13, (2048, 4, 1)),
    (20.6, (2048, 8, 1)),
    (45.6, (2048, 8, 2)),
    (123.6, (2048, 8, 4)),
    (196.6, (2048, 8, 8)),
    (392.2, (2048, 8, 16)),
    (735, (2048, 8, 32)),
    (1100, (2048, 8, 64)),
]


def _r(lo: int, hi: int) -> list[int]:
    return list(range(lo, hi + 1))


# GPT-3 candidate grid, 80 GB, seq 2048: size <= bound -> (TP, PP, MBS, (min, max) of TP*PP)
GPT3_GRID: Table[tuple[list[int], list[int], list[int], tuple[int, int]]] = [
    (1, ([1, 2], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (4, ([1, 2, 4], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (8, ([1, 2, 4], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (13, ([1, 2, 4, 8], [1], [1, 2, 3, 4, 6, 8], (1, 8))),
    (23, ([1, 2, 4], _r(1, 4), [1, 2, 4], (4, 8))),
    (45, ([2, 4, 8], _r(1, 4), [1, 2, 4], (8, 32))),
    (95, ([2, 4, 8], _r(1, 8), [1, 2, 4, 8], (8, 64))),
    (130, ([2, 4, 8], _r(1, 16), [1, 2, 4, 8], (16, 128))),
    (195, ([8], _r(4, 16), [1, 2, 4], (32, 256))),
    (395, ([8], _r(8, 32), [1, 2, 4], (64, 512))),
    (790, ([8], _r(8, 100), [1, 2, 4], (128, 1024))),
    (1100, ([8], _r(16, 130), [1, 2, 4], (256, 2048))),
]

# Activation-checkpointing step (before dividing by PP), size < bound -> step
ACT_CKPT_STEP: Table[int] = [(1, 4), (11.3, 8), (60, 16), (float("inf"), 32)]


# ---- Llama-style models (GQA, SwiGLU, RoPE, untied embeddings) ----

# Llama shape for a size without a published one: size < bound -> (hidden, heads, kv heads, FFN multiplier,
# FFN multiple_of, lr). Sources: Meta's released configs (params.json: dim, n_heads, n_kv_heads,
# ffn_dim_multiplier, multiple_of) of Llama 3.2 1B/3B, Llama 3 8B/70B, Llama 3.1 405B, Llama-2 13B's width
# and Llama-1 33B's width with grouped-query attention; learning rates from the Llama 2 paper (Table 1:
# 3e-4 up to 13B, 1.5e-4 for 34B and 70B) and Llama 3.1 405B (8e-5).
LLAMA_SHAPE: Table[tuple[int, int, int, float, int, float]] = [
    (1.5, (2048, 32, 8, 1.5, 256, 3e-4)),
    (4.5, (3072, 24, 8, 1.0, 256, 3e-4)),
    (10, (4096, 32, 8, 1.3, 256, 3e-4)),
    (20, (5120, 40, 8, 1.0, 256, 3e-4)),
    (45, (6656, 52, 4, 1.0, 256, 1.5e-4)),
    (150, (8192, 64, 8, 1.3, 4096, 1.5e-4)),
    (500, (16384, 128, 8, 1.2, 4096, 8e-5)),
]

# Llama training batch and the base layout: size <= bound -> (tokens per global batch, TP, PP).
# Llama 2 trained every size on 4M-token batches (paper, section 2.2); smaller models take fewer tokens.
LLAMA_GBS_TP_PP: Table[tuple[int, int, int]] = [
    (1.5, (2**20, 1, 1)),
    (4.5, (2**21, 1, 1)),
    (10, (2**22, 2, 1)),
    (20, (2**22, 4, 1)),
    (45, (2**22, 8, 2)),
    (150, (2**22, 8, 4)),
    (500, (2**24, 8, 16)),
]

# Llama candidate grid, 80 GB, by sequence length: size <= bound -> (TP, PP, MBS, (min, max) of TP*PP).
# Rows up to 95B (seq 4096) and 45B (seq 8192) are NeMo's GPT tables for those lengths (REFERENCE 9);
# NeMo stops there and falls back to TP<=8, PP=1 with no memory check, which proposes TP1 PP1 for a 70B
# at seq 8192. The last rows extend them to deeper pipelines; the memory model prunes what cannot fit.
LLAMA_GRID = {
    4096: [
        (4, ([1, 2, 4], [1], [1, 2, 4, 8], (1, 8))),
        (8, ([1, 2, 4], _r(1, 2), [1, 2, 4], (1, 8))),
        (13, ([2, 4], _r(1, 2), [1, 2, 4], (2, 8))),
        (23, ([4, 8], _r(1, 2), [1, 2], (4, 16))),
        (45, ([4, 8], _r(2, 4), [1, 2], (8, 32))),
        (95, ([4, 8], _r(1, 8), [1, 2], (8, 64))),
        (500, ([8], _r(4, 32), [1, 2], (32, 256))),
    ],
    8192: [
        (1, ([1, 2], _r(1, 2), [1, 2, 4], (1, 8))),
        (4, ([1, 2, 4], _r(1, 2), [1, 2, 4], (1, 8))),
        (13, ([2, 4], _r(1, 2), [1, 2], (2, 8))),
        (23, ([4, 8], _r(1, 4), [1], (8, 32))),
        (45, ([4, 8], _r(4, 8), [1], (32, 64))),
        (500, ([8], _r(4, 16), [1], (32, 128))),
    ],
}


# ---- T5 / mT5 (encoder-decoder), NeMo's tables (REFERENCE §3, §10) ----

# size < bound -> (hidden, heads, FFN, kv channels). NeMo's last two rows use 128 kv channels
# (auto_configurator utils.calculate_model_size_params).
T5_SHAPE: Table[tuple[int, int, int, int]] = [
    (0.1, (512, 6, 1024, 64)),
    (0.4, (768, 12, 2048, 64)),
    (1, (1024, 16, 2816, 64)),
    (5, (2048, 32, 5120, 64)),
    (15, (4096, 64, 10240, 64)),
    (25.9, (5120, 80, 10880, 64)),
    (43, (6144, 96, 10880, 64)),
    (85.5, (6144, 96, 16384, 64)),
    (165.5, (7680, 96, 20480, 128)),
    (250, (12288, 96, 32768, 128)),
]
# mT5: the same rows with wider bounds for the first three (its 250k vocabulary is a larger share).
MT5_SHAPE: Table[tuple[int, int, int, int]] = [(0.25, T5_SHAPE[0][1]), (0.5, T5_SHAPE[1][1]),
                                               (1.2, T5_SHAPE[2][1])] + list(T5_SHAPE[3:])

T5_REFERENCE_SEQ = 512  # the T5 GBS table is for this encoder length
T5_DECODER_SEQ = 128  # decoder length when train_settings.decoder_seq_length is null (NeMo's T5 configs)

# T5/mT5, 80 GB GPUs, seq 512: size <= bound -> (global batch size, starting TP, starting PP)
T5_GBS_TP_PP: Table[tuple[int, int, int]] = [
    (1, (2048, 1, 1)),
    (5, (1920, 2, 1)),
    (11.5, (1920, 4, 1)),
    (18.5, (1920, 8, 1)),
    (25.9, (1920, 8, 2)),
    (43, (1920, 8, 4)),
    (85.5, (1920, 8, 8)),
    (165.5, (1920, 8, 16)),
    (250, (1920, 8, 32)),
]

# T5/mT5 candidate grid, 80 GB, seq 512: size <= bound -> (TP, PP, MBS, (min, max) of TP*PP). PP values
# are kept only where they split both stacks (architectures.pipeline_problem).
T5_GRID: Table[tuple[list[int], list[int], list[int], tuple[int, int]]] = [
    (1, ([1, 2], [1], [16, 32, 64, 128], (1, 8))),
    (4, ([1, 2, 4], [1], [4, 6, 8, 12, 16, 24, 32, 48], (1, 8))),
    (8, ([2, 4, 8], [1], [4, 6, 8, 12, 16, 24, 32], (1, 8))),
    (14.5, ([4, 8], [1], [2, 4, 6, 8, 12, 16, 24], (1, 8))),
    (25.9, ([4, 8], _r(1, 2), [1, 2, 4, 6, 8], (4, 16))),
    (43, ([4, 8], _r(1, 4), [1, 2, 4, 6, 8], (8, 32))),
    (85.5, ([4, 8], _r(2, 8), [1, 2, 4, 6, 8], (16, 64))),
    (165.5, ([8], _r(4, 16), [1, 2, 4, 6], (32, 128))),
    (250, ([8], _r(4, 32), [1, 2, 4, 6, 8], (64, 256))),
]
