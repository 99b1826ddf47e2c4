"""Embedding-gradient traces from a token stream: which rows each worker touches, per step.

Worker w at step s draws its own batch of `seqs` sequences of `seq_len` consecutive tokens
(seeded by (seed, step, worker)); its embedding gradient's non-zero rows are exactly the
distinct token ids of that batch, as with nn.Embedding(sparse=True) after coalescing.
The bundled stream is Jane Austen's novels in GPT-2 BPE (scripts/build_trace_fixture.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from zend.core.sparse import SparseGrad

GPT2_VOCAB = 50257


TOKENS_ENV = "ZEN_TRACE_TOKENS"  # where an install without the source tree (the image) keeps the trace


def default_tokens_path() -> Path:
    """The bundled trace: $ZEN_TRACE_TOKENS, else the source tree's copy. A wheel does not carry it
    (2 MB every trainer would install for the simulator and the examples only)."""
    if os.environ.get(TOKENS_ENV):
        return Path(os.environ[TOKENS_ENV])
    path = Path(__file__).resolve().parent / "data" / "austen_gpt2.npy"
    if not path.exists():
        raise FileNotFoundError(f"the token trace is not in this install ({path} is missing): it ships in the "
                                f"source tree (zend/simulator/data/austen_gpt2.npy); point {TOKENS_ENV} at a "
                                "copy, or pass a .npy of token ids (zend simulate --tokens)")
    return path


def load_tokens(path: str | Path, vocab: int) -> np.ndarray:
    """A 1-D integer token stream from a .npy file, checked against the vocabulary size."""
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer array of token ids, got {tokens.dtype} {tokens.shape}")
    if tokens.size == 0:
        raise ValueError(f"{path}: no tokens")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{path}: token id {lo if lo < 0 else hi} outside vocabulary [0, {vocab})")
    return np.asarray(tokens, dtype=np.int64)


class TokenTrace:
    def __init__(self, tokens: np.ndarray, vocab: int, seqs: int = 8, seq_len: int = 512, seed: int = 0):
        if tokens.size < seq_len:
            raise ValueError(f"token stream of {tokens.size} tokens is shorter than one sequence ({seq_len})")
        if seqs < 1 or seq_len < 1:
            raise ValueError(f"batch {seqs}x{seq_len} must be at least 1x1")
        self.tokens, self.vocab, self.seqs, self.seq_len, self.seed = tokens, vocab, seqs, seq_len, seed

    @classmethod
    def default(cls, **kwargs: int) -> TokenTrace:
        return cls(load_tokens(default_tokens_path(), GPT2_VOCAB), GPT2_VOCAB, **kwargs)

    def batch(self, worker: int, step: int) -> np.ndarray:
        """(seqs, seq_len) token ids for this worker and step."""
        rng = np.random.default_rng([self.seed, step, worker])
        starts = rng.integers(0, self.tokens.size - self.seq_len + 1, self.seqs)
        return self.tokens[starts[:, None] + np.arange(self.seq_len)]

    def rows(self, worker: int, step: int) -> np.ndarray:
        return np.unique(self.batch(worker, step))

    def embedding_grad(self, worker: int, step: int, dim: int, dtype: torch.dtype = torch.float32,
                       coalesced: bool = True, name: str = "embedding") -> SparseGrad:
        """A gradient with random values on the batch's rows.

        `coalesced=False` gives one row per token occurrence, duplicates included, as
        nn.Embedding(sparse=True) produces before coalescing.
        """
        ids = self.rows(worker, step) if coalesced else self.batch(worker, step).reshape(-1)
        gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 1_000_003 + worker) % 2**63)
        values = torch.randn(ids.size, dim, generator=gen).to(dtype)
        if dim == 1:
            values = values.squeeze(1)
        return SparseGrad(torch.from_numpy(ids), values, self.vocab, name, coalesced)
