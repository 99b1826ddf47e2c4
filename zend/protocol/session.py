"""A trainer's session with its node's daemon: the protocol, from the trainer's side.

Open a session over gRPC, claim it on the buffer socket, register tensors, and for each step
write the gradient into a shared buffer and Submit a reference to it. The full client API with
PyTorch integration (`client/zen`) is built on this; tests, benchmarks and `zend cluster` use
it directly.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.buffers import BufferClient
from zend.core import dtypes
from zend.core.sparse import SparseGrad
from zend.protocol import paths
from zend.protocol.enums import DTYPE_TO_PROTO, LAYOUT_TO_PROTO
from zend.protocol.layout import TensorSpec


@dataclass
class TensorHandle:
    tensor_id: int
    spec: TensorSpec
    device: str = "cpu"
    input: Any = None   # SharedBuffer, grown as needed
    result: Any = None  # SharedBuffer sized for the worst case (pages are only used when written)
    last_reply: Any = None  # this tensor's last SubmitReply (bytes, scheme, phases)


class TrainerSession:
    def __init__(self, socket_dir: str, job: str, token: str, local_rank: int = 0, local_world_size: int = 1,
                 timeout_s: float = 60.0):
        self.job, self.timeout_s = job, timeout_s
        self.address = paths.grpc_address(socket_dir)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.TrainerStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        reply = self.stub.OpenSession(pb.OpenSessionRequest(job_id=job, local_rank=local_rank,
                                                            local_world_size=local_world_size, pid=os.getpid()),
                                      timeout=timeout_s, metadata=self.metadata, wait_for_ready=True)
        self.session_id = reply.session_id
        self.node_rank, self.node_count = reply.node_rank, reply.node_count
        self.buffers = BufferClient(reply.buffer_socket, self.session_id, timeout_s=timeout_s)

    def register(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, dense: bool = False,
                 average: bool = False, device: str = "cpu") -> TensorHandle:
        """Buffers on `device`: "cpu" (shared memory) or "cuda:N" (daemon-owned GPU memory, CUDA IPC)."""
        layout = "dense" if dense else "sparse_rows"
        dtype_name = dtypes.BY_TORCH[dtype].name
        reply = self.stub.RegisterTensor(pb.RegisterTensorRequest(
            session_id=self.session_id, name=name, shape=list(shape), dtype=DTYPE_TO_PROTO[dtype_name],
            layout=LAYOUT_TO_PROTO[layout], average=average), timeout=self.timeout_s, metadata=self.metadata)
        spec = TensorSpec(self.job, name, tuple(shape), dtype_name, layout, average)
        return TensorHandle(reply.tensor_id, spec, device, result=self.buffers.alloc(reply.max_result_bytes, device))

    def _input_buffer(self, handle: TensorHandle, nbytes: int) -> Any:
        if handle.input is None or handle.input.nbytes < nbytes:
            if handle.input is not None:
                self.buffers.free(handle.input.buffer_id)
            size = max(nbytes, 2 * (handle.input.nbytes if handle.input else 0), 4096)
            handle.input = self.buffers.alloc(size, handle.device)
        return handle.input

    def allreduce(self, handle: TensorHandle, grad: SparseGrad, step: int,
                  timeout_s: float | None = None, copy: bool = True) -> SparseGrad:
        """Sum `grad` over every trainer of the job; returns the (coalesced) result.

        With `copy` (the default) the values are a copy the caller owns; without, they are a view
        of the shared result buffer, valid until the next `allreduce` of this tensor.
        """
        spec = handle.spec
        buf = self._input_buffer(handle, spec.nbytes(grad.nnz))
        spec.write(grad, buf.view, 0)
        reply = self.stub.Submit(pb.SubmitRequest(
            session_id=self.session_id, tensor_id=handle.tensor_id, step=step,
            input=pb.BufferRef(buffer_id=buf.buffer_id, offset=0), nnz=grad.nnz,
            result=pb.BufferRef(buffer_id=handle.result.buffer_id, offset=0)),
            timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        handle.last_reply = reply
        out = spec.read(handle.result.view, 0, reply.nnz, check=False)  # the daemon's own output
        # read() copied the indices; the values are a view of the result buffer unless copied here
        return out if not copy else out.with_values(out.values.clone())

    def close(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # the daemon may be gone; the buffer socket closing ends it too
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=5.0,
                                   metadata=self.metadata)
        self.buffers.close()
        self.channel.close()

    def __enter__(self) -> TrainerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
