"""Summing keyed units from several sources: the one reduction every scheme uses."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sum_keyed(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], deterministic: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum (keys, values) pairs whose keys are unique within each pair.

    Returns sorted unique keys and float32 sums. With `deterministic`, the sum of every key is
    taken in the order of `parts` (one index_add per source: no key repeats within a call, so
    even CUDA's atomics add in a fixed order); otherwise one index_add over everything, which
    is faster on CUDA but may order additions differently from run to run.
    """
    keys = torch.cat([k for k, _ in parts])
    unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    width = parts[0][1].shape[1]
    acc = torch.zeros(unique.numel(), width, dtype=torch.float32, device=keys.device)
    if deterministic:
        start = 0
        for k, v in parts:
            acc.index_add_(0, inverse[start : start + k.numel()], v.to(torch.float32))
            start += k.numel()
    else:
        acc.index_add_(0, inverse, torch.cat([v for _, v in parts]).to(torch.float32))
    return unique, acc
