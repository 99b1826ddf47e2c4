"""The torch.distributed backend "zen": sparse all_reduce through the node's zend daemon, every other
collective on an inner gloo (CPU tensors) or NCCL (CUDA tensors) group built from the same store.

    import zen                                  # registers the backend
    dist.init_process_group("zen")              # or "cpu:zen,cuda:zen"; under torchrun as usual
    ddp = DistributedDataParallel(model)        # nn.Embedding(sparse=True) buckets go through zend

What each op does:
- `all_reduce` of sparse COO tensors (ReduceOp.SUM or AVG): one zen step through the daemon. Any
  number of sparse dims (linearised into one row index), dense trailing dims, uncoalesced input,
  fp32/fp16/bf16 values, CPU or CUDA tensors. A list of tensors is summed locally first, as gloo
  does. The inputs are updated in place and also returned by `work.result()` / `get_future()`.
  Inside a backward pass (DDP's sparse buckets), calls that repeat the previous pass's order are
  held until its last and go as one step per dtype (zen/fusion.py; row widths share it): the daemon's
  fixed cost and the commit's rounds once per iteration. `Options(fuse=False)`: a step per call.
- `all_reduce` of dense tensors: the inner group, unless `Options(dense="ring" | "topk")` (or
  ZEN_DENSE_ALLREDUCE=ring|topk) sends SUM/AVG ones through the daemon too.
- Every other collective (broadcast, allgather, reduce_scatter, all_to_all, barrier, send/recv):
  the inner group, at its own speed.
- Sparse tensors zen does not carry (float64, integers) and groups that are not the whole job
  (a `new_group` of some ranks: the daemons sum over every trainer of the job) go through the
  inner gloo group, with a warning once per reason.

Tensor identity. zen synchronises named tensors, each with its own step counter. A sparse
all_reduce is named after its group, its `zen.distributed.name(tensor, "emb")` hint if it has one,
and otherwise its shape, dtype and device type, and its op; inside a backward pass (DDP's buckets),
the k-th call of one such shape in that pass gets `#k` added (k >= 1), so two tables of one shape
are two zen tensors. Its step is the number of earlier calls of that name. So, as with every torch
backend, ranks must make the same calls in the same order; the backend compares the ranks' zen
calls (a 128-byte allgather on the inner gloo group beside every zen step) and fails the call with
`zen.OutOfOrder` naming both when they differ. The group is unusable after.

Errors: `work.wait()` raises zen's typed errors (`zen.StepAborted`, `zen.DaemonUnavailable`, ...);
under DDP, `backward()` gets them as RuntimeError and `zen.distributed.reraise(exc)` gives the typed one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    PrefixStore,
    ProcessGroup,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch.profiler import record_function

from zen.client import Client, StepStats, checked_rows
from zen.errors import OutOfOrder, StepAborted, StepTimeout, ZenError, behind
from zen.fusion import PassFusion, fail, fuse_setting, settle
from zend.core import dtypes
from zend.core.topk import TopKCompressor

BACKEND_NAME = "zen"
DENSE_MODES = ("inner", "ring", "topk")
DENSE_ENV = "ZEN_DENSE_ALLREDUCE"
_HINT = "_zen_name"
_CHECK_BYTES = 128  # per call: a 16-byte digest of the call's name, then the name itself, cut to fit
MAX_ROWS = 2**31  # what a zen tensor may have (zend.core.sparse); bigger ones go through gloo
MAX_RESIDUALS = 256  # top-k error-feedback residuals kept (one per tensor storage), oldest dropped first
_UNSET = object()
_log = logging.getLogger("zen.distributed")


@dataclass
class Options:
    """`dist.init_process_group("zen", pg_options=zen.distributed.Options(...))`."""

    dense: str | None = None  # "inner" (gloo/NCCL, the default), "ring" or "topk": dense SUM/AVG via zend
    topk_ratio: float = 0.01  # with dense="topk": the share of values sent, with error feedback
    check_order: bool = True  # compare every rank's call before trusting a zen step's identity
    fuse: bool | None = None  # a backward pass's sparse calls as one step (zen/fusion.py; default: yes,
    # unless ZEN_FUSE=0)
    cuda_inner: str | None = None  # dense CUDA collectives: "nccl" (default where available) or "gloo"
    client: Client | None = None  # default: one zen.Client per process, from the sidecar's environment

    def inner_for_cuda(self) -> str | None:
        """The backend of the inner group for CUDA tensors; None without CUDA."""
        if self.cuda_inner not in (None, "nccl", "gloo"):
            raise ValueError(f"Options.cuda_inner={self.cuda_inner!r}: choose 'nccl' or 'gloo'")
        if not torch.cuda.is_available():
            return None
        if self.cuda_inner == "nccl" and not dist.is_nccl_available():
            raise ValueError("Options.cuda_inner='nccl': this torch has no NCCL")
        return self.cuda_inner or ("nccl" if dist.is_nccl_available() else "gloo")

    def dense_mode(self) -> str:
        mode = self.dense or os.environ.get(DENSE_ENV, "inner")
        if mode not in DENSE_MODES:
            source = "Options.dense" if self.dense else DENSE_ENV
            raise ValueError(f"{source}={mode!r}: choose one of {', '.join(DENSE_MODES)}")
        if not 0 < self.topk_ratio <= 1:
            raise ValueError(f"Options.topk_ratio={self.topk_ratio} must be in (0, 1]")
        return mode


def name(tensor: torch.Tensor, hint: str) -> torch.Tensor:
    """Name the zen tensor that `tensor`'s sparse all_reduce synchronises (instead of its shape);
    every rank must give the same hint to the same call. Returns `tensor`."""
    if not hint or any(c in hint for c in "\0\n/"):
        raise ValueError(f"zen name hint {hint!r}: must be non-empty, without NUL, newline or '/'")
    setattr(tensor, _HINT, hint)
    return tensor


# ---------------------------------------------------------------------------------------- work
class ZenWork(dist.Work):
    """The handle torch hands back for an async collective; `wait()` raises zen's typed errors."""

    def __init__(self, future: torch.futures.Future[Any], on_wait: Callable[[], None] | None = None):
        super().__init__()
        self._future = future
        self._on_wait = on_wait  # a call held for fusion: waiting on it sends it
        # what C++ callers (DDP's reducer) get: the same outcome, the error set by torch's own `then`.
        # A Python exception set on a future directly crashes the reducer that reads it (SIGSEGV in
        # backward, torch 2.13); one raised in a `then` callback reaches backward() as RuntimeError.
        self._for_torch = future.then(_value)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if self._on_wait is not None and not self._future.done():
            self._on_wait()
        if seconds > 0 and not _done_within(self._future, seconds):
            raise StepTimeout(f"zen collective not done within {seconds:g} s (Work.wait timeout)")
        self._future.wait()  # raises the error that failed it, typed
        self._for_torch.wait()  # done a moment later (its callback runs after): get_future() is done too
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """Fails with a RuntimeError naming zen's error; `wait()` and `reraise()` raise the typed one."""
        return self._for_torch

    def result(self) -> list[torch.Tensor]:
        return self._future.value()

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
            return True
        except BaseException:
            return False


def _value(done: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
    return done.value()


def _set_once(future: torch.futures.Future[None]) -> None:
    with contextlib.suppress(RuntimeError):  # already set (an abort moved the lane on)
        future.set_result(None)


def _record_event(device: torch.device | None) -> Any:
    """A CUDA event on the caller's current stream (the inputs are written once it has passed)."""
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _done_within(future: torch.futures.Future[Any], seconds: float) -> bool:
    event = threading.Event()
    future.add_done_callback(lambda _: event.set())
    return event.wait(seconds)


# ---------------------------------------------------------------------------------------- the shared client
class _SharedClient:
    """One zen session per process (the daemon knows a trainer by its local rank), shared by its groups."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.client: Client | None = None
        self.users = 0

    def acquire(self, timeout_s: float) -> Client:
        with self.lock:
            if self.client is None:
                self.client = Client(timeout_s=timeout_s)
            self.users += 1
            return self.client

    def release(self, client: Client) -> None:
        with self.lock:
            if client is not self.client:
                return
            self.users -= 1
            if self.users == 0:
                self.client = None
                client.close()


_SHARED = _SharedClient()


# ---------------------------------------------------------------------------------------- the group
class _Call:
    """One collective through zend: its zen step (on a pool thread, behind the previous step of its
    name) and its order check (on the inner gloo group). The work completes when both have; it fails
    with the zen step's typed error, or with OutOfOrder as soon as the check finds one; a check that
    itself fails (gloo lost a peer) yields to the zen step's own error, which comes too."""

    def __init__(self, group: ZenProcessGroup, zen_name: str, compute: Callable[[], Any],
                 deliver: Callable[[Any], list[torch.Tensor]], device: torch.device | None, checked: bool):
        self.group, self.zen_name, self.compute, self.deliver = group, zen_name, compute, deliver
        self.device = device  # CUDA: the caller's stream is waited on before, and synchronised after
        self.ready = _record_event(device)
        self.result: torch.futures.Future[Any] = torch.futures.Future()
        self.lane: torch.futures.Future[None] = torch.futures.Future()  # set once the zen step is over
        self.lock = threading.Lock()
        self.checked = checked
        self.output: Any = _UNSET
        self.check_error: BaseException | None = None

    def run(self) -> None:
        """On a pool thread: the zen step, then the lane moves on."""
        try:
            if self.ready is not None:
                self.ready.synchronize()  # the caller's stream has written the inputs
            self.computed(self.compute())
        except BaseException as exc:
            self.fail(exc)
        finally:
            _set_once(self.lane)

    def computed(self, output: Any) -> None:
        with self.lock:
            if self.result.done():  # aborted, or OutOfOrder: the user's tensors are no longer ours
                return
            self.output = output
            if self.check_error is not None:
                self._fail_locked(self.check_error)
            elif self.checked:
                self._deliver_locked()

    def check_passed(self) -> None:
        with self.lock:
            if self.result.done():
                return
            self.checked = True
            if self.output is not _UNSET:
                self._deliver_locked()

    def check_failed(self, error: BaseException, definitive: bool) -> None:
        with self.lock:
            if self.result.done():
                return
            if definitive or self.output is not _UNSET:
                self._fail_locked(error)
            else:
                self.check_error = error

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if not self.result.done():
                self._fail_locked(error)

    def _deliver_locked(self) -> None:
        try:
            value = self.deliver(self.output)  # the sum into the caller's tensors (torch's in-place contract)
            if self.device is not None:
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException as exc:
            self._fail_locked(exc)
            return
        self.result.set_result(value)
        self.group._call_done(self, None)

    def _fail_locked(self, error: BaseException) -> None:
        # the group keeps the typed error before the future fails: DDP's backward() raises as soon as it
        # does, and the training loop's reraise() must find the error there (it found none, now and then)
        self.group._call_done(self, error)
        self.result.set_exception(error)


class ZenProcessGroup(ProcessGroup):
    """What `init_process_group("zen")` and `new_group(backend="zen")` create (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, group_id: str = "0",
                 options: Options | None = None):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs know only the store overload
        self.options = options or Options()
        self.dense = self.options.dense_mode()
        self.fuse = fuse_setting(self.options.fuse, os.environ)
        self.timeout = timeout
        self.group_id = group_id
        self.prefix = f"pg{group_id}."
        self._gloo: Any = dist.ProcessGroupGloo(  # Any: torch's stubs lack the Backend's collectives
            PrefixStore("zen/gloo", store), rank, size, timeout)
        self._nccl: Any = None
        if self.options.inner_for_cuda() == "nccl":  # lazy: NCCL connects at the first CUDA op
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(PrefixStore("zen/nccl", store), rank, size, nccl_options)
        # what this class does not override (all_gather_single, all_to_all_single, coalescing, ...)
        # torch's C++ side dispatches per device to these backends
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, self._gloo)
        if self._nccl is not None:
            self._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, self._nccl)
        elif torch.cuda.is_available():
            self._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, self._gloo)
        self._owns_client = self.options.client is None
        client = self.options.client or _SHARED.acquire(timeout.total_seconds())
        self.client: Client = client
        self.whole_job = size == self.client.world_size
        if group_id == "0" and not self.whole_job:
            self._release_client()
            trainers, per_node = self.client.world_size, self.client.local_world_size
            raise ZenError(f"the default process group has {size} ranks but the zen job {self.client.job!r} has "
                           f"{trainers} trainers ({trainers // per_node} nodes x LOCAL_WORLD_SIZE {per_node}): start "
                           "one zend per node and set LOCAL_WORLD_SIZE to the trainers per node")
        self.error: BaseException | None = None  # the last zen error, for reraise() after DDP's RuntimeError
        self._lock = threading.Lock()
        self._tails: dict[str, _Call] = {}  # per zen name: its last call (the next one starts after it)
        self._pending: set[_Call] = set()  # every call not done yet (abort fails them)
        self._calls = 0
        self._names: set[str] = set()
        self._pass: tuple[int, dict[str, int]] = (-1, {})  # the backward pass calls came from, and its counts
        self._warned: set[str] = set()
        self._topk = TopKCompressor(self.options.topk_ratio)
        self._fusion: PassFusion[_Member] = PassFusion()  # under _lock
        self._pass_end_queued = -1  # the backward pass whose end sends what is still held
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"zen-pg{group_id}")
        self._closed = False

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # ------------------------------------------------------------------ all_reduce
    # The list-and-options forms are what torch.distributed's functions and C++ (DDP) call; the
    # base's single-tensor conveniences are not offered (hence the type: ignore[override]s).
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = _op_type(opts.reduceOp) if opts is not None else ReduceOp.SUM
        if not tensors:
            raise ValueError("zen all_reduce: an empty tensor list")
        sparse = [t.is_sparse for t in tensors]
        if any(sparse) and not all(sparse):
            raise ValueError("zen all_reduce: a list that mixes sparse and dense tensors")
        if all(sparse):
            return self._sparse_allreduce(tensors, op)
        if self.dense != "inner" and _is_sum_or_avg(op) and self._zen_carries(tensors[0], "dense all_reduce"):
            return self._dense_via_zen(tensors, op)
        return self._inner(tensors).allreduce(tensors, opts or AllreduceOptions())

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: Any) -> dist.Work:
        if not _is_sum_or_avg(op):
            raise ValueError(f"zen sparse all_reduce: ReduceOp.{getattr(op, 'name', op)} is not supported; use SUM "
                             "or AVG")
        first = tensors[0]
        for i, t in enumerate(tensors[1:], 1):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"zen sparse all_reduce: tensor {i} is {_describe(t)}, tensor 0 {_describe(first)}:"
                                 " a list must hold tensors of one shape, dtype and device")
        average = op == ReduceOp.AVG
        if not self._zen_carries(first, "sparse all_reduce"):
            return self._sparse_on_gloo(tensors, average)
        zen_name = self._name_of(_identity(first, average), first)
        local = first if len(tensors) == 1 else _sum_sparse(tensors)
        rows, values, num_rows = _linearise(local)

        def deliver(result: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
            out_rows, out_values = result
            rows_in_range = checked_rows(out_rows, num_rows, zen_name)  # then every sparse dim's index is in range
            total = torch.sparse_coo_tensor(_delinearise(rows_in_range, first), out_values.to(first.dtype),
                                            first.shape, is_coalesced=True, check_invariants=False)
            for t in tensors:
                t.copy_(total)
            return tensors

        task = torch._C._current_graph_task_id()
        if self.fuse and task >= 0 and getattr(first, _HINT, None) is None:
            return self._fused_or_held(task, _Member(zen_name, rows, values, num_rows, average, deliver, first))
        return self._submit_one(zen_name, rows, values, num_rows, average, deliver, first)

    def _submit_one(self, zen_name: str, rows: torch.Tensor, values: torch.Tensor, num_rows: int, average: bool,
                    deliver: Callable[[Any], list[torch.Tensor]], like: torch.Tensor) -> ZenWork:
        with record_function(f"zen.all_reduce[{zen_name}]"):
            return self._submit(zen_name, lambda: self.client.allreduce(
                (rows, values), name=zen_name, num_rows=num_rows, average=average,
                timeout_s=self.timeout.total_seconds()), deliver, like)

    # ------------------------------------------------------------------ fusion (zen/fusion.py)
    def _fused_or_held(self, task: int, member: _Member) -> ZenWork:
        """A sparse call of backward pass `task`: held for the pass's fused step, or sent now with
        what was held before it."""
        with self._lock:
            stale = self._fusion.stale(task)
            batch = self._fusion.arrive(task, member.zen_name, member)
            queue_end = not batch and self._pass_end_queued != task
            if queue_end:
                self._pass_end_queued = task
        if stale:
            fail([m.result for m in stale], StepAborted(
                f"zen process group {self.group_id}: sparse calls held for a backward pass's fused step were never "
                "sent: that pass failed before its end, or another backward pass ran inside it (reentrant "
                "activation checkpointing; Options(fuse=False) or ZEN_FUSE=0 there) [ABORTED]"))
        if queue_end:  # a pass that stops short of the learned order still sends what it held, at its end
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._send_held())
        if not batch:
            return ZenWork(member.result, on_wait=lambda: self._send_held(member))
        self._send_members(batch)
        return ZenWork(member.result)

    def _send_held(self, waited: _Member | None = None) -> None:
        """What is held, sent now: at the pass's end, or as `waited` is waited on (if it still is held)."""
        with self._lock:
            held = self._fusion.release() if waited is None or self._fusion.is_held(waited) else []
        if held:
            self._send_members(held)

    def _send_members(self, members: list[_Member]) -> None:
        """One zen step for one call; for several, one `allreduce_many` per op and device (and, in it, one
        step per dtype, row widths sharing it where zen.fusion.batches lets them). Each call's own
        future completes with its own tensors."""
        kinds: dict[tuple[bool, torch.device], list[_Member]] = {}
        for m in members:  # one device a step: its CUDA stream is waited on before the step reads
            kinds.setdefault((m.average, m.like.device), []).append(m)
        for (average, _), part in kinds.items():
            try:
                if len(part) == 1:
                    m = part[0]
                    work = self._submit_one(m.zen_name, m.rows, m.values, m.num_rows, m.average, m.deliver, m.like)
                    settle(work._future, [m.result])
                else:
                    self._send_fused(part, average)
            except BaseException as exc:  # not queued (the group shut down meanwhile): no future may hang
                fail([m.result for m in part], exc)

    def _send_fused(self, part: list[_Member], average: bool) -> None:
        tensors = [torch.sparse_coo_tensor(m.rows.unsqueeze(0), m.values, (m.num_rows, *m.values.shape[1:]),
                                           check_invariants=False) for m in part]  # rows: _linearise's, in range
        names = [m.zen_name for m in part]

        def compute() -> Any:
            return self.client.allreduce_many(tensors, names=names, average=average,
                                              timeout_s=self.timeout.total_seconds())

        def deliver(sums: list[torch.Tensor]) -> Any:
            return [m.deliver((total._indices()[0], total._values())) for m, total in zip(part, sums, strict=True)]

        label = f"{self.prefix}fused[{','.join(n.removeprefix(self.prefix) for n in names)}]"
        with record_function(f"zen.all_reduce[{label}]"):
            work = self._submit(label, compute, deliver, part[0].like, tensors=names)
        settle(work._future, [m.result for m in part], each=True)

    def _dense_via_zen(self, tensors: list[torch.Tensor], op: Any) -> dist.Work:
        first = tensors[0]
        average = op == ReduceOp.AVG
        local = first if len(tensors) == 1 else torch.stack(list(tensors)).sum(0)
        kind = f"topk{self.options.topk_ratio:g}" if self.dense == "topk" else "dense"
        zen_name = self._name_of(_identity(first, average, kind), first)
        if self.dense == "topk":
            # error feedback is this rank's own: one residual per tensor storage, so DDP's buckets
            # (persistent buffers) each keep theirs even when two have one shape, and so one name
            residual_key = f"{zen_name}@{first.untyped_storage().data_ptr():x}+{first.storage_offset()}"
            sent = self._topk.compress(residual_key, local)
            _bound(self._topk.residuals, MAX_RESIDUALS)
            numel = first.numel()

            def compute() -> Any:
                return self.client.allreduce((sent.indices, sent.values), name=zen_name, num_rows=numel,
                                             average=average, timeout_s=self.timeout.total_seconds())

            def deliver(result: Any) -> list[torch.Tensor]:
                rows, values = result
                dense = torch.zeros(numel, dtype=first.dtype, device=first.device)
                dense[checked_rows(rows, numel, zen_name)] = values.to(first.dtype)
                for t in tensors:
                    t.copy_(dense.reshape(t.shape))
                return tensors
        else:
            def compute() -> Any:
                return self.client.allreduce(local, name=zen_name, average=average,
                                             timeout_s=self.timeout.total_seconds())

            def deliver(result: Any) -> list[torch.Tensor]:
                for t in tensors:
                    t.copy_(result)
                return tensors

        with record_function(f"zen.all_reduce[{zen_name}]"):
            return self._submit(zen_name, compute, deliver, first)

    def _name_of(self, identity: str, tensor: torch.Tensor) -> str:
        """The zen name of a call: the group's prefix and the call's identity, and, for the k-th call
        (k >= 1) of that identity in one backward pass, `#k`. DDP makes its bucket calls inside the
        backward pass (torch's graph task), each pass in the same order on every rank: the k-th
        same-shaped table of a pass is the same table at every step, a zen tensor of its own, not a
        second step of the first (the order check compares these names). Outside a backward pass,
        and for a `name()` hint, the identity alone."""
        task = torch._C._current_graph_task_id()
        if task < 0 or getattr(tensor, _HINT, None) is not None:
            return self.prefix + identity
        with self._lock:
            if self._pass[0] != task:
                self._pass = (task, {})
            counts = self._pass[1]
            k = counts.get(identity, 0)
            counts[identity] = k + 1
        return self.prefix + identity + (f"#{k}" if k else "")

    def _submit(self, zen_name: str, compute: Callable[[], Any], deliver: Callable[[Any], list[torch.Tensor]],
                like: torch.Tensor, tensors: Sequence[str] = ()) -> ZenWork:
        """Queue one zen step of `zen_name` behind the previous one (a name has one step in flight),
        with the order check of this call beside it. `tensors`: the zen tensors a fused call carries
        (what last_stats reports), else the call's own name."""
        check = self.options.check_order and self.size() > 1
        call = _Call(self, zen_name, compute, deliver, like.device if like.is_cuda else None, checked=not check)
        with self._lock:
            if self._closed:
                raise ZenError(f"zen process group {self.group_id} is shut down")
            seq = self._calls
            self._calls += 1
            self._names.update(tensors or [zen_name])
            self._pending.add(call)
            previous = self._tails.get(zen_name)
            self._tails[zen_name] = call
        if check:
            self._check_order(seq, call)

        def start(_: Any = None) -> None:
            try:
                self._pool.submit(call.run)
            except RuntimeError:  # the pool shut down (abort) while this call waited for its turn
                call.fail(StepAborted(f"zen process group {self.group_id} aborted before {zen_name!r} ran [ABORTED]"))
                _set_once(call.lane)

        if previous is None:
            start()
        else:
            previous.lane.add_done_callback(start)
        return ZenWork(call.result)

    def _call_done(self, call: _Call, error: BaseException | None) -> None:
        with self._lock:
            self._pending.discard(call)
            if error is not None:
                self.error = error

    def _check_order(self, seq: int, call: _Call) -> None:
        """Every rank's name for call `seq`, gathered on the inner gloo group beside the zen step."""
        mine = _call_record(call.zen_name)
        gathered = [torch.empty(_CHECK_BYTES, dtype=torch.uint8) for _ in range(self.size())]
        future = self._gloo.allgather([gathered], [mine]).get_future()

        def compare(_: Any) -> None:
            try:
                future.wait()
            except BaseException as exc:
                call.check_failed(ZenError(f"zen order check of call {seq} ({call.zen_name!r}) failed on the gloo "
                                           f"group: {exc}"), definitive=False)
                return
            for rank, record in enumerate(gathered):
                if not torch.equal(record[:16], mine[:16]):
                    call.check_failed(OutOfOrder(
                        f"zen all_reduce call {seq} of process group {self.group_id}: rank {self.rank()} called it "
                        f"for {call.zen_name!r}, rank {rank} for {_call_text(record)!r}; every rank must make the "
                        "same all_reduce calls in the same order (name a tensor with zen.distributed.name). This "
                        "group is unusable now: destroy it"), definitive=True)
                    return
            call.check_passed()

        future.add_done_callback(compare)

    # ------------------------------------------------------------------ where zen does not go
    def _zen_carries(self, tensor: torch.Tensor, what: str) -> bool:
        if tensor.dtype not in dtypes.TORCH_DTYPES:
            self._warn_once(f"dtype {tensor.dtype}", f"{what} of {tensor.dtype} tensors goes through gloo: zen "
                            f"carries {', '.join(dtypes.NAMES)}")
            return False
        rows = math.prod(tensor.shape[:tensor.sparse_dim()]) if tensor.is_sparse else tensor.numel()
        if rows >= MAX_ROWS:
            self._warn_once(f"rows {rows}", f"{what} of {_describe(tensor)} goes through gloo: its {rows} rows "
                            f"(sparse dims folded) exceed zen's {MAX_ROWS}")
            return False
        if not self.whole_job:
            self._warn_once("subgroup", f"{what} in process group {self.group_id} ({self.size()} of the job's "
                            f"{self.client.world_size} trainers) goes through gloo: zen sums over the whole job")
            return False
        return True

    def _sparse_on_gloo(self, tensors: list[torch.Tensor], average: bool) -> dist.Work:
        """gloo's sparse all_reduce (an allgather; CUDA tensors staged through the host); gloo has no
        AVG, so the sum is divided here, in the inputs, which gloo's future returns."""
        work = self._gloo.allreduce(tensors, AllreduceOptions())
        if not average:
            return work
        size = self.size()

        def divide(done: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
            done.value()  # raises gloo's error, if any
            for t in tensors:
                t.copy_(t / size)
            return tensors

        return ZenWork(work.get_future().then(divide))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning("%s", message)

    def _inner(self, tensors: Sequence[Any]) -> Any:
        first = _first_tensor(tensors)
        if first is not None and first.is_cuda and self._nccl is not None:
            return self._nccl
        return self._gloo

    # ------------------------------------------------------------------ every other collective: the inner group
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._inner(tensors).allreduce_coalesced(tensors, opts or AllreduceCoalescedOptions())

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._inner(tensors).broadcast(tensors, opts or BroadcastOptions())

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> dist.Work:
        return self._inner(inputs).allgather(output_lists, inputs, opts or AllgatherOptions())

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._inner([input])._allgather_base(output, input, opts or AllgatherOptions())

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        return self._inner(inputs).allgather_coalesced(output_lists, inputs, opts or AllgatherOptions())

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._inner(inputs).allgather_into_tensor_coalesced(outputs, inputs, opts or AllgatherOptions())

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._inner(inputs).gather(output_lists, inputs, opts or GatherOptions())

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> dist.Work:
        return self._inner(outputs).scatter(outputs, input_lists, opts or ScatterOptions())

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._inner(tensors).reduce(tensors, opts or ReduceOptions())

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> dist.Work:
        return self._inner(outputs).reduce_scatter(outputs, input_lists, opts or ReduceScatterOptions())

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._inner([input])._reduce_scatter_base(output, input, opts or ReduceScatterOptions())

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._inner(inputs).reduce_scatter_tensor_coalesced(outputs, inputs,
                                                                   opts or ReduceScatterOptions())

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._inner(inputs).alltoall(outputs, inputs, opts or AllToAllOptions())

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        return self._inner([input]).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                  opts or AllToAllOptions())

    # torch's single-tensor collectives, called from Python, go straight to the inner backend's binding,
    # which lets go of the GIL before gloo takes its queue lock; through the base class (torch 2.14) a rank
    # hung for good in all_gather_into_tensor, beside a gloo thread that held a Python thread state
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._inner([input])._allgather_base(output, input, opts or AllgatherOptions())

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._inner([input])._reduce_scatter_base(output, input, opts or ReduceScatterOptions())

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._gloo.barrier(opts or BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._inner(tensors).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._inner(tensors).recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._inner(tensors).recv_anysource(tensors, tag)

    # ------------------------------------------------------------------ what zen adds
    def reraise(self, cause: BaseException | None = None) -> None:
        """Raise the zen error that failed the last failed call (see zen.distributed.reraise), once;
        given the RuntimeError that DDP raised, only if that is the zen error's (a stale one is dropped)."""
        with self._lock:
            error, self.error = self.error, None
        if error is not None and behind(error, cause):
            raise error

    def last_stats(self) -> dict[str, StepStats]:
        """The daemon's figures for the last step of every zen tensor this group synchronised."""
        with self._lock:
            names = sorted(self._names)
        return {n: s for n in names if (s := self.client.last_stats(n)) is not None}

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """destroy_process_group: steps in flight finish, then the zen session (if ours) closes."""
        self._close(wait=True)

    def abort(self) -> None:
        """Every work not done fails at once with zen.StepAborted (steps already at the daemon run
        out there, their results unread); the zen session (if ours) closes once they have."""
        self._close(wait=False)

    def _close(self, wait: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no new calls from here on
            pending, tails = list(self._pending), list(self._tails.values())
            held = self._fusion.release()
        fail([m.result for m in held], StepAborted(f"zen process group {self.group_id} closed before calls held "
                                                   "for a backward pass's fused step were sent [ABORTED]"))
        if wait:  # every lane to its end: the steps queued behind others run too
            for call in tails:
                call.lane.wait()
        else:
            for call in pending:
                call.fail(StepAborted(f"zen process group {self.group_id} aborted (ProcessGroup.abort) [ABORTED]"))
            for call in tails:  # lanes whose steps the pool drops: the calls behind them see the abort
                _set_once(call.lane)
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        for inner in (self._gloo, self._nccl):
            if inner is not None and hasattr(inner, "shutdown"):
                with contextlib.suppress(RuntimeError):  # not on every build: its sockets close with it
                    inner.shutdown() if wait else inner.abort()
        if wait:
            self._release_client()
        else:  # the client's close waits for the calls still at the daemon: not here
            threading.Thread(target=self._release_client, name="zen-pg-release", daemon=True).start()

    def _release_client(self) -> None:
        if self._owns_client and self.client is not None:
            _SHARED.release(self.client)


@dataclass
class _Member:
    """A sparse call of a backward pass, as fusion holds it: what to send, and where its sum goes."""

    zen_name: str
    rows: torch.Tensor
    values: torch.Tensor
    num_rows: int
    average: bool
    deliver: Callable[[Any], list[torch.Tensor]]
    like: torch.Tensor
    result: torch.futures.Future[Any] = field(default_factory=torch.futures.Future)


# ---------------------------------------------------------------------------------------- helpers (pure)
def _op_type(op: Any) -> Any:
    """AllreduceOptions.reduceOp is a ReduceOp wrapper; its `.op` the RedOpType that compares."""
    return getattr(op, "op", op)


def _is_sum_or_avg(op: Any) -> bool:
    return bool(op == ReduceOp.SUM or op == ReduceOp.AVG)


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(s) for s in t.shape)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _describe(t: torch.Tensor) -> str:
    return f"[{_shape(t)}] {_dtype(t)} on {t.device}"


def _identity(t: torch.Tensor, average: bool, kind: str | None = None, sparse_dim: int | None = None) -> str:
    """The zen tensor a call synchronises (the group's prefix aside): the hint, or the call's kind,
    shape, dtype and device; and the op, which a zen tensor fixes when it is registered."""
    op = "avg" if average else "sum"
    hint = getattr(t, _HINT, None)
    if hint is not None:
        return f"{hint}.{op}"
    if kind is None:
        kind = f"sparse{t.sparse_dim() if sparse_dim is None else sparse_dim}"
    return f"{kind}[{_shape(t)}].{_dtype(t)}.{op}.{t.device.type}"


def _bound(table: dict[str, Any], limit: int) -> None:
    while len(table) > limit:
        del table[next(iter(table))]  # the oldest: dicts keep insertion order


def _sum_sparse(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def _linearise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows, values, num_rows): the sparse dims folded into one row index (row-major)."""
    indices, values = t._indices(), t._values()
    dims = t.shape[:t.sparse_dim()]
    num_rows = math.prod(dims)  # below MAX_ROWS: _zen_carries sent bigger ones to gloo
    rows = indices[0].to(torch.int64)
    for d in range(1, len(dims)):
        rows = rows * dims[d] + indices[d].to(torch.int64)
    return rows, values, num_rows


def _delinearise(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    dims = like.shape[:like.sparse_dim()]
    out = torch.empty((len(dims), rows.numel()), dtype=torch.int64, device=rows.device)
    rest = rows.to(torch.int64)
    for d in range(len(dims) - 1, 0, -1):
        out[d] = rest % dims[d]
        rest = rest // dims[d]
    out[0] = rest
    return out


def _first_tensor(items: Any) -> torch.Tensor | None:
    if isinstance(items, torch.Tensor):
        return items
    if isinstance(items, (list, tuple)):
        for item in items:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _call_record(zen_name: str) -> torch.Tensor:
    digest = hashlib.blake2b(zen_name.encode(), digest_size=16).digest()
    text = zen_name.encode()[:_CHECK_BYTES - 16]
    record = torch.zeros(_CHECK_BYTES, dtype=torch.uint8)
    record[:16] = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    if text:
        record[16:16 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return record


def _call_text(record: torch.Tensor) -> str:
    return bytes(record[16:].tolist()).rstrip(b"\0").decode(errors="replace")


# ---------------------------------------------------------------------------------------- registration
def _create(backend_options: Any, pg_options: Any) -> ZenProcessGroup:
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"zen backend: pg_options must be zen.distributed.Options, not {type(pg_options).__name__}")
    return ZenProcessGroup(backend_options.store, backend_options.group_rank, backend_options.group_size,
                           backend_options.timeout, str(backend_options.group_id), pg_options)


def register() -> None:
    """Make "zen" a torch.distributed backend (done on `import zen`; harmless twice)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _group(group: ProcessGroup | None) -> ZenProcessGroup:
    pg = group or dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ZenProcessGroup):
        raise ValueError(f"process group {pg!r} is not a zen one (init_process_group('zen'))")
    return pg


def sparse_name(like: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None,
                occurrence: int = 0) -> str:
    """The zen tensor name of a sparse all_reduce of a gradient shaped like `like` (a parameter, say:
    DDP reduces with SUM), for `client_of().last_stats(name)`; `occurrence` k for the k-th table of
    that shape that a backward pass synchronises (DDP: in the order its buckets are reduced)."""
    sparse_dim = like.sparse_dim() if like.is_sparse else 1
    base = _group(group).prefix + _identity(like, _op_type(op) == ReduceOp.AVG, sparse_dim=sparse_dim)
    return base + (f"#{occurrence}" if occurrence else "")


def reraise(cause: BaseException | None = None, group: ProcessGroup | None = None) -> None:
    """Under DDP a failed sparse bucket reaches `backward()` as a RuntimeError; this raises the typed
    zen error behind it (e.g. zen.StepAborted: wait for the cluster, then redo the step), if any:

        try:
            loss.backward()
        except RuntimeError as exc:
            zen.distributed.reraise(exc)   # only if exc is that zen error's
            raise
    """
    _group(group).reraise(cause)


def client_of(group: ProcessGroup | None = None) -> Client:
    """The zen.Client a zen process group synchronises through (e.g. for `wait_ready` after a fault)."""
    return _group(group).client


register()
