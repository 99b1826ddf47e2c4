"""GPU buffers: daemon-owned CUDA memory that a trainer on the same node opens by CUDA IPC handle.

The daemon allocates the buffer (``torch.empty`` of bytes) and exports it with torch's own
storage sharing (``untyped_storage()._share_cuda_()``, what ``torch.multiprocessing`` uses); the
handle travels as a JSON-able dict (bytes as base64) and the trainer rebuilds the tensor with
``rebuild_cuda_tensor``. Only daemon -> trainer: the trainer trusts its daemon, and the daemon
never unpickles or opens anything a trainer sends.

Isolation: a CUDA IPC handle opens the whole allocation it points into, not just one tensor.
Each buffer is therefore allocated in a private ``torch.cuda.MemPool`` so its allocation holds
nothing else (no other session's buffer, no daemon working tensor), and it is zeroed before it
is handed out, so a new tenant never reads an old one's gradients.

Lifetime (torch's rule, kept): after the daemon frees a buffer, torch keeps the memory until the
trainer has released its mapping (closed the buffer or exited); then the daemon returns it to the
driver (``empty_cache``: a private pool's blocks would otherwise stay cached). If the trainer is
killed with a signal it never releases it, and that memory stays reserved in the daemon until the
daemon exits; ``pool_bytes`` no longer counts it. Device numbers ("cuda:N") are the daemon's: a
trainer must see the same numbering (the same CUDA_VISIBLE_DEVICES). CUDA is initialised only
when a CUDA buffer is made or opened: CPU-only installs never touch it.

Stream order: writes to a buffer are queued on the writer's CUDA stream, which the other process
does not wait on. So the writer publishes before every hand-off (`publish`: its current stream
synchronised), the trainer before it submits a step, the daemon before it answers with a result.
(An interprocess CUDA event per buffer would let the reader wait on the device instead of the
writer on the host: which is cheaper is to be measured on a GPU.)

torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) cannot be exported
by IPC: the daemon turns them off for its own allocations (`no_expandable_segments`), and any export
failure is a per-buffer SharedBufferError, never the session's end.

The few calls into torch.cuda live in small functions (`_allocate`, `_share`, `_rebuild`, `_order`,
`_release`) so that the protocol and its error paths run in CI against fakes of them.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from typing import Any, Self

import torch

from zend.buffers.shared import RESOURCE_EXHAUSTED, SharedBuffer, SharedBufferError, check_view_range
from zend.buffers.wire import ProtocolError

log = logging.getLogger("zend.buffers")

_CUDA_DEVICE = re.compile(r"cuda:([0-9]+)")


class CudaBuffer(SharedBuffer):
    """A buffer in GPU memory with the interface of :class:`SharedBuffer`; ``view`` returns CUDA tensors.

    The daemon makes one with :meth:`create` and hands :meth:`export` to the trainer, which
    calls :meth:`open`. There is no file descriptor: :meth:`fileno` and :meth:`attach` refuse.
    """

    def __init__(self, buffer_id: str, tensor: torch.Tensor, pool: Any, *, owner: bool, device: torch.device) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        super().__init__(buffer_id, tensor.numel(), -1, None)
        self.device = str(device)
        self._device = device
        self._tensor: torch.Tensor | None = tensor
        self._pool = pool  # the private MemPool the allocation lives in, held as long as the buffer
        self._owner = owner
        self._handle: dict[str, Any] | None = None

    @classmethod
    def create(cls, nbytes: int, buffer_id: str, device: str = "cuda:0") -> Self:
        """A new zero-filled buffer of ``nbytes`` bytes on ``device`` ("cuda:N"), alone in its allocation.
        Out of GPU memory is a SharedBufferError with code RESOURCE_EXHAUSTED naming the size."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise SharedBufferError(f"buffer {buffer_id!r}: nbytes must be an integer >= 1, got {nbytes!r}")
        dev = _cuda_device(device, buffer_id)
        try:
            tensor, pool = _allocate(nbytes, dev)
        except torch.OutOfMemoryError as exc:
            raise SharedBufferError(f"buffer {buffer_id!r}: {device} is out of memory for {nbytes} bytes: "
                                    f"{str(exc).splitlines()[0]}", RESOURCE_EXHAUSTED) from exc
        except RuntimeError as exc:
            raise SharedBufferError(f"buffer {buffer_id!r}: cannot allocate {nbytes} bytes on {device}: "
                                    f"{str(exc).splitlines()[0]}") from exc
        return cls(buffer_id, tensor, pool, owner=True, device=dev)

    @classmethod
    def attach(cls, fd: int, nbytes: int, buffer_id: str) -> Self:
        raise SharedBufferError(f"buffer {buffer_id!r}: CUDA buffers travel as IPC handles, not fd {fd}; "
                                "use CudaBuffer.open")

    @classmethod
    def open(cls, handle: dict[str, Any]) -> Self:
        """The trainer side of a buffer from the daemon's :meth:`export` dict.

        Raises:
            ProtocolError: a field is missing or has the wrong type.
            SharedBufferError: the device is absent here or CUDA cannot open the handle.
        """
        if not isinstance(handle, dict):
            raise ProtocolError(f"cuda_ipc handle must be an object, got {type(handle).__name__}")
        buffer_id = _get(handle, "buffer", str)
        nbytes = _get(handle, "nbytes", int)
        device = _get(handle, "device", str)
        dev = _cuda_device(device, buffer_id)
        storage_size = _get(handle, "storage_size_bytes", int)
        storage_offset = _get(handle, "storage_offset_bytes", int)
        if nbytes < 1 or storage_size < nbytes or storage_offset < 0:
            raise ProtocolError(f"cuda_ipc handle of buffer {buffer_id!r}: nbytes={nbytes}, "
                                f"storage_size_bytes={storage_size}, storage_offset_bytes={storage_offset} "
                                "do not describe a buffer")
        try:
            tensor = _rebuild(
                nbytes, dev.index, _get_bytes(handle, "handle"), storage_size, storage_offset,
                _get_bytes(handle, "ref_counter_handle"), _get(handle, "ref_counter_offset", int),
                _get_bytes(handle, "event_handle", optional=True), _get(handle, "event_sync_required", bool),
            )
        except RuntimeError as exc:
            raise SharedBufferError(f"buffer {buffer_id!r}: cannot open its CUDA IPC handle on {device}: "
                                    f"{str(exc).splitlines()[0]}") from exc
        return cls(buffer_id, tensor, None, owner=False, device=dev)

    def export(self) -> dict[str, Any]:
        """The JSON-able CUDA IPC handle for :meth:`open` in one trainer process.

        Exported once per buffer (the same dict on every call): torch counts one reference per
        export, and the one process that opens it gives that reference back when it closes.
        """
        with self._lock:
            tensor = self._live()
            if not self._owner:
                raise SharedBufferError(f"buffer {self.buffer_id!r} was opened from a handle; only its creator "
                                        "exports it")
            if self._handle is None:
                try:
                    (_, handle, storage_size, storage_offset, ref_handle, ref_offset, event_handle,
                     event_sync) = _share(tensor)
                except RuntimeError as exc:  # expandable segments, a driver refusal: this buffer, not the session
                    raise SharedBufferError(f"buffer {self.buffer_id!r} on {self.device}: cannot export its CUDA "
                                            f"IPC handle: {str(exc).splitlines()[0]} (with PYTORCH_CUDA_ALLOC_CONF="
                                            "expandable_segments:True in the daemon, torch cannot share its "
                                            "memory: unset it for zend)") from exc
                self._handle = {
                    "buffer": self.buffer_id, "nbytes": self.nbytes, "device": self.device,
                    "handle": _b64(handle), "storage_size_bytes": int(storage_size),
                    "storage_offset_bytes": int(storage_offset), "ref_counter_handle": _b64(ref_handle),
                    "ref_counter_offset": int(ref_offset),
                    "event_handle": None if event_handle is None else _b64(event_handle),
                    "event_sync_required": bool(event_sync),
                }
            return dict(self._handle)

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def publish(self) -> None:
        """This side's queued writes done before the buffer is handed over: the current stream synchronised
        (the other process runs on streams of its own and would read what is not written yet)."""
        with self._lock:
            self._live()
        _order(self._device)

    def fileno(self) -> int:
        raise SharedBufferError(f"buffer {self.buffer_id!r} on {self.device} has no file descriptor: "
                                "it travels as a CUDA IPC handle (export/open)")

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        """A 1-D zero-copy CUDA tensor over bytes ``[offset, offset + count * itemsize)``."""
        nbytes = check_view_range(self, dtype, offset, count)
        with self._lock:
            tensor = self._live()
            return tensor[offset:offset + nbytes].view(dtype)

    def close(self) -> None:
        """Drop this side's reference; idempotent. Views keep the memory until they are dropped."""
        with self._lock:
            if self._tensor is None:
                return
            self._tensor = None
            self._pool = None
        if self._owner:
            try:
                _release()
            except RuntimeError as exc:
                log.warning("buffer %s: returning its memory failed: %s", self.buffer_id, exc)

    def _live(self) -> torch.Tensor:
        if self._tensor is None:
            raise SharedBufferError(f"buffer {self.buffer_id!r} is closed")
        return self._tensor


def _cuda_device(device: str, buffer_id: str) -> torch.device:
    match = _CUDA_DEVICE.fullmatch(device) if isinstance(device, str) else None
    if match is None:
        raise SharedBufferError(f"buffer {buffer_id!r}: device {device!r} is not 'cuda:N'")
    index = int(match.group(1))
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= available:
        raise SharedBufferError(f"buffer {buffer_id!r}: device {device!r} is absent here "
                                f"({available} CUDA devices)")
    return torch.device("cuda", index)


def no_expandable_segments() -> bool:
    """Turn torch's expandable segments off in this process (the daemon, before its first CUDA buffer):
    their memory cannot be exported by CUDA IPC. True if they had been asked for."""
    wanted = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if wanted:
        setting = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if setting is not None:
            setting("expandable_segments:False")
        log.warning("PYTORCH_CUDA_ALLOC_CONF asks for expandable_segments: turned off in zend, whose CUDA buffers "
                    "are shared by IPC (trainers may keep them)")
    return wanted


def _private_pool(dev: torch.device) -> Any:
    """A fresh MemPool on `dev` that never splits its segments (an older torch: one that may; none: None)."""
    pool_cls = getattr(torch.cuda, "MemPool", None)
    if pool_cls is None or not hasattr(torch.cuda, "use_mem_pool"):
        log.warning("torch %s has no torch.cuda.MemPool: CUDA buffers share allocations with other tensors",
                    torch.__version__)
        return None
    with torch.cuda.device(dev):
        try:
            return pool_cls(no_split=True)
        except TypeError:  # a torch whose MemPool takes no no_split: the buffer is still its pool's only tensor
            return pool_cls()


def _allocate(nbytes: int, dev: torch.device) -> tuple[torch.Tensor, Any]:
    """`nbytes` zeroed bytes on `dev`, alone in a private pool (and the pool)."""
    pool = _private_pool(dev)
    if pool is None:
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    else:
        with torch.cuda.use_mem_pool(pool, device=dev):
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    tensor.zero_()
    torch.cuda.synchronize(dev)
    return tensor, pool


def _share(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tuple(tensor.untyped_storage()._share_cuda_())


def _rebuild(nbytes: int, device_index: int, handle: bytes | None, storage_size: int, storage_offset: int,
             ref_handle: bytes | None, ref_offset: int, event_handle: bytes | None, event_sync: bool) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, (nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, device_index,
                               handle, storage_size, storage_offset, False, ref_handle, ref_offset, event_handle,
                               event_sync)


def _order(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def _release() -> None:
    torch.cuda.ipc_collect()  # blocks whose trainers have let go
    torch.cuda.empty_cache()  # and back to the driver: a freed private pool's blocks stay cached otherwise


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _get(handle: dict[str, Any], name: str, kind: type) -> Any:
    if name not in handle:
        raise ProtocolError(f"cuda_ipc handle: missing field {name!r}")
    value = handle[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"cuda_ipc handle: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _get_bytes(handle: dict[str, Any], name: str, *, optional: bool = False) -> bytes | None:
    if optional and handle.get(name) is None:
        return None
    text = _get(handle, name, str)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"cuda_ipc handle: field {name!r} is not base64: {exc}") from exc
