"""Training tokens: the same global batch, in the same order, whatever the parallel layout.

Both sources are a flat stream of token ids. Sample ``j`` of step ``t`` (0-based, ``g = t * GBS + j``)
is the window of ``seq + 1`` tokens starting at ``g * (seq + 1)`` (wrapping around the stream); inputs are
its first ``seq`` tokens, labels its last ``seq``. An encoder-decoder's window is ``seq + dec + 1`` tokens:
the encoder reads the first ``seq``, the decoder the next ``dec`` and the labels are those shifted by one.
A data-parallel replica ``d`` takes samples ``[d * GBS/dp, (d+1) * GBS/dp)`` of each step, in micro-batches
of ``mbs``. Inputs are a tuple (token ids; encoder ids and decoder ids for an encoder-decoder). With context
parallelism every CP rank of a replica reads the replica's samples and keeps its two balanced chunks of each
(``ring_attention.shard_sequence``), of the inputs and of the labels, which were shifted on the whole window
first: every token keeps its true next token as label, also at a chunk's end.

- synthetic (default): a stream drawn once from the seed (at most ``SYNTHETIC_MAX_TOKENS`` ids, reused).
- file: a flat binary file of uint16 or uint32 ids, memory-mapped with numpy (nothing is read up front).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from hp_tool.errors import require
from hp_tool.contracts.spec import TrialSpec
from hp_tool.trial.ring_attention import shard_sequence

log = logging.getLogger(__name__)

SYNTHETIC_MAX_TOKENS = 1 << 24  # 16M ids (64 MB as int32): enough variety for a benchmark


def synthetic_stream(seed: int, vocab_size: int, num_tokens: int) -> np.ndarray:
    """``num_tokens`` uniform random token ids in [0, vocab_size), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator,
                         dtype=torch.int32).numpy()


def open_token_file(path: str, dtype: str, vocab_size: int) -> np.ndarray:
    """Memory-map a flat token file; fails with the path and the fix if it is missing or too short."""
    file = Path(path)
    require(file.is_file(), "training.data.path", path, "token file not found",
            "point training.data.path to a flat binary file of token ids")
    tokens = np.memmap(file, dtype=np.dtype(dtype), mode="r")
    require(tokens.size > 0, "training.data.path", path, "token file is empty",
            "write at least seq_length + 1 token ids")
    return tokens


class TokenBatches:
    """Micro-batches of (input ids, labels) for one data-parallel replica; with context parallelism the part
    of each sequence context-parallel rank ``cp_rank`` holds."""

    def __init__(self, spec: TrialSpec, dp_rank: int, device: torch.device, cp_rank: int = 0):
        m, t, p = spec.model, spec.training, spec.parallel
        self.cp, self.cp_rank = p.cp, cp_rank
        self.encoder = m.seq_length if m.decoder_seq_length else 0  # encoder ids ahead of the decoder's
        self.window = self.encoder + (m.decoder_seq_length or m.seq_length) + 1
        self.gbs, self.mbs = t.global_batch_size, p.mbs
        self.per_replica = t.global_batch_size // p.dp
        self.first_sample = dp_rank * self.per_replica
        self.device = device
        if t.data.source == "file":
            self.stream = open_token_file(t.data.path, t.data.dtype, m.vocab_size)
        else:
            wanted = self.gbs * self.window * spec.run.max_steps
            self.stream = synthetic_stream(t.seed, m.vocab_size, min(wanted, SYNTHETIC_MAX_TOKENS))
        require(self.stream.size >= self.window, "training.data", self.stream.size,
                f"fewer tokens than one sample ({self.window})", "use a longer token file")
        self.num_windows = self.stream.size // self.window

    def _samples(self, step: int, start: int, count: int) -> torch.Tensor:
        """``count`` windows ``[count, seq + 1]`` (int64) starting at replica sample ``start``."""
        first = step * self.gbs + self.first_sample + start
        rows = [(first + i) % self.num_windows for i in range(count)]
        array = np.stack([self.stream[r * self.window:(r + 1) * self.window] for r in rows])
        return torch.from_numpy(array.astype(np.int64))

    def replica_batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """This replica's whole share of step ``step`` (0-based): the inputs (``[GBS/dp, seq]`` ids, or encoder
        and decoder ids) and the ``[GBS/dp, target length]`` labels; with CP this rank's ``seq / cp`` tokens
        of each."""
        samples = self._samples(step, 0, self.per_replica).to(self.device, non_blocking=True)
        e = self.encoder
        inputs = (samples[:, :e], samples[:, e:-1]) if e else (samples[:, :-1],)
        labels = samples[:, e + 1:]  # shifted on the whole window, before any split
        if self.cp == 1:
            return inputs, labels
        return tuple(self._my_chunks(x) for x in inputs), self._my_chunks(labels)

    def _my_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's two balanced chunks of every sequence of ``x`` ([sequences, tokens])."""
        return shard_sequence(x, self.cp, self.cp_rank, dim=1)

    def micro_batches(self, step: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        """The replica batch of step ``step`` split into micro-batches of ``mbs`` sequences."""
        inputs, labels = self.replica_batch(step)
        parts = [x.split(self.mbs) for x in inputs]
        return [(tuple(p[i] for p in parts), y) for i, y in enumerate(labels.split(self.mbs))]
