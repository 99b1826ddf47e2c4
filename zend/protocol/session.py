"""A trainer's session with its node's daemon: the protocol, from the trainer's side.

Open a session over gRPC, claim it on the buffer socket (its id and the job token), register
tensors, and for each step write the gradient into a shared buffer and Submit a reference to it.
The full client API with PyTorch integration (`client/zen`) is built on this; tests, benchmarks
and `zend cluster` use it directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.buffers import fenced
from zend.buffers.buffer_client import BufferClient
from zend.buffers.shared import SharedBufferError  # also the client's: a buffer the daemon refused
from zend.core import dtypes
from zend.core.sparse import SparseGrad
from zend.protocol import paths
from zend.protocol.checkpoint import SEGMENT_OP
from zend.protocol.enums import DTYPE_TO_PROTO, LAYOUT_TO_PROTO
from zend.protocol.layout import TensorSpec
from zend.protocol.step import BufferRef, StepFailed, StepRequest, StepResult

log = logging.getLogger("zend.session")


@dataclass
class TensorHandle:
    tensor_id: int
    spec: TensorSpec
    device: str = "cpu"
    input: Any = None   # SharedBuffer, grown as needed
    result: Any = None  # SharedBuffer sized for the worst case (pages are only used when written)
    last_reply: StepResult | None = None  # this tensor's last step
    next_step: int = 0  # where the daemon said the tensor was when it was registered (0: new to the job)


class TrainerSession:
    """`steps_on_socket` (the default): steps go to the daemon on the buffer socket, one extra
    connection per submitting thread; off, or with a daemon that does not serve them, by the
    gRPC Submit (the same step, 0.5-1 ms more of CPU on each side)."""

    def __init__(self, socket_dir: str, job: str, token: str, local_rank: int = 0, local_world_size: int = 1,
                 timeout_s: float = 60.0, steps_on_socket: bool = True):
        self.job, self.timeout_s = job, timeout_s
        self.closed = False
        self.steps_on_socket = steps_on_socket
        self._step_links = threading.local()
        self._step_clients: list[BufferClient] = []
        self._step_lock = threading.Lock()
        self.address = paths.grpc_address(socket_dir)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.TrainerStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self._token = token  # claims the session on the buffer socket, with its id
        try:
            reply = self.stub.OpenSession(pb.OpenSessionRequest(job_id=job, local_rank=local_rank,
                                                                local_world_size=local_world_size, pid=os.getpid()),
                                          timeout=timeout_s, metadata=self.metadata, wait_for_ready=True)
        except BaseException:
            self.channel.close()  # a client retrying (wait_ready) must not pile up channels
            raise
        self.session_id = reply.session_id
        self.node_rank, self.node_count, self.generation = reply.node_rank, reply.node_count, reply.generation
        self.job_step = reply.job_step  # the step the job is at (a restarted trainer resumes there)
        self.buffer_socket = reply.buffer_socket
        self.buffers = BufferClient(reply.buffer_socket, self.session_id, token, timeout_s=timeout_s)

    def register(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, dense: bool = False,
                 average: bool = False, device: str = "cpu") -> TensorHandle:
        """Buffers on `device`: "cpu" (shared memory) or "cuda:N" (daemon-owned GPU memory, CUDA IPC)."""
        if device == "cpu" and fenced.enabled():  # tests: shared memory that behaves like a device's
            device = fenced.DEVICE
        layout = "dense" if dense else "sparse_rows"
        dtype_name = dtypes.BY_TORCH[dtype].name
        reply = self.stub.RegisterTensor(pb.RegisterTensorRequest(
            session_id=self.session_id, name=name, shape=list(shape), dtype=DTYPE_TO_PROTO[dtype_name],
            layout=LAYOUT_TO_PROTO[layout], average=average), timeout=self.timeout_s, metadata=self.metadata)
        spec = TensorSpec(self.job, name, tuple(shape), dtype_name, layout, average)
        return TensorHandle(reply.tensor_id, spec, device, result=self.buffers.alloc(reply.max_result_bytes, device),
                            next_step=reply.next_step)

    def ready(self, timeout_s: float) -> Any:
        """The daemon's ReadyReply once the node's membership is whole, or after timeout_s (ready false)."""
        return self.stub.Ready(pb.ReadyRequest(session_id=self.session_id, timeout_seconds=timeout_s),
                               timeout=timeout_s + 5.0, metadata=self.metadata)

    def register_again(self, handle: TensorHandle) -> TensorHandle:
        """`handle`'s tensor registered in this session (a new session after its daemon restarted)."""
        spec = handle.spec
        return self.register(spec.name, spec.shape, dtypes.BY_NAME[spec.dtype_name].torch, dense=spec.layout == "dense",
                             average=spec.average, device=handle.device)

    def _input_buffer(self, handle: TensorHandle, nbytes: int) -> Any:
        if handle.input is None or handle.input.nbytes < nbytes:
            if handle.input is not None:
                self.buffers.free(handle.input.buffer_id)
            size = max(nbytes, 2 * (handle.input.nbytes if handle.input else 0), 4096)
            handle.input = self.buffers.alloc(size, handle.device)
        return handle.input

    def allreduce(self, handle: TensorHandle, grad: SparseGrad, step: int,
                  timeout_s: float | None = None, copy: bool = True) -> SparseGrad:
        """Sum `grad` over every trainer of the job; returns the (coalesced) result. StepFailed (its status
        name and the daemon's words) if the step did not produce one.

        With `copy` (the default) the values are a copy the caller owns; without, they are a view
        of the shared result buffer, valid until the next `allreduce` of this tensor.
        """
        spec = handle.spec
        buf = self._input_buffer(handle, spec.nbytes(grad.nnz))
        spec.write(grad, buf.view, 0)
        buf.publish()  # written before the daemon reads it (a GPU buffer: our stream has run the copies)
        reply = handle.last_reply = self.submit(handle, step, buf.buffer_id, grad.nnz, timeout_s or self.timeout_s)
        handle.result.acquire()
        out = spec.read(handle.result.view, 0, reply.nnz, check=False)  # the daemon's own output
        # read() copied the indices; the values are a view of the result buffer unless copied here
        return out if not copy else out.with_values(out.values.clone())

    def submit(self, handle: TensorHandle, step: int, input_buffer: str, nnz: int, timeout_s: float) -> StepResult:
        """Run step `step` of the tensor on `nnz` rows in `input_buffer`; the result lands in the handle's
        result buffer. StepFailed, whichever way it went, if the daemon did not produce one."""
        request = StepRequest(handle.tensor_id, step, BufferRef(input_buffer), nnz, BufferRef(handle.result.buffer_id),
                              timeout_s)
        link = self._step_link() if self.steps_on_socket else None
        if link is not None:
            try:
                body = link.call(request.to_wire(), timeout_s)  # as with gRPC, the deadline is the caller's
            except TimeoutError as exc:
                raise StepFailed("DEADLINE_EXCEEDED", f"step {step}: no answer in {timeout_s:g} s: {exc}") from None
            except (ConnectionError, OSError) as exc:
                raise StepFailed("UNAVAILABLE", f"step {step}: {exc}") from None
            if body.get("ok") is not True:
                raise StepFailed(str(body.get("code", "UNKNOWN")), str(body.get("error", "step refused")))
            return StepResult.from_wire(body, step)
        try:
            reply = self.stub.Submit(request.to_proto(self.session_id), timeout=timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise StepFailed(exc.code().name, exc.details() or str(exc)) from None
        return StepResult.from_proto(reply, step)

    # ------------------------------------------------------------------ in-memory checkpoints
    def put_checkpoint(self, step: int, buffer_id: str, objects: list[tuple[str, int, int]], rank: int,
                       world_size: int, coordinator: bool, done: bool) -> int:
        """Hand the daemon `objects` ((key, offset, length) in `buffer_id`) of checkpoint `step`; the bytes
        the job's checkpoints hold on this node after it. grpc.RpcError as the daemon answers."""
        reply = self.stub.PutCheckpoint(pb.PutCheckpointRequest(
            session_id=self.session_id, step=step, buffer_id=buffer_id,
            objects=[pb.CheckpointObject(key=k, offset=o, length=n) for k, o, n in objects], rank=rank,
            world_size=world_size, coordinator=coordinator, done=done), timeout=self.timeout_s, metadata=self.metadata)
        return int(reply.job_bytes)

    def list_checkpoints(self) -> list[Any]:
        """The job's checkpoints on this node (CheckpointInfo: complete first, newest first)."""
        reply = self.stub.ListCheckpoints(pb.ListCheckpointsRequest(session_id=self.session_id),
                                          timeout=self.timeout_s, metadata=self.metadata)
        return list(reply.checkpoints)

    def read_checkpoint(self, step: int, buffer_id: str, objects: list[tuple[str, int, int]]) -> None:
        """Copy `objects` ((key, offset, length)) of complete checkpoint `step` into `buffer_id`."""
        self.stub.ReadCheckpoint(pb.ReadCheckpointRequest(
            session_id=self.session_id, step=step, buffer_id=buffer_id,
            objects=[pb.CheckpointObject(key=k, offset=o, length=n) for k, o, n in objects]),
            timeout=self.timeout_s, metadata=self.metadata)

    def locate_checkpoint(self, step: int, keys: list[str]) -> list[Any]:
        """Where objects of complete checkpoint `step` lie in the daemon's read-only segments (CheckpointPlace)."""
        reply = self.stub.ReadCheckpoint(pb.ReadCheckpointRequest(
            session_id=self.session_id, step=step, locate=True,
            objects=[pb.CheckpointObject(key=k) for k in keys]), timeout=self.timeout_s, metadata=self.metadata)
        return list(reply.places)

    def map_checkpoint_segment(self, step: int, segment: str) -> Any:
        """A read-only SharedBuffer over segment `segment` of checkpoint `step` (close it when done)."""
        return self.buffers.map_readonly({"op": SEGMENT_OP, "step": step, "segment": segment}, f"ckpt-{segment}",
                                         self.timeout_s)

    def _step_link(self) -> BufferClient | None:
        """This thread's step connection (made on first use); None once the daemon refused one."""
        link = getattr(self._step_links, "link", None)
        if link is None or link.closed:
            try:
                link = BufferClient(self.buffer_socket, self.session_id, self._token, timeout_s=self.timeout_s,
                                    attach=True)
            except SharedBufferError as exc:  # an older daemon, or steps not served: gRPC from now on
                self.steps_on_socket = False
                log.info("steps by gRPC Submit: the daemon refused a step connection: %s", exc)
                return None
            self._step_links.link = link
            with self._step_lock:
                self._step_clients.append(link)
        return link

    def close(self) -> None:
        """Idempotent; after it `closed` is true (a client then opens a new session)."""
        if self.closed:
            return
        self.closed = True
        with self._step_lock:
            links, self._step_clients = self._step_clients, []
        for link in links:
            link.close()
        with contextlib.suppress(grpc.RpcError):  # the daemon may be gone; the buffer socket closing ends it too
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=5.0,
                                   metadata=self.metadata)
        self.buffers.close()
        self.channel.close()

    def __enter__(self) -> TrainerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
