"""Which sparse all_reduce calls of a backward pass the "zen" backend sends as one step (tensor fusion).

DDP hands the backend its sparse buckets one call at a time and does not say which is the pass's
last (a comm hook is told, `GradBucket.is_last()`; a backend is not). So the order is learned: a pass
makes the calls the previous pass made, in the same order (DDP launches its buckets in bucket order,
the same on every rank). A call that follows the learned order is held until the order's last call,
and the pass's calls then go together, so the daemon's fixed cost and the commit's rounds are paid
once per iteration, not once per table. A call that departs from the order sends what is held with
it at once, and the pass is learned anew; so does a wait on a held call, and the end of the pass.
Calls a pass still holds when the next begins (its backward failed before its end) are failed.

Every rank makes the same calls in the same order (the backend checks it), so every rank decides the
same: the batches, and so the daemon's fused tensors, are the same everywhere. Pure: no torch, no I/O
(the two helpers at the end take torch futures as they come).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
FUSE_ENV = "ZEN_FUSE"  # "0": no fusion, where the code did not choose (a switch for comparisons)
# Tables of different row widths share a step as rows of their common divisor, where that row is
# at least this wide (its key, 4 bytes on the wire, then adds at most 1/16 to the values it carries)
MIN_SHARED_ROW_BYTES = 64
# and no table's row is cut into more pieces than this: the daemon's CPU goes per row piece, and
# 1 MiB tables of 256 floats cut into 16 cost more than the step saved (benchmarks/many_tensors.py
# --widths; cut into 4, they cost no more)
MAX_CUT = 4


def fuse_setting(given: bool | None, environ: Mapping[str, str]) -> bool:
    """Whether to fuse: as the code chose, else as ZEN_FUSE says ("1", "0"), else yes."""
    if given is not None:
        return given
    value = environ.get(FUSE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{FUSE_ENV}={value!r}: choose 1 (fuse a backward pass's sparse calls) or 0")
    return value == "1"


class PassFusion(Generic[Item]):
    """Feed it every call of a pass (`arrive`); it says what to send and when."""

    def __init__(self) -> None:
        self.learned: tuple[Hashable, ...] = ()  # the previous pass's calls, in order
        self._pass: Hashable = None
        self._seen: list[Hashable] = []
        self._following = False  # this pass has matched the learned order so far
        self._held: list[Item] = []

    def arrive(self, backward_pass: Hashable, name: Hashable, item: Item) -> list[Item]:
        """The items to send now, in call order (this one last), or [] when this one is held.

        `backward_pass` tells passes apart (autograd's graph task); `name` is the call's identity."""
        if backward_pass != self._pass:
            self._new_pass(backward_pass)
        self._seen.append(name)
        position = len(self._seen)
        if self._following and position <= len(self.learned) and self.learned[position - 1] == name:
            if position < len(self.learned):
                self._held.append(item)
                return []
        else:
            self._following = False
        return [*self.release(), item]

    def stale(self, backward_pass: Hashable) -> list[Item]:
        """Calls an earlier pass still holds (its end never came: its backward failed), dropped: the
        caller fails them. Never sent, as a pass that failed on one rank may not have on another."""
        if backward_pass == self._pass or not self._held:
            return []
        self._seen = list(self.learned)  # a pass cut short teaches nothing: the order stays
        return self.release()

    def release(self) -> list[Item]:
        """What is held, to send now (a wait on a held call, the pass's end, a shutdown)."""
        held, self._held = self._held, []
        return held

    def is_held(self, item: Item) -> bool:
        return any(h is item for h in self._held)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def _new_pass(self, backward_pass: Hashable) -> None:
        if self._pass is not None:
            self.learned = tuple(self._seen)
        self._pass, self._seen = backward_pass, []
        self._following = len(self.learned) > 1  # one call a pass: nothing to fuse


@dataclass(frozen=True)
class Table:
    """What fusion needs of one tensor: its kind (dtype, device: only one kind shares a step), the
    values in one of its rows, their size in bytes each, and its number of rows."""
    kind: Hashable
    row_numel: int
    itemsize: int
    rows: int


@dataclass(frozen=True)
class Batch:
    """Tables sent as one step: each row of a member goes as row_numel // width consecutive rows of
    `width` values (one row, as it is, where every member has that width)."""
    members: tuple[int, ...]
    width: int


def batches(tables: Sequence[Table], max_rows: int, min_row_bytes: int = MIN_SHARED_ROW_BYTES,
            max_cut: int = MAX_CUT) -> list[Batch]:
    """The steps that `tables` go in: one per kind where their widths allow, in the order of each
    step's first table, members in the order given. The same on every trainer given the same tables.

    A table joins the first step of its kind that has its width, or whose members and it have a
    greatest common divisor at least `min_row_bytes` wide that cuts no row into more than `max_cut`
    pieces (tables of 256 and 64 float32 values a row: one step of 64-value rows; 256 and 16: two
    steps); else it starts a step of its own. A step's rows (counted after the cut)
    stay below `max_rows`: past it the tables go on in a new step (a table alone at or over it is a
    step of its own, refused by name when it starts)."""
    # (kind, width, widest row, members), in order of first member
    open_steps: list[tuple[Hashable, int, int, list[int]]] = []
    for i, t in enumerate(tables):
        for j, (kind, width, widest, members) in enumerate(open_steps):
            shared, wider = math.gcd(width, t.row_numel), max(widest, t.row_numel)
            if kind == t.kind and (width == t.row_numel == widest or (
                    0 not in (width, t.row_numel) and shared * t.itemsize >= min_row_bytes
                    and wider // shared <= max_cut)):
                open_steps[j] = (kind, shared, wider, [*members, i])
                break
        else:
            open_steps.append((t.kind, t.row_numel, t.row_numel, [i]))
    runs: list[list[int]] = []
    for _, width, _, members in open_steps:
        runs.append([])
        total = 0
        for i in members:
            rows = tables[i].rows * (tables[i].row_numel // width if width else 1)
            if runs[-1] and total + rows >= max_rows:
                runs.append([])
                total = 0
            runs[-1].append(i)
            total += rows
    # a run's own divisor: cut no finer than its members need (a multiple of the step's: fewer rows)
    return sorted((Batch(tuple(run), math.gcd(*(tables[i].row_numel for i in run))) for run in runs),
                  key=lambda b: b.members[0])


def settle(done: Any, results: Sequence[Any], each: bool = False) -> None:
    """Once future `done` (the step the held calls went in) completes, its outcome to each call's own
    future in `results`: its error to all, or its value (`each`: one value per call, in order)."""
    def spread(step: Any) -> None:
        try:
            value = step.value()
        except BaseException as exc:
            fail(results, exc)
            return
        for i, result in enumerate(results):
            result.set_result(value[i] if each else value)

    done.add_done_callback(spread)


def fail(results: Sequence[Any], error: BaseException) -> None:
    """`error` to every future in `results` not done yet."""
    for result in results:
        if not result.done():
            result.set_exception(error)
