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
- `all_reduce` of dense tensors: the inner group, unless `Options(dense="ring" | "topk")` (or
  ZEN_DENSE_ALLREDUCE=ring|topk) sends SUM/AVG ones through the daemon too.
- Every other collective (broadcast, allgather, reduce_scatter, all_to_all, barrier, send/recv):
  the inner group, at its own speed.
- Sparse tensors zen does not carry (float64, integers) and groups that are not the whole job
  (a `new_group` of some ranks: the daemons sum over every trainer of the job) go through the
  inner gloo group, with a warning once per reason.

Tensor identity. zen synchronises named tensors, each with its own step counter. A sparse
all_reduce is named after its group, its `zen.distributed.name(tensor, "emb")` hint if it has one,
and otherwise its shape, dtype, op and device type; its step is the number of earlier calls of that
name. So, as with every torch backend, ranks must make the same calls in the same order; the
backend checks it (a 128-byte allgather on the inner group beside every zen step) and fails the
call with `zen.OutOfOrder` naming both ranks' calls when they differ. The group is unusable after.

Errors: `work.wait()` raises zen's typed errors (`zen.StepAborted`, `zen.DaemonUnavailable`, ...);
under DDP, `backward()` gets them as RuntimeError and `zen.distributed.reraise()` gives the typed one.
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
from dataclasses import dataclass
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

from zen.client import Client, StepStats
from zen.errors import OutOfOrder, StepAborted, StepTimeout, ZenError
from zend.core import dtypes

BACKEND_NAME = "zen"
DENSE_MODES = ("inner", "ring", "topk")
DENSE_ENV = "ZEN_DENSE_ALLREDUCE"
_HINT = "_zen_name"
_CHECK_BYTES = 128  # per call: a 16-byte digest of the call's name, then the name itself, cut to fit
_log = logging.getLogger("zen.distributed")


@dataclass
class Options:
    """`dist.init_process_group("zen", pg_options=zen.distributed.Options(...))`."""

    dense: str | None = None  # "inner" (gloo/NCCL, the default), "ring" or "topk": dense SUM/AVG via zend
    topk_ratio: float = 0.01  # with dense="topk": the share of values sent, with error feedback
    check_order: bool = True  # compare every rank's call before trusting a zen step's identity
    client: Client | None = None  # default: one zen.Client per process, from the sidecar's environment

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

    def __init__(self, future: torch.futures.Future[Any]):
        super().__init__()
        self._future = future
        # what C++ callers (DDP's reducer) get: the same outcome, the error set by torch's own `then`.
        # A Python exception set on a future directly crashes the reducer that reads it (SIGSEGV in
        # backward, torch 2.13); one raised in a `then` callback reaches backward() as RuntimeError.
        self._for_torch = future.then(_value)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
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
class ZenProcessGroup(ProcessGroup):
    """What `init_process_group("zen")` and `new_group(backend="zen")` create (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, group_id: str = "0",
                 options: Options | None = None):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs know only the store overload
        self.options = options or Options()
        self.dense = self.options.dense_mode()
        self.timeout = timeout
        self.group_id = group_id
        self.prefix = f"pg{group_id}."
        self._gloo: Any = dist.ProcessGroupGloo(  # Any: torch's stubs lack the Backend's collectives
PrefixStore("zen/gloo", store), rank, size, timeout)
        self._nccl: Any = None
        if torch.cuda.is_available() and dist.is_nccl_available():  # lazy: NCCL connects at the first CUDA op
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(PrefixStore("zen/nccl", store), rank, size, nccl_options)
        # what this class does not override (all_gather_single, all_to_all_single, coalescing, ...)
        # torch's C++ side dispatches per device to these backends
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, self._gloo)
        if self._nccl is not None:
            self._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, self._nccl)
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
        self._tails: dict[str, torch.futures.Future[Any]] = {}  # per zen name: the last step queued
        self._calls = 0
        self._names: set[str] = set()
        self._warned: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"zen-pg{group_id}")
        self._pending: set[Callable[..., None]] = set()  # settle() of every work not done yet (abort fails them)
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
        return self._inner(tensors).allreduce(tensors, _allreduce_options(opts))

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
        self._check_open()
        identity = getattr(first, _HINT, None) or _signature(first, average)
        zen_name = self.prefix + identity
        local = first if len(tensors) == 1 else _sum_sparse(tensors)
        rows, values, num_rows = _linearise(local)
        with record_function(f"zen.all_reduce[{zen_name}]"):
            return self._submit(zen_name, tensors, lambda: self._finish_sparse(
                self.client.allreduce((rows, values), name=zen_name, num_rows=num_rows, average=average,
                                      timeout_s=self.timeout.total_seconds()), first, tensors))

    @staticmethod
    def _finish_sparse(result: tuple[torch.Tensor, torch.Tensor], like: torch.Tensor,
                       tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        rows, values = result
        total = torch.sparse_coo_tensor(_delinearise(rows, like), values.to(like.dtype), like.shape,
                                        is_coalesced=True, check_invariants=False)  # rows: checked by the daemon
        for t in tensors:
            t.copy_(total)  # torch's in-place contract: inputs hold the sum
        return tensors

    def _dense_via_zen(self, tensors: list[torch.Tensor], op: Any) -> dist.Work:
        self._check_open()
        first = tensors[0]
        average = op == ReduceOp.AVG
        local = first if len(tensors) == 1 else torch.stack(list(tensors)).sum(0)
        kind = f"topk{self.options.topk_ratio:g}" if self.dense == "topk" else "dense"
        zen_name = self.prefix + (getattr(first, _HINT, None) or f"{kind}[{_shape(first)}].{_dtype(first)}"
                                  f".{'avg' if average else 'sum'}.{first.device.type}")
        topk = self.options.topk_ratio if self.dense == "topk" else None

        def run() -> list[torch.Tensor]:
            out = self.client.allreduce(local, name=zen_name, average=average,
                                        timeout_s=self.timeout.total_seconds(), topk=topk)
            for t in tensors:
                t.copy_(out)
            return tensors

        with record_function(f"zen.all_reduce[{zen_name}]"):
            return self._submit(zen_name, tensors, run)

    def _submit(self, zen_name: str, tensors: list[torch.Tensor],
                run: Callable[[], list[torch.Tensor]]) -> ZenWork:
        """Queue one zen step of `zen_name` behind the previous one (a name has one step in flight),
        beside the order check of this call; the work fails with whichever fails first."""
        result: torch.futures.Future[Any] = torch.futures.Future()
        lock = threading.Lock()
        state: dict[str, Any] = {"checked": not self._needs_check(), "value": None}

        def settle(value: list[torch.Tensor] | None = None, error: BaseException | None = None,
                   checked: bool = False) -> None:
            with lock:
                if result.done():
                    return
                if error is not None:
                    self.error = error
                    result.set_exception(error)
                else:
                    state["checked"] = state["checked"] or checked
                    if value is not None:
                        state["value"] = value
                    if not (state["checked"] and state["value"] is not None):
                        return
                    result.set_result(state["value"])
            with self._lock:
                self._pending.discard(settle)

        with self._lock:
            self._pending.add(settle)
            seq = self._calls
            self._calls += 1
            self._names.add(zen_name)
            previous = self._tails.get(zen_name)
            done: torch.futures.Future[None] = torch.futures.Future()
            self._tails[zen_name] = done

        def step() -> None:
            try:
                settle(run())
            except BaseException as exc:
                settle(error=exc)
            finally:
                done.set_result(None)

        def start(_: Any = None) -> None:
            try:
                self._pool.submit(step)
            except RuntimeError as exc:  # the pool shut down while this step waited for its turn
                settle(error=ZenError(f"zen process group {self.group_id} shut down before {zen_name!r} ran: {exc}"))
                done.set_result(None)

        if self._needs_check():
            self._check_order(seq, zen_name, settle)
        if previous is None:
            start()
        else:
            previous.add_done_callback(start)
        return ZenWork(result)

    def _needs_check(self) -> bool:
        return self.options.check_order and self.size() > 1

    def _check_order(self, seq: int, zen_name: str, settle: Callable[..., None]) -> None:
        """Every rank's name for call `seq`, gathered on the inner gloo group beside the zen step."""
        mine = _call_record(zen_name)
        gathered = [torch.empty(_CHECK_BYTES, dtype=torch.uint8) for _ in range(self.size())]
        future = self._gloo.allgather([gathered], [mine]).get_future()

        def compare(_: Any) -> None:
            try:
                future.wait()
            except BaseException as exc:
                settle(error=ZenError(f"zen order check of call {seq} ({zen_name!r}) failed on the gloo group: {exc}"))
                return
            for rank, record in enumerate(gathered):
                if not torch.equal(record[:16], mine[:16]):
                    settle(error=OutOfOrder(
                        f"zen sparse all_reduce call {seq} of process group {self.group_id}: rank {self.rank()} "
                        f"called it for {zen_name!r}, rank {rank} for {_call_text(record)!r}; every rank must make "
                        "the same all_reduce calls in the same order (name a tensor with zen.distributed.name). "
                        "This group is unusable now: destroy it"))
                    return
            settle(checked=True)

        future.add_done_callback(compare)

    # ------------------------------------------------------------------ where zen does not go
    def _zen_carries(self, tensor: torch.Tensor, what: str) -> bool:
        if tensor.dtype not in dtypes.TORCH_DTYPES:
            self._warn_once(f"dtype {tensor.dtype}", f"{what} of {tensor.dtype} tensors goes through gloo: zen "
                            f"carries {', '.join(dtypes.NAMES)}")
            return False
        if not self.whole_job:
            self._warn_once("subgroup", f"{what} in process group {self.group_id} ({self.size()} of the job's "
                            f"{self.client.world_size} trainers) goes through gloo: zen sums over the whole job")
            return False
        return True

    def _sparse_on_gloo(self, tensors: list[torch.Tensor], average: bool) -> dist.Work:
        work = self._gloo.allreduce(tensors, _allreduce_options(None))
        if not average:
            return work
        size = self.size()

        def divide(done: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
            outputs = done.value()
            for t in tensors:
                t.copy_(t / size)
            return [o / size for o in outputs]

        return ZenWork(work.get_future().then(divide))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning("%s", message)

    def _inner(self, tensors: Sequence[Any]) -> Any:
        first = _first_tensor(tensors)
        if first is not None and first.is_cuda:
            if self._nccl is None:
                raise RuntimeError("zen: a CUDA tensor, but NCCL is not available for the inner group")
            return self._nccl
        return self._gloo

    def _check_open(self) -> None:
        if self._closed:
            raise ZenError(f"zen process group {self.group_id} is shut down")

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

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._gloo.barrier(opts or BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._inner(tensors).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._inner(tensors).recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._inner(tensors).recv_anysource(tensors, tag)

    # ------------------------------------------------------------------ what zen adds
    def reraise(self) -> None:
        """Raise the zen error that failed the last failed call (see zen.distributed.reraise), once."""
        error, self.error = self.error, None
        if error is not None:
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
            self._closed = True
            pending = list(self._pending) if not wait else []
        for settle in pending:
            settle(error=StepAborted(f"zen process group {self.group_id} aborted (ProcessGroup.abort) [ABORTED]"))
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


# ---------------------------------------------------------------------------------------- helpers (pure)
def _op_type(op: Any) -> Any:
    """AllreduceOptions.reduceOp is a ReduceOp wrapper; its `.op` the RedOpType that compares."""
    return getattr(op, "op", op)


def _is_sum_or_avg(op: Any) -> bool:
    return bool(op == ReduceOp.SUM or op == ReduceOp.AVG)


def _allreduce_options(opts: Any) -> Any:
    return opts if opts is not None else AllreduceOptions()


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(s) for s in t.shape)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _describe(t: torch.Tensor) -> str:
    return f"[{_shape(t)}] {_dtype(t)} on {t.device}"


def _signature(t: torch.Tensor, average: bool, sparse_dim: int | None = None) -> str:
    dims = t.sparse_dim() if sparse_dim is None else sparse_dim
    return f"sparse{dims}[{_shape(t)}].{_dtype(t)}.{'avg' if average else 'sum'}.{t.device.type}"


def _sum_sparse(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def _linearise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows, values, num_rows): the sparse dims folded into one row index (row-major)."""
    indices, values = t._indices(), t._values()
    dims = t.shape[:t.sparse_dim()]
    num_rows = math.prod(dims)
    if num_rows >= 2**63:
        raise ValueError(f"zen sparse all_reduce of {_describe(t)}: {num_rows} rows do not fit a 64-bit row index")
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


def sparse_name(like: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None) -> str:
    """The zen tensor name of a sparse all_reduce of a gradient shaped like `like` (a parameter, say:
    DDP reduces with SUM), for `client_of().last_stats(name)`."""
    pg = _group(group)
    hint = getattr(like, _HINT, None)
    sparse_dim = like.sparse_dim() if like.is_sparse else 1
    return pg.prefix + (hint or _signature(like, _op_type(op) == ReduceOp.AVG, sparse_dim))


def reraise(group: ProcessGroup | None = None) -> None:
    """Under DDP a failed sparse bucket reaches `backward()` as a RuntimeError; this raises the typed
    zen error behind it (e.g. zen.StepAborted: wait for the cluster, then redo the step), if any:

        try:
            loss.backward()
        except RuntimeError:
            zen.distributed.reraise()
            raise
    """
    _group(group).reraise()


def client_of(group: ProcessGroup | None = None) -> Client:
    """The zen.Client a zen process group synchronises through (e.g. for `wait_ready` after a fault)."""
    return _group(group).client


register()
