"""Compiled CPU loops (numba) for the steps of ZEN where torch pays per op, not per byte.

At the sizes a step moves (thousands of rows), a chain of twenty torch ops over small tensors
costs more in dispatch than in work: a loop compiled once does the same in one pass, 2.5-3x
faster (benchmarks/scheme_cpu.py). Every kernel here has a torch twin, which CUDA tensors (and
machines without numba) use; the tests check the two agree bit for bit. Kernels release the GIL,
so the transport's receiver threads run meanwhile. Compiled code is cached on disk (numba's
cache, next to this file or in $NUMBA_CACHE_DIR).

One function per hot operation picks the kernel or the twin, asking `serves` whether the kernels
take its tensors and adding the kernel's own preconditions; its callers never ask:

    kernel                     picked in                              twin
    zen_split                  partition.ZenPartitioner.split         rotation, then a stable sort by owner
    zen_assemble (merge_runs)  partition.ZenPartitioner.assemble      a table over the rows, or a sort
    zen_counts, zen_scatter    schemes.parallel.zen_push_messages     split, then one encode per part
    merge_runs                 aggregate.slot_keys                    a table over the domain, or a sort
    set_bits                   codec.write_bitmap                     index_put of the bits
    bitmap_keys                codec._bitmap_keys                     unpackbits (CPU) or shifts (CUDA)
    all_finite                 schemes.base.check_finite              sparse.first_nonfinite
    land_finite                schemes.dense._land                    check_finite, then add_ or copy_
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

numba: Any
try:  # an optional speed-up: everything works without it
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this guards odd installs
    numba = None

INSTALLED = numba is not None  # decided once, at import: without numba every operation takes its twin
_MASK32 = 0xFFFFFFFF
DISABLE_ENV = "ZEN_NO_KERNELS"  # set to 1 to run the torch twins (for comparison and tests)


def available() -> bool:
    """Whether the kernels run: numba is installed and ZEN_NO_KERNELS is off. The variable is read at
    every call, so that a test or a benchmark can switch to the twins in a running process."""
    return INSTALLED and os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes")


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: they run, and every tensor is in CPU memory (CUDA
    tensors take the torch twins). The one question every hot operation asks before its own
    preconditions (see the table above)."""
    return available() and all(t.device.type == "cpu" for t in tensors)


def _jit(fn: Any) -> Any:
    return numba.njit(cache=True, nogil=True)(fn) if INSTALLED else fn


def _jit_reassoc(fn: Any) -> Any:
    """A loop whose float sum may be reordered (so that it vectorises); NaN and Inf keep their meaning."""
    return numba.njit(cache=True, nogil=True, fastmath={"reassoc"})(fn) if INSTALLED else fn


@_jit
def _block_of(r: Any, n: int, inv_n: float) -> tuple[Any, Any]:
    """(r // n, r mod n) by a float multiply and one correction each way (exact for r < 2^52,
    FAST_DIVISION_LIMIT): an integer division costs 20-40 cycles, and this runs once per index."""
    b = np.int64(r * inv_n)
    rem = r - b * n
    if rem < 0:
        b -= 1
        rem += n
    elif rem >= n:
        b += 1
        rem -= n
    return b, rem


@_jit
def _zen_slot0(r: Any, n: int, inv_n: float, multiplier: int, salt: int) -> tuple[Any, Any]:
    """(partition of slice 0 of row r, its block r // n): ZenPartitioner.rotation for one row, the
    mod n by compare-and-subtract."""
    b, rem = _block_of(r, n, inv_n)
    h = ((((b ^ salt) * multiplier) & _MASK32) * n) >> 32  # zend.core.hashing.SeededHash
    p = h + rem
    if p >= n:
        p -= n
    return p, b


FAST_DIVISION_LIMIT = 1 << 52  # rows below this divide exactly through float64 (_block_of)


@_jit
def _zen_owners(rows: Any, n: int, s_count: int, multiplier: int, salt: int, owner: Any, counts: Any) -> None:
    """owner[i * S + s] = partition of slice s of row rows[i] (ZenPartitioner.rotation); counts per partition."""
    inv_n = 1.0 / n
    u = 0
    for i in range(rows.shape[0]):
        p, _ = _zen_slot0(rows[i], n, inv_n, multiplier, salt)
        for _s in range(s_count):
            owner[u] = p
            counts[p] += 1
            u += 1
            p += 1
            if p == n:
                p = 0


@_jit
def _zen_group(owner: Any, rows: Any, n: int, s_count: int, starts: Any, order: Any, keys: Any) -> None:
    """A counting sort of the units by owner, stable: order[k] = unit, keys[k] = its key b * S + s."""
    inv_n = 1.0 / n
    u = 0
    for i in range(rows.shape[0]):
        b, _ = _block_of(rows[i], n, inv_n)
        for s in range(s_count):
            p = owner[u]
            k = starts[p]
            starts[p] = k + 1
            order[k] = u
            keys[k] = b * s_count + s
            u += 1


def zen_split(rows: np.ndarray, n: int, s_count: int, multiplier: int, salt: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, keys, counts): the units (row i's slice s is unit i * S + s) grouped by owner in two
    linear passes, where a sort would take log n passes; keys are int32, as on the wire. Rows must be
    below FAST_DIVISION_LIMIT."""
    units = rows.size * s_count
    owner = np.empty(units, dtype=np.uint16)  # n <= 2^16 (hashing.MAX_PARTS)
    counts = np.zeros(n, dtype=np.int64)
    _zen_owners(rows, n, s_count, multiplier, salt, owner, counts)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    order, keys = np.empty(units, dtype=np.int64), np.empty(units, dtype=np.int32)
    _zen_group(owner, rows, n, s_count, starts, order, keys)
    return order, keys, counts


@_jit
def _zen_counts(rows: Any, n: int, multiplier: int, salt: int, counts: Any) -> None:
    inv_n = 1.0 / n
    for i in range(rows.shape[0]):
        p, _ = _zen_slot0(rows[i], n, inv_n, multiplier, salt)
        counts[p] += 1


@_jit
def _zen_scatter(rows: Any, units: Any, n: int, multiplier: int, salt: int, filled: Any, bitmap: Any,
                 index_at: Any, value_at: Any, as_u8: Any, as_i32: Any, as_units: Any) -> None:
    """Row i (one unit, S = 1) written straight into its owner's message: its key (the block) as the
    next COO entry or as a bit, its values as the next row of the message's values. Keys of ascending
    rows ascend within every partition, so a bitmap's values are already in key order."""
    inv_n = 1.0 / n
    width = units.shape[1]
    for i in range(rows.shape[0]):
        p, b = _zen_slot0(rows[i], n, inv_n, multiplier, salt)
        k = filled[p]
        filled[p] = k + 1
        if bitmap[p]:
            at = index_at[p] + (b >> 3)
            as_u8[at] |= np.uint8(1 << (b & 7))
        else:
            as_i32[index_at[p] + k] = b
        if width == 1:  # element-sparse (top-k): no inner loop, a quarter less time
            as_units[value_at[p] + k] = units[i, 0]
        else:
            base = value_at[p] + k * width
            for c in range(width):
                as_units[base + c] = units[i, c]


def zen_counts(rows: np.ndarray, n: int, multiplier: int, salt: int) -> np.ndarray:
    """Units per partition of ascending rows with S = 1 (whole-row units): the first of the push's two passes."""
    counts = np.zeros(n, dtype=np.int64)
    _zen_counts(rows, n, multiplier, salt, counts)
    return counts


def zen_scatter(rows: np.ndarray, units: np.ndarray, n: int, multiplier: int, salt: int, bitmap: np.ndarray,
                index_at: np.ndarray, value_at: np.ndarray, buffer: np.ndarray) -> None:
    """The push's second pass: every row's key and values into its owner's message, all messages
    laid out in `buffer` (uint8, 8-byte aligned). index_at[p]: where partition p's keys start, in
    int32s for COO, in bytes for a bitmap (zeroed by the caller); value_at[p]: where its values
    start, in units' elements. `units` is an integer view of the values (bits are copied)."""
    _zen_scatter(rows, units, n, multiplier, salt, np.zeros(n, dtype=np.int64), bitmap, index_at, value_at, buffer,
                 buffer.view(np.int32), buffer.view(units.dtype))


@_jit
def _merge_runs(keys: Any, starts: Any, union: Any, slot: Any) -> int:
    """Merge ascending runs keys[starts[r]:starts[r + 1]] into their sorted union (equal keys once);
    slot[i] = position of keys[i] in the union. Returns the union's size. Each run's next key waits
    in `heads` (an exhausted run holds the largest int64), so picking the smallest is a scan of a
    few values already at hand: for the few runs of a step (one per rank), cheaper than any table
    over the key space or a heap."""
    runs = starts.shape[0] - 1
    total = starts[runs] - starts[0]
    done = np.iinfo(np.int64).max
    pos = starts[:-1].copy()
    heads = np.empty(runs, dtype=np.int64)
    for r in range(runs):
        heads[r] = keys[pos[r]] if pos[r] < starts[r + 1] else done
    count = 0
    last = -1
    for _ in range(total):
        best = 0
        best_key = heads[0]
        for r in range(1, runs):
            if heads[r] < best_key:
                best, best_key = r, heads[r]
        if count == 0 or best_key != last:
            union[count] = best_key
            count += 1
            last = best_key
        p = pos[best]
        slot[p] = count - 1
        p += 1
        pos[best] = p
        heads[best] = keys[p] if p < starts[best + 1] else done
    return count


@_jit
def _set_bits(bitmap: Any, keys: Any) -> None:
    for i in range(keys.shape[0]):
        k = keys[i]
        bitmap[k >> 3] |= np.uint8(1 << (k & 7))


_DE_BRUIJN = 0x03F79D71B4CB0A89  # (2^k * this) >> 58 is distinct for every k < 64: a lowest set bit's index
_BIT_OF = np.zeros(64, dtype=np.int64)
for _k in range(64):
    _BIT_OF[((_DE_BRUIJN << _k) & 0xFFFFFFFFFFFFFFFF) >> 58] = _k


@_jit
def _bitmap_keys(words: Any, out: Any, bit_of: Any) -> int:
    found = 0
    limit = out.shape[0]
    magic = np.uint64(_DE_BRUIJN)
    for i in range(words.shape[0]):
        w = words[i]
        while w:  # one turn per set bit: a zero word costs one test
            low = w & (~w + np.uint64(1))
            if found < limit:
                out[found] = i * 64 + bit_of[(low * magic) >> np.uint64(58)]
            found += 1
            w ^= low
    return found


def bitmap_keys(bitmap: np.ndarray, out: np.ndarray) -> int:
    """The set bits of a uint8 bitmap (LSB first, a whole number of 8-byte words, as the codec pads
    it) into `out` in ascending order, as many as fit; returns how many are set. Passes over the
    words, not the bits: 3-4x numpy's unpackbits + flatnonzero on a sparse bitmap."""
    if bitmap.ctypes.data % 8:  # words must be aligned; a message's bitmap is (40-byte header), a stray one is copied
        bitmap = bitmap.copy()
    return int(_bitmap_keys(bitmap.view(np.uint64), out, _BIT_OF))


def set_bits(bitmap: np.ndarray, keys: np.ndarray) -> None:
    """OR the bits of `keys` into a uint8 bitmap, LSB first (codec's bitmap layout): one pass over the keys."""
    _set_bits(bitmap, keys)


def merge_runs(runs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sorted union, slot of every key of every run, concatenated) of ascending int64 runs."""
    keys = np.concatenate(runs) if runs else np.empty(0, dtype=np.int64)
    starts = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum([r.size for r in runs], out=starts[1:])
    union, slot = np.empty(keys.size, dtype=np.int64), np.empty(keys.size, dtype=np.int64)
    count = _merge_runs(keys, starts, union, slot)
    return union[:count], slot


@_jit
def _zen_rows_of(keys: Any, part: int, n: int, s_count: int, multiplier: int, salt: int, num_rows: int,
                 present: Any, rows_out: Any, slices_out: Any) -> int:
    """Decode partition `part`'s keys to (row, slice) and mark the rows (if `present` has room for
    them); -1, or the first bad key's position."""
    mark = present.shape[0] > 0
    for u in range(keys.shape[0]):
        k = keys[u]
        if k < 0:
            return u
        if s_count == 1:  # whole rows: the key is the block (no division: 20-40 cycles a key)
            b, s = k, 0
        else:
            b = k // s_count
            s = k - b * s_count
        h = ((((b ^ salt) * multiplier) & _MASK32) * n) >> 32  # zend.core.hashing.SeededHash
        offset = part + 2 * n - s - h  # in [2, 3n): (...) mod n by at most two subtractions
        if offset >= n:
            offset -= n
        if offset >= n:
            offset -= n
        row = b * n + offset
        if row >= num_rows:
            return u
        if mark:
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


MAX_MERGE_RUNS = 16  # a merge costs one comparison per run and key: beyond this, a table or a sort


def _decode_rows(keys: list[np.ndarray], num_rows: int, n: int, s_count: int, multiplier: int, salt: int,
                 present: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, slices) of every partition's keys, marking the rows in `present` unless it is empty;
    ValueError naming a key that decodes past the tensor."""
    decoded = []
    for j, k in enumerate(keys):
        rows, slices = np.empty(k.size, np.int64), np.empty(k.size, np.int64)
        bad = _zen_rows_of(k.astype(np.int64, copy=False), j, n, s_count, multiplier, salt, num_rows, present, rows,
                           slices)
        if bad >= 0:
            raise ValueError(f"partition {j}: key {int(k[bad])} decodes outside the tensor's {num_rows} rows")
        decoded.append((rows, slices))
    return decoded


Room = Callable[[int], "tuple[np.ndarray, np.ndarray] | None"]  # rows -> (rows out, units out), or None


def _room(room: Room | None, rows: int, units: int, width: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    given = room(rows) if room is not None else None
    if given is None:
        return np.empty(rows, dtype=np.int64), np.empty((units, width), dtype=dtype)
    return given


def zen_assemble(keys: list[np.ndarray], units: list[np.ndarray], num_rows: int, n: int, s_count: int,
                 multiplier: int, salt: int, merge: bool, room: Room | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the union (ascending) and their units, (rows * s_count, unit width), from every
    partition's pulled keys and units. Units are integer views of the values (the kernel copies
    bits, so it serves every float type, bfloat16 included, which numpy lacks).

    `merge` (whole-row units, S = 1, of a sparse union): every partition's rows ascend and no row
    is in two partitions, so merging the runs orders them with no pass over all the tensor's
    rows; otherwise the rows are marked in a table over them. Raises ValueError naming a key
    that decodes past the tensor, or a union whose units do not add up. The output goes where
    `room` says (given the union's size), else into new arrays."""
    total = sum(k.size for k in keys)
    width, dtype = units[0].shape[1], units[0].dtype
    if merge:
        decoded = _decode_rows(keys, num_rows, n, 1, multiplier, salt, np.zeros(0, dtype=np.uint8))
        union, slot = merge_runs([rows for rows, _ in decoded])
        if union.size != slot.size:
            raise ValueError(f"{slot.size} units pulled for {union.size} rows: a row is repeated")
        rows_out, out = _room(room, union.size, total, width, dtype)
        rows_out[:] = union
        at = 0
        for u in units:  # each partition's units straight to their places: one copy
            out[slot[at : at + u.shape[0]]] = u
            at += u.shape[0]
        return rows_out, out
    present = np.zeros(num_rows, dtype=np.uint8)
    decoded = _decode_rows(keys, num_rows, n, s_count, multiplier, salt, present)
    union = np.flatnonzero(present)
    if total != union.size * s_count:
        raise ValueError(f"{total} units pulled for {union.size} rows of {s_count} slices: "
                         "a slice is missing or repeated")
    position = np.cumsum(present, dtype=np.int32) - 1  # rows < 2^31
    rows_out, out = _room(room, union.size, total, width, dtype)
    rows_out[:] = union
    for (rows, slices), u in zip(decoded, units, strict=True):
        _place_units(rows, slices, position, s_count, u, out)
    return rows_out, out


@_jit_reassoc
def _land_finite(dst: Any, src: Any, add: bool) -> bool:
    """dst += src (add) or dst = src, and whether every src value is finite, in the same pass: v * 0 is
    0 for a finite v and NaN for NaN or Inf, so the sum of them is 0 exactly when all are finite."""
    zero = np.float32(0.0)
    acc = zero
    if add:
        for i in range(src.shape[0]):
            v = src[i]
            dst[i] += v
            acc += v * zero
    else:
        for i in range(src.shape[0]):
            v = src[i]
            dst[i] = v
            acc += v * zero
    return acc == zero


@_jit_reassoc
def _all_finite(values: Any) -> bool:
    zero = np.float32(0.0)
    acc = zero
    for i in range(values.shape[0]):
        acc += values[i] * zero
    return acc == zero


def all_finite(values: np.ndarray) -> bool:
    """Whether every value of a 1-D float32 array is finite: one vectorised pass (v * 0 summed, as in
    land_finite), 2-6x torch's sum at the sizes of a step's messages (twin: sparse.first_nonfinite)."""
    return bool(_all_finite(values))


def land_finite(dst: np.ndarray, src: np.ndarray, add: bool) -> bool:
    """`dst += src` (or `dst[:] = src`) for 1-D float32 arrays of one length, returning whether every
    value of src is finite: the check costs no pass of its own (the dense ring's receive; twin: torch's
    add_/copy_ and a finite check, in zend.core.schemes.dense)."""
    return bool(_land_finite(dst, src, add))
