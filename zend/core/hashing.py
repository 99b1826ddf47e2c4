"""The seeded hash behind ZEN's partitioning, in plain torch ops (same code on CPU and CUDA).

Multiply-shift hashing (Dietzfelbinger et al.): h = (x ^ salt) * A mod 2^32 for an odd
multiplier A drawn from the seed, scaled to [0, n) as (h * n) >> 32 (its high bits decide). Inputs
stay below 2^31 so every product fits in int64: no reliance on wrapping overflow. Every rank
that agrees on the seed computes the same function.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
MAX_PARTS = 2**16  # (2^32 - 1) * n must fit in int64


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class SeededHash:
    """h(x) in [0, num_parts) for int64 tensors x with 0 <= x < 2^31."""

    def __init__(self, seed: int, num_parts: int):
        if not 1 <= num_parts <= MAX_PARTS:
            raise ValueError(f"num_parts {num_parts} outside [1, {MAX_PARTS}]")
        mixed = _splitmix64(seed & 0xFFFFFFFFFFFFFFFF)
        self.multiplier = (mixed & _MASK32) | 1  # odd: multiply-shift needs it
        self.salt = (mixed >> 33) & 0x7FFFFFFF  # < 2^31 so x ^ salt < 2^31
        self.num_parts = num_parts
        self.seed = seed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.bitwise_xor(x, self.salt)
        h.mul_(self.multiplier)  # < 2^31 * 2^32: exact in int64
        h.bitwise_and_(_MASK32)
        h.mul_(self.num_parts)  # < 2^32 * 2^16
        return h.bitwise_right_shift_(32)
