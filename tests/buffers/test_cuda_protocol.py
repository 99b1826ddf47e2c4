"""The CUDA buffer protocol and its error paths, in CI: torch.cuda's few touchpoints replaced by fakes.

zend/buffers/cuda.py keeps its calls into torch.cuda in five small functions (`_allocate`, `_share`,
`_rebuild`, `_order`, `_release`); here they are CPU fakes, so that export and open, publish, the
refusals (expandable segments, out of memory, a bad handle) and the buffer server's handling of them
run without a GPU. What only a GPU can show (real IPC between processes, stream order on the device)
is in tests/gpu, run by scripts/gpu_checks.sh on a lent machine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.buffers.trainer import token_of
from zend.buffers import BufferClient, BufferServer, CudaBuffer, ProtocolError, SessionInfo, SharedBufferError
from zend.buffers import cuda as cuda_buffers

pytestmark = pytest.mark.inprocess


class FakeCuda:
    """CPU stand-ins for the GPU: allocations are CPU tensors, an IPC handle is a key into a table of them."""

    def __init__(self) -> None:
        self.memory: dict[bytes, torch.Tensor] = {}
        self.ordered: list[str] = []
        self.released = 0
        self.share_error: str | None = None
        self.out_of_memory = False
        self.allocated_on: list[torch.device] = []

    def allocate(self, nbytes: int, dev: torch.device) -> tuple[torch.Tensor, Any]:
        if self.out_of_memory:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
        self.allocated_on.append(dev)
        return torch.zeros(nbytes, dtype=torch.uint8), object()

    def share(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        if self.share_error is not None:
            raise RuntimeError(self.share_error)
        handle = f"h{len(self.memory)}".encode()
        self.memory[handle] = tensor
        return (0, handle, tensor.numel(), 0, b"ref", 0, None, False)

    def rebuild(self, nbytes: int, device_index: int, handle: bytes | None, *rest: Any) -> torch.Tensor:
        if handle not in self.memory:
            raise RuntimeError("cudaIpcOpenMemHandle failed: invalid argument")
        return self.memory[handle][:nbytes]

    def order(self, device: torch.device) -> None:
        self.ordered.append(str(device))

    def release(self) -> None:
        self.released += 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    f = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("allocate", "share", "rebuild", "order", "release"):
        monkeypatch.setattr(cuda_buffers, f"_{name}", getattr(f, name))
    return f


def test_a_buffer_exported_by_the_daemon_opens_in_the_trainer_and_publishing_orders_the_writers_stream(
        fake: FakeCuda) -> None:
    daemon_side = CudaBuffer.create(64, "b1", "cuda:1")
    assert fake.allocated_on == [torch.device("cuda", 1)]
    handle = daemon_side.export()
    assert handle is not daemon_side.export() and handle == daemon_side.export()  # exported once, copied out
    trainer_side = CudaBuffer.open(handle)
    trainer_side.view(torch.float32, 0, 2).copy_(torch.tensor([1.5, 2.5]))
    trainer_side.publish()
    assert fake.ordered == ["cuda:1"]  # the trainer's current stream on the buffer's device
    assert daemon_side.view(torch.float32, 0, 2).tolist() == [1.5, 2.5]
    with pytest.raises(SharedBufferError, match="only its creator exports it"):
        trainer_side.export()
    trainer_side.close()
    daemon_side.close()
    assert fake.released == 1  # the owner's close returns the memory (ipc_collect, empty_cache)


def test_an_export_that_torch_refuses_is_this_buffers_error_naming_expandable_segments(fake: FakeCuda) -> None:
    fake.share_error = "pidfd_getfd: expandable segments cannot be shared"
    buf = CudaBuffer.create(64, "b2", "cuda:0")
    with pytest.raises(SharedBufferError, match=r"buffer 'b2' on cuda:0: cannot export its CUDA IPC handle: "
                                                r"pidfd_getfd.*expandable_segments:True"):
        buf.export()


def test_out_of_gpu_memory_is_resource_exhausted_naming_the_size(fake: FakeCuda) -> None:
    fake.out_of_memory = True
    with pytest.raises(SharedBufferError, match=r"cuda:0 is out of memory for 4096 bytes") as refused:
        CudaBuffer.create(4096, "b3", "cuda:0")
    assert refused.value.code == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize(("change", "error"), [
    ({"nbytes": "64"}, "field 'nbytes' must be int"),
    ({"handle": "not base64!"}, "field 'handle' is not base64"),
    ({"storage_size_bytes": 8}, "do not describe a buffer"),
    ({"device": "cuda:7"}, "device 'cuda:7' is absent here"),
    ({"device": "cpu"}, "is not 'cuda:N'"),
])
def test_a_bad_handle_is_refused_naming_the_field(fake: FakeCuda, change: dict[str, Any], error: str) -> None:
    handle = {**CudaBuffer.create(64, "b4", "cuda:0").export(), **change}
    with pytest.raises((ProtocolError, SharedBufferError), match=error):
        CudaBuffer.open(handle)


def test_a_handle_that_cuda_cannot_open_is_a_buffer_error(fake: FakeCuda) -> None:
    handle = CudaBuffer.create(64, "b5", "cuda:0").export()
    import base64

    handle["handle"] = base64.b64encode(b"nobody's").decode()
    with pytest.raises(SharedBufferError, match="cannot open its CUDA IPC handle on cuda:0: cudaIpcOpenMemHandle"):
        CudaBuffer.open(handle)


def test_the_daemon_turns_expandable_segments_off(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", set_to.append, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    assert cuda_buffers.no_expandable_segments() and set_to == ["expandable_segments:False"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert not cuda_buffers.no_expandable_segments() and set_to == ["expandable_segments:False"]


def test_a_private_pool_is_made_on_the_buffers_device_even_where_mempool_takes_no_no_split(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[Any, dict[str, Any]]] = []
    current: list[Any] = [None]

    class OldMemPool:  # torch before MemPool(no_split=...)
        def __init__(self, **kwargs: Any) -> None:
            if kwargs:
                raise TypeError(f"MemPool() got unexpected keyword arguments {sorted(kwargs)}")
            made.append((current[0], kwargs))

    @contextlib.contextmanager
    def on(dev: Any) -> Iterator[None]:
        current[0] = dev
        try:
            yield
        finally:
            current[0] = None

    monkeypatch.setattr(torch.cuda, "MemPool", OldMemPool, raising=False)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool, device: contextlib.nullcontext(), raising=False)
    monkeypatch.setattr(torch.cuda, "device", on)
    pool = cuda_buffers._private_pool(torch.device("cuda", 1))
    assert isinstance(pool, OldMemPool) and made == [(torch.device("cuda", 1), {})]


# ---------------------------------------------------------------------------------------- through the server
@pytest.fixture
def server(fake: FakeCuda, tmp_path: Path) -> Iterator[BufferServer]:
    s = BufferServer(str(tmp_path / "b.sock"), lambda sid, tok: SessionInfo(sid, "job") if tok == token_of(sid)
                     else None, cuda_pool=True)
    s.start()
    try:
        yield s
    finally:
        s.close()


def test_a_refused_export_or_allocation_leaves_the_trainers_session_alive(fake: FakeCuda, server: BufferServer) -> None:
    with BufferClient(server.path, "alice", token_of("alice")) as client:
        fake.share_error = "expandable segments cannot be shared"
        with pytest.raises(SharedBufferError, match="cannot export its CUDA IPC handle"):
            client.alloc(1024, "cuda:0")
        fake.share_error, fake.out_of_memory = None, True
        with pytest.raises(SharedBufferError, match="out of memory for 2048 bytes"):
            client.alloc(2048, "cuda:0")
        fake.out_of_memory = False
        buf = client.alloc(4096, "cuda:0")  # the same session, on
        assert isinstance(buf, CudaBuffer) and buf.nbytes == 4096 and server.pool_bytes == 4096
        buf.view(torch.float32, 0, 1).fill_(7.0)
        buf.publish()
        assert server.get("alice", buf.buffer_id).view(torch.float32, 0, 1).item() == 7.0
        assert client.alloc(64, "cpu").nbytes == 64
    deadline = threading.Event()
    for _ in range(100):
        if server.pool_bytes == 0:
            break
        deadline.wait(0.05)
    assert server.pool_bytes == 0
