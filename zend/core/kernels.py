"""Compiled CPU loops (numba) for the steps of ZEN where torch pays per op, not per byte.

At the sizes a step moves (thousands of rows), a chain of twenty torch ops over small tensors
costs more in dispatch than in work: a loop compiled once does the same in one pass, 2.5-3x
faster (benchmarks/scheme_cpu.py). Every kernel here has a torch twin in the module that calls
it, which CUDA tensors (and machines without numba) use; the tests check the two agree bit for
bit. Kernels release the GIL, so the transport's receiver threads run meanwhile.
Compiled code is cached on disk (numba's cache, next to this file or in $NUMBA_CACHE_DIR).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

numba: Any
try:  # an optional speed-up: everything works without it
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this guards odd installs
    numba = None

_MASK32 = 0xFFFFFFFF
DISABLE_ENV = "ZEN_NO_KERNELS"  # set to 1 to run the torch twins (for comparison and tests)


def available() -> bool:
    return numba is not None and os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes")


def _jit(fn: Any) -> Any:
    return numba.njit(cache=True, nogil=True)(fn) if numba is not None else fn


@_jit
def _zen_owners(rows: Any, n: int, s_count: int, multiplier: int, salt: int, owner: Any, counts: Any) -> None:
    """owner[i * S + s] = partition of slice s of row rows[i] (ZenPartitioner.rotation); counts per partition."""
    for i in range(rows.shape[0]):
        r = rows[i]
        b = r // n
        h = ((((b ^ salt) * multiplier) & _MASK32) * n) >> 32
        rot = (h + r - b * n) % n
        for s in range(s_count):
            p = (rot + s) % n
            owner[i * s_count + s] = p
            counts[p] += 1


@_jit
def _zen_group(owner: Any, rows: Any, n: int, s_count: int, starts: Any, order: Any, keys: Any) -> None:
    """A counting sort of the units by owner, stable: order[k] = unit, keys[k] = its key b * S + s."""
    for u in range(owner.shape[0]):
        p = owner[u]
        k = starts[p]
        starts[p] = k + 1
        order[k] = u
        i = u // s_count
        keys[k] = (rows[i] // n) * s_count + (u - i * s_count)


def zen_split(rows: np.ndarray, n: int, s_count: int, multiplier: int, salt: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, keys, counts): the units (row i's slice s is unit i * S + s) grouped by owner in two
    linear passes, where a sort would take log n passes; keys are int32, as on the wire."""
    units = rows.size * s_count
    owner = np.empty(units, dtype=np.int32)
    counts = np.zeros(n, dtype=np.int64)
    _zen_owners(rows, n, s_count, multiplier, salt, owner, counts)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    order, keys = np.empty(units, dtype=np.int64), np.empty(units, dtype=np.int32)
    _zen_group(owner, rows, n, s_count, starts, order, keys)
    return order, keys, counts


@_jit
def _zen_rows_of(keys: Any, part: int, n: int, s_count: int, multiplier: int, salt: int, num_rows: int,
                 present: Any, rows_out: Any, slices_out: Any) -> int:
    """Decode partition `part`'s keys to (row, slice) and mark the rows; -1, or the first bad key's position."""
    for u in range(keys.shape[0]):
        k = keys[u]
        b = k // s_count
        s = k - b * s_count
        h = ((((b ^ salt) * multiplier) & _MASK32) * n) >> 32  # zend.core.hashing.SeededHash
        row = b * n + (part + 2 * n - s - h) % n
        if k < 0 or row >= num_rows:
            return u
        present[row] = 1
        rows_out[u] = row
        slices_out[u] = s
    return -1


@_jit
def _place_units(rows: Any, slices: Any, position: Any, s_count: int, units: Any, out: Any) -> None:
    width = units.shape[1]
    for u in range(rows.shape[0]):
        dst = position[rows[u]] * s_count + slices[u]
        for c in range(width):
            out[dst, c] = units[u, c]


def zen_assemble(keys: list[np.ndarray], units: list[np.ndarray], num_rows: int, n: int, s_count: int,
                 multiplier: int, salt: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the union (ascending) and their units, (rows * s_count, unit width), from every
    partition's pulled keys and units. Units are integer views of the values (the kernel copies
    bits, so it serves every float type, bfloat16 included, which numpy lacks). Raises
    ValueError naming a key that decodes past the tensor, or a union whose slices do not add up."""
    present = np.zeros(num_rows, dtype=np.uint8)
    decoded = []
    for j, k in enumerate(keys):
        rows, slices = np.empty(k.size, np.int64), np.empty(k.size, np.int64)
        bad = _zen_rows_of(k.astype(np.int64, copy=False), j, n, s_count, multiplier, salt, num_rows, present, rows,
                           slices)
        if bad >= 0:
            raise ValueError(f"partition {j}: key {int(k[bad])} decodes outside the tensor's {num_rows} rows")
        decoded.append((rows, slices))
    union = np.flatnonzero(present)
    total = sum(k.size for k in keys)
    if total != union.size * s_count:
        raise ValueError(f"{total} units pulled for {union.size} rows of {s_count} slices: "
                         "a slice is missing or repeated")
    position = np.cumsum(present, dtype=np.int32) - 1  # rows < 2^31
    out = np.empty((total, units[0].shape[1]), dtype=units[0].dtype)
    for (rows, slices), u in zip(decoded, units, strict=True):
        _place_units(rows, slices, position, s_count, u, out)
    return union, out
