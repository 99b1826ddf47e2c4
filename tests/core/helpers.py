"""Shared test helpers: run a scheme on n in-process ranks and compare with the dense sum."""

from __future__ import annotations

import torch

from zend.core import Channel, SparseGrad, SyncResult, make_scheme
from zend.transport.inproc import InProcessCluster

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def run_scheme(name: str, grads: list[SparseGrad], *, average: bool = False, deterministic: bool = False,
               seed: int = 7, **options: object) -> list[SyncResult]:
    cluster = InProcessCluster(len(grads))
    return cluster.run(lambda rank, comm: make_scheme(name, seed=seed, **options).sync(
        Channel(comm, timeout_s=30), grads[rank], average=average, deterministic=deterministic))


def reference_sum(grads: list[SparseGrad], average: bool = False) -> torch.Tensor:
    total = sum(g.to_dense().double() for g in grads)
    assert isinstance(total, torch.Tensor)
    return total / len(grads) if average else total


def assert_close_to(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, n: int) -> None:
    """Relative to the largest magnitude: partial sums are rounded to `dtype` on the way."""
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((result.double() - expected).abs().max()) if expected.numel() else 0.0
    assert err <= TOLERANCE[dtype] * scale * max(1, n), f"max error {err} (scale {scale}, {dtype}, n={n})"
