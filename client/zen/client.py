"""`Client`: a trainer's connection to its node's zend daemon, and `allreduce` in the shapes torch uses.

    with zen.Client() as zc:                     # address, job and token from the sidecar's environment
        grad = zc.allreduce(emb.weight.grad, name="emb", average=True)   # sparse COO in, sparse COO out

Accepted: a torch sparse COO tensor (row-sparse, like nn.Embedding(sparse=True) makes), an
(indices, values) pair with `num_rows`, or a dense tensor (summed densely, or top-k sparsified
with error feedback when `topk` is given). Each name has its own step counter; every trainer
of the job must call allreduce for the same names in the same order of steps.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from torch.profiler import record_function

from zen import fused_rows, fusion
from zen.errors import (
    DaemonUnavailable,
    InvalidGradient,
    NotAuthorized,
    OutOfOrder,
    ZenError,
    from_buffer_error,
    from_rpc_error,
    from_step_failed,
)
from zend.core.sparse import SparseGrad, SparseGradError, from_torch_sparse
from zend.core.topk import TopKCompressor
from zend.protocol import paths
from zend.protocol.session import SharedBufferError, TensorHandle, TrainerSession
from zend.protocol.step import SESSION_UNKNOWN, StepFailed, StepResult

log = logging.getLogger("zen")

Indexed = tuple[torch.Tensor, torch.Tensor]


def _cuda_device_of(tensor: torch.Tensor | Indexed) -> torch.device | None:
    """The CUDA device `tensor` (or an (indices, values) pair's values) lives on, or None."""
    values = tensor[1] if isinstance(tensor, tuple) else tensor
    return values.device if isinstance(values, torch.Tensor) and values.is_cuda else None


def checked_rows(rows: torch.Tensor, num_rows: int, name: str) -> torch.Tensor:
    """`rows`, once each is in [0, num_rows); InvalidGradient naming the tensor and the row otherwise.

    What a sparse tensor is built from, in place of torch's own check (check_invariants, which costs
    more): a row past the end would have the next op on that tensor write outside its memory."""
    if rows.numel():
        low, high = (int(x) for x in torch.aminmax(rows))
        if low < 0 or high >= num_rows:
            raise InvalidGradient(f"tensor {name!r}: the result holds row {low if low < 0 else high}, outside "
                                  f"[0, {num_rows}): refused before building the tensor")
    return rows


MAX_FUSED_ROWS = 2**31  # a zen tensor's rows (zend.core.sparse): tables fused past it go as more steps



StepStats = StepResult  # what the daemon reported of a tensor's last step, as seen from this trainer's node


@dataclass
class _Tensor:
    handle: TensorHandle
    kind: str  # "sparse", "pair", "dense", "topk"
    shape: tuple[int, ...]
    next_step: int = 0
    tried: int = 0  # the step last submitted (a trainer that resumed at the job's step tries it first)
    in_flight: bool = False
    stats: StepStats | None = None


class Client:
    """Connect to the node's daemon. Arguments default to the environment the sidecar sets:
    ZEN_SOCKET_DIR (else /run/zend), ZEN_JOB, ZEN_JOB_TOKEN, LOCAL_RANK, LOCAL_WORLD_SIZE."""

    def __init__(self, socket_dir: str | None = None, *, job: str | None = None, token: str | None = None,
                 local_rank: int | None = None, local_world_size: int | None = None, timeout_s: float = 120.0,
                 max_workers: int = 4, wait_s: float | None = None):
        """`wait_s` (default `timeout_s`): how long to wait for a daemon that is not serving yet (still
        starting, or joining its cluster) before DaemonUnavailable; 0 fails at once."""
        env = os.environ
        self.socket_dir = socket_dir or paths.socket_dir_from_env(env)
        self.address = paths.grpc_address(self.socket_dir)
        self.job = job or env.get("ZEN_JOB", "default")
        token = token or env.get("ZEN_JOB_TOKEN")
        if not token:
            raise NotAuthorized(f"no job token: pass token= or set ZEN_JOB_TOKEN (`zend token --job {self.job}`)")
        self.timeout_s = timeout_s
        self.local_rank = int(env.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1")) if local_world_size is None else local_world_size
        self._token = token
        self._session = self._wait_for_session(timeout_s if wait_s is None else wait_s)
        self.generation = self._session.generation
        self.job_step = self._session.job_step  # where the job is (a trainer restarted mid-job resumes there)
        self._tensors: dict[str, _Tensor] = {}
        self._fused_into: dict[str, str] = {}  # a tensor's name -> the fused step it last went in (last_stats)
        self._topk: dict[float, TopKCompressor] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="zen-client")

    @property
    def world_size(self) -> int:
        """Trainers of the job across the cluster (nodes x local world size)."""
        return self._session.node_count * self.local_world_size

    @property
    def session(self) -> TrainerSession:
        """The session with the daemon now (a new one after the daemon restarted): zen.checkpoint's way in."""
        return self._session

    def _wait_for_session(self, wait_s: float) -> TrainerSession:
        """A session with the daemon, waiting up to `wait_s` while it is not serving yet (its socket not
        made, or UNAVAILABLE while it joins the cluster): `zend serve & python train.py` just works.
        Says once, on the "zen" logger, what it waits for; any other refusal is raised at once."""
        deadline = time.monotonic() + max(0.0, wait_s)
        pause, said = 0.05, False
        while True:
            try:
                if not os.path.exists(paths.grpc_socket(self.socket_dir)):
                    raise DaemonUnavailable(f"no zend daemon at {self.address}: the socket does not exist "
                                            "(is the sidecar running? ZEN_SOCKET_DIR points elsewhere?)")
                return self._open_session(min(max(deadline - time.monotonic(), 1.0), 30.0))
            except DaemonUnavailable as exc:
                if time.monotonic() + pause >= deadline:
                    raise DaemonUnavailable(f"{exc} (waited {wait_s:g} s)" if wait_s > 0 else str(exc)) from None
                if not said:
                    log.warning("zen: waiting up to %g s for the zend daemon at %s to serve: %s", wait_s,
                                self.address, exc)
                    said = True
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _open_session(self, timeout_s: float) -> TrainerSession:
        try:
            return TrainerSession(self.socket_dir, self.job, self._token, self.local_rank, self.local_world_size,
                                  timeout_s=timeout_s)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None
        except (ConnectionError, OSError) as exc:
            raise DaemonUnavailable(f"zend daemon at {self.address}: {exc}") from None

    # ------------------------------------------------------------------ after a fault
    def wait_ready(self, timeout_s: float = 120.0) -> int:
        """Block until the job's cluster is whole again (every node of the membership connected, no
        change under way); returns the membership generation. DaemonUnavailable after timeout_s.

        After zen.StepAborted: call this, then submit the same step again, from the same state, as
        every trainer of the job does. If this node's daemon itself restarted, the session is opened
        again and every tensor registered again; their step counters are kept. After a scale-in
        (--min-nodes) `world_size` is the new, smaller one: rescale the learning rate if it depends on it."""
        deadline = time.monotonic() + timeout_s
        why = "no answer yet"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonUnavailable(f"zend at {self.address}: the cluster is not whole within {timeout_s:g} s: "
                                        f"{why}")
            try:
                if self._session.closed:
                    self._reopen(min(left, 5.0))
                reply = self._session.ready(min(left, 10.0))
                if reply.ready:
                    self.generation, self.job_step = int(reply.generation), int(reply.job_step)
                    self._session.node_count = int(reply.node_count)  # smaller after a scale-in: world_size
                    break
                why = reply.reason
            except grpc.RpcError as exc:
                code, why = exc.code(), f"{exc.code().name}: {exc.details()}"
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise from_rpc_error(exc, self.address) from None
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    raise DaemonUnavailable(f"zend at {self.address} is too old to say when it is ready: {why}") \
                        from None
                # our session is unknown (the daemon restarted) or its daemon is gone: a new session
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    self._session.close()
            except ZenError as exc:  # a new session refused: the daemon still joining, or down
                if isinstance(exc, NotAuthorized):
                    raise
                why = str(exc)
            except OSError as exc:  # the new session's buffers (socket, memfd)
                why = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
        self._check_not_behind()  # outside the retries: OutOfOrder is the trainer's to handle
        return self.generation

    def _check_not_behind(self) -> None:
        """OutOfOrder if a tensor of ours is at a step the job has finished: every other node delivered
        it while this node's daemon was killed, after its vote, before our result reached us (or this
        trainer restarted from an older checkpoint than the others). Its result is lost, and nobody
        would ever run the step again (a hang)."""
        at = {name: max(e.next_step, e.tried) for name, e in self._tensors.items()}
        behind = {name: step for name, step in at.items() if step < self.job_step}
        if behind:
            raise OutOfOrder(f"the job is at step {self.job_step}, but this trainer's {sorted(behind.items())} "
                             "(tensor, step) finished on the other nodes while this node's daemon restarted, and "
                             f"the result is lost: restart this trainer from a checkpoint of step {self.job_step}")

    def _reopen(self, timeout_s: float) -> None:
        """A new session with a restarted daemon, every tensor registered again under its name; all
        or nothing (a half-registered session is closed, so that the next try starts again)."""
        session = self._open_session(timeout_s)
        handles: dict[str, TensorHandle] = {}
        try:
            for name, entry in self._tensors.items():
                handles[name] = session.register_again(entry.handle)
        except BaseException as exc:
            session.close()
            if isinstance(exc, grpc.RpcError):
                raise from_rpc_error(exc, self.address) from None
            raise
        self._session = session
        for name, handle in handles.items():
            self._tensors[name].handle = handle

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, tensor: torch.Tensor | Indexed, *, name: str, average: bool = False,
                  num_rows: int | None = None, topk: float | None = None, step: int | None = None,
                  timeout_s: float | None = None) -> Any:
        """The sum (or mean) of `tensor` over every trainer of the job, in the form it came in."""
        kind, grad, shape = self._as_grad(tensor, name, num_rows, topk)
        entry = self._entry(name, kind, grad, shape, average)
        with self._lock:
            if entry.in_flight:
                raise ZenError(f"tensor {name!r}: the previous allreduce is still in flight")
            entry.in_flight = True
            step = entry.next_step if step is None else step
            entry.tried = step
        try:
            with record_function(f"zen.allreduce[{name}]"):  # zen's steps show in torch.profiler traces
                out = self._session.allreduce(entry.handle, grad, step, timeout_s=timeout_s or self.timeout_s)
        except StepFailed as exc:  # by gRPC or on the socket: the same statuses
            if exc.code == "NOT_FOUND" and SESSION_UNKNOWN in exc.message:  # the daemon restarted since
                self._session.close()  # wait_ready opens a new session and registers our tensors again
                raise DaemonUnavailable(f"zend at {self.address} restarted and no longer knows this trainer's "
                                        f"session: call wait_ready(), then redo step {step} [UNAVAILABLE]") from None
            raise from_step_failed(exc, self.address) from None
        except grpc.RpcError as exc:  # a call around the step (a buffer grown by gRPC)
            raise from_rpc_error(exc, self.address) from None
        except SharedBufferError as exc:  # the input buffer (a bigger one when nnz grew) was refused
            raise from_buffer_error(exc, f"tensor {name!r}") from None
        finally:
            with self._lock:
                entry.in_flight = False
        entry.next_step = step + 1
        r = entry.handle.last_reply
        assert r is not None  # allreduce returned: the step's reply is in
        if r.node_count:  # the generation the step ran in: world_size follows a scale-in
            self.generation, self._session.node_count = r.generation, r.node_count
        entry.stats = r
        return self._as_output(out, kind, shape, tensor)

    def allreduce_many(self, tensors: Sequence[torch.Tensor], *, names: Sequence[str], average: bool = False,
                       timeout_s: float | None = None) -> list[torch.Tensor]:
        """The sums of several row-sparse COO tensors in one step per kind (tensor fusion, as Horovod's).

        A step costs the daemon a fixed 1-3 ms however small the tensor, and its commit two rounds;
        fused, 32 small tensors pay them once. Tensors of the same dtype and device are stacked into
        one tensor (rows offset one after another; a new one where their rows would reach 2**31) and
        synchronised in one step; the results are split back, in the order given. Tables of different
        row widths share the step as rows of the widths' common divisor where that is at least 64
        bytes and cuts no row into more than 4 (zen.fusion.batches; 256- and 64-wide float32 tables:
        rows of 64), else go in a step of their own. Every trainer of the job must pass the same
        names, in the same order, with the same shapes: the fused tensor is named after them.
        """
        if len(tensors) != len(names) or len(set(names)) != len(names):
            raise InvalidGradient(f"allreduce_many: {len(tensors)} tensors for {len(names)} names, which must be "
                                  "as many and distinct")
        for t, name in zip(tensors, names, strict=True):
            if not isinstance(t, torch.Tensor) or not t.is_sparse or t.sparse_dim() != 1:
                raise InvalidGradient(f"tensor {name!r}: allreduce_many takes row-sparse COO tensors (sparse_dim 1)")
        tables = [fused_rows.table_of(t) for t in tensors]
        out: list[torch.Tensor | None] = [None] * len(tensors)
        # the bound read now, not at import: benchmarks/many_tensors.py sets it to compare
        for batch in fusion.batches(tables, MAX_FUSED_ROWS, fusion.MIN_SHARED_ROW_BYTES):
            packed = fused_rows.pack(tensors, names, batch)
            rows, vals = self.allreduce((packed.indices, packed.values), name=packed.name, num_rows=packed.num_rows,
                                        average=average, timeout_s=timeout_s)
            members = [tensors[i] for i in batch.members]
            split = fused_rows.unpack(packed, rows, vals, [tuple(t.shape[1:]) for t in members])
            for i, t, (whole, mine) in zip(batch.members, members, split, strict=True):
                self._fused_into[names[i]] = packed.name
                checked = checked_rows(whole, t.shape[0], names[i])
                out[i] = torch.sparse_coo_tensor(checked.unsqueeze(0), mine, t.shape, is_coalesced=True,
                                                 check_invariants=False)  # rows: checked just above
        return [t for t in out if t is not None]

    def last_stats(self, name: str) -> StepStats | None:
        """The daemon's figures for tensor `name`'s last completed step (None before its first); for a
        tensor synchronised fused (allreduce_many), its fused step's."""
        entry = self._tensors.get(self._fused_into.get(name, name))
        return entry.stats if entry is not None else None

    def allreduce_async(self, tensor: torch.Tensor | Indexed, **kwargs: Any) -> torch.futures.Future[Any]:
        """Like allreduce, returning a torch Future (what DDP comm hooks return).

        CUDA tensors: the step starts once the caller's current stream has written them (an event recorded
        here, waited on by the worker thread), and the future completes once the result's copies on the
        worker's stream are done, so any stream of the caller may read it."""
        return self._on_worker(lambda: self.allreduce(tensor, **kwargs), _cuda_device_of(tensor))

    def allreduce_many_async(self, tensors: Sequence[torch.Tensor], *, names: Sequence[str], average: bool = False,
                             timeout_s: float | None = None) -> torch.futures.Future[list[torch.Tensor]]:
        """Like allreduce_many, returning a torch Future of the list (CUDA streams as in allreduce_async)."""
        device = next((d for d in map(_cuda_device_of, tensors) if d is not None), None)
        return self._on_worker(lambda: self.allreduce_many(tensors, names=names, average=average,
                                                           timeout_s=timeout_s), device)

    def _on_worker(self, call: Callable[[], Any], device: torch.device | None) -> torch.futures.Future[Any]:
        """`call()` on the client's worker threads, its result or error in the returned Future."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        written = None
        if device is not None:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(device))

        def run() -> None:
            try:
                if written is not None:
                    written.synchronize()
                out = call()
                if device is not None:
                    torch.cuda.current_stream(device).synchronize()
                future.set_result(out)
            except BaseException as exc:
                future.set_exception(exc)

        self._pool.submit(run)
        return future

    # ------------------------------------------------------------------ conversions
    def _as_grad(self, tensor: torch.Tensor | Indexed, name: str, num_rows: int | None,
                 topk: float | None) -> tuple[str, SparseGrad, tuple[int, ...]]:
        try:
            if isinstance(tensor, tuple):
                if len(tensor) != 2 or num_rows is None:
                    raise InvalidGradient(f"tensor {name!r}: an (indices, values) pair needs num_rows=")
                indices, values = tensor
                return "pair", SparseGrad(indices, values, num_rows, name).validate(), (num_rows, *values.shape[1:])
            if not isinstance(tensor, torch.Tensor):
                raise InvalidGradient(f"tensor {name!r}: expected a torch.Tensor or (indices, values), "
                                      f"got {type(tensor).__name__}")
            shape = tuple(tensor.shape)
            if tensor.is_sparse:
                if tensor.sparse_dim() != 1:
                    raise InvalidGradient(f"tensor {name!r}: sparse_dim {tensor.sparse_dim()}; zen takes row-sparse "
                                          "COO tensors (sparse_dim 1, as nn.Embedding(sparse=True) makes)")
                return "sparse", from_torch_sparse(tensor, name).validate(), shape
            if topk is not None:
                compressor = self._topk.setdefault(topk, TopKCompressor(topk))
                return "topk", compressor.compress(name, tensor).validate(), (tensor.numel(),)
            if tensor.dim() == 0:
                tensor = tensor.reshape(1)
            rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)
            grad = SparseGrad(torch.arange(rows.shape[0], device=tensor.device), rows, rows.shape[0], name, True)
            return "dense", grad.validate(), tuple(rows.shape)
        except SparseGradError as exc:
            raise InvalidGradient(str(exc)) from None

    def _entry(self, name: str, kind: str, grad: SparseGrad, shape: tuple[int, ...], average: bool) -> _Tensor:
        entry = self._tensors.get(name)
        if entry is None:
            device = "cpu" if grad.device.type == "cpu" else str(grad.device)
            try:
                handle = self._session.register(name, shape, grad.dtype, dense=kind == "dense", average=average,
                                             device=device)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, self.address) from None
            except SharedBufferError as exc:  # its result buffer was refused
                raise from_buffer_error(exc, f"tensor {name!r}") from None
            # a tensor the job already stepped (every trainer restarted on live daemons) goes on where it is
            entry = self._tensors[name] = _Tensor(handle, kind, shape, next_step=handle.next_step)
        elif entry.kind != kind or entry.shape != shape or entry.handle.spec.dtype != grad.dtype:
            raise InvalidGradient(f"tensor {name!r} was first synchronised as {entry.kind} {list(entry.shape)} "
                                  f"{entry.handle.spec.dtype_name}, now as {kind} {list(shape)} {grad.dtype}")
        return entry

    @staticmethod
    def _as_output(out: SparseGrad, kind: str, shape: tuple[int, ...], original: Any) -> Any:
        device = original[1].device if isinstance(original, tuple) else original.device
        if kind == "pair":
            return out.indices.to(device), out.values.to(device)
        if kind == "sparse":
            rows = checked_rows(out.indices, shape[0], out.name)
            return torch.sparse_coo_tensor(rows.unsqueeze(0).to(device), out.values.to(device), shape,
                                           is_coalesced=True, check_invariants=False)  # coalesced by the daemon
        if kind == "topk":  # to_dense writes at every row: checked first
            checked_rows(out.indices, out.num_rows, out.name)
            return out.to_dense().reshape(original.shape).to(device)
        return out.values.reshape(original.shape).to(device)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._session.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
