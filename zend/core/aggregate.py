"""Summing keyed units from several sources: the one reduction every scheme uses.

Two steps, so that a scheme can sum straight into a message it is about to send: `slot_keys`
finds the sorted union of the sources' keys and where each source's keys land in it; the
caller allocates the accumulator (count rows, often a view of the outgoing message); `sum_into`
adds every source into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zend.core import kernels
from zend.core.sparse import ascending

# Below this many domain slots per key, marking keys in a table over the whole domain (two
# linear passes) beats sorting them; above it the table is mostly empty and sorting wins.
_MARK_SLOTS_PER_KEY = 32


@dataclass(frozen=True)
class KeySlots:
    keys: torch.Tensor  # sorted unique union of the sources' keys (int64)
    slots: list[torch.Tensor]  # slots[i][u] = position in `keys` of source i's key u (int64)

    @property
    def count(self) -> int:
        return int(self.keys.numel())


def slot_keys(key_lists: Sequence[torch.Tensor], domain: int | None = None) -> KeySlots:
    """The union of key sets (each unique within itself, in [0, domain) when `domain` is given): the
    compiled merge where it applies (_merge_applies), else a table over the domain or a sort."""
    total = sum(k.numel() for k in key_lists)
    if _merge_applies(key_lists, domain, total):
        return _slots_by_merge(key_lists)
    device = key_lists[0].device
    if domain is not None and domain <= _MARK_SLOTS_PER_KEY * max(total, 1):
        present = torch.zeros(domain, dtype=torch.int32, device=device)
        for k in key_lists:
            present.index_fill_(0, k.long(), 1)
        position = present.cumsum(0, dtype=torch.int32) - 1  # position[key] in the union, for present keys
        keys = present.nonzero().squeeze(1)
        return KeySlots(keys, [position.index_select(0, k.long()).long() for k in key_lists])
    keys = torch.cat([k.long() for k in key_lists])
    unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    slots, start = [], 0
    for k in key_lists:
        slots.append(inverse[start : start + k.numel()])
        start += k.numel()
    return KeySlots(unique, slots)


def _merge_applies(key_lists: Sequence[torch.Tensor], domain: int | None, total: int) -> bool:
    """Sorted sources (what the schemes send), few of them, over a sparse domain: merging them beats a
    table over the domain."""
    return (kernels.serves(key_lists[0]) and len(key_lists) <= kernels.MAX_MERGE_RUNS
            and (domain is None or domain > 2 * total) and all(ascending(k) for k in key_lists))


def _slots_by_merge(key_lists: Sequence[torch.Tensor]) -> KeySlots:
    union, slot = kernels.merge_runs([k.numpy().astype(np.int64, copy=False) for k in key_lists])
    slots = torch.from_numpy(slot).split([k.numel() for k in key_lists])
    return KeySlots(torch.from_numpy(union), list(slots))


def sum_into(acc: torch.Tensor, slots: KeySlots, values: Sequence[torch.Tensor], deterministic: bool) -> None:
    """acc (zeroed, count x width, float32) += every source's values at its slots.

    With `deterministic`, or on CPU (where index_add is sequential), sources are added one after
    another in the order given, so every key's sum is taken in source order; no key repeats
    within a source, so even CUDA's atomics add in a fixed order. Otherwise one index_add over
    everything (faster on CUDA, order may vary from run to run).
    """
    if deterministic or not acc.is_cuda:
        for s, v in zip(slots.slots, values, strict=True):
            acc.index_add_(0, s, v if v.dtype == acc.dtype else v.to(acc.dtype))
        return
    acc.index_add_(0, torch.cat(slots.slots), torch.cat(list(values)).to(acc.dtype))


def sum_keyed(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], deterministic: bool,
              domain: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum (keys, values) pairs whose keys are unique within each pair.

    Returns sorted unique keys and float32 sums (see `sum_into` for the order of additions).
    """
    slots = slot_keys([k for k, _ in parts], domain)
    width = parts[0][1].shape[1]
    acc = torch.zeros(slots.count, width, dtype=torch.float32, device=slots.keys.device)
    sum_into(acc, slots, [v for _, v in parts], deterministic)
    return slots.keys, acc
