"""A test double of a device buffer: what one process writes reaches the other only when published.

On a GPU a buffer's writes are queued on a CUDA stream: the other process, on its own stream, sees
them only after the writer has ordered its stream (`CudaBuffer.publish`). Shared memory shows every
write at once, so on a CPU a missing `publish` or `acquire` goes unnoticed. A `FencedBuffer` is shared
memory that behaves like the device: each side reads and writes a private copy, `publish` copies it
into the shared pages, `acquire` copies them back. A hand-off that forgets either gives a wrong sum,
on a machine without a GPU, in CI.

Only for tests: a daemon serves device "fenced" and a trainer asks for it (for what would be "cpu")
when both run with ZEN_TEST_FENCED_BUFFERS=1.
"""

from __future__ import annotations

import mmap
import os

import torch

from zend.buffers.shared import SharedBuffer, SharedBufferError, check_view_range

DEVICE = "fenced"
ENV = "ZEN_TEST_FENCED_BUFFERS"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class FencedBuffer(SharedBuffer):
    """Shared memory seen through a private copy on each side (see the module's docstring)."""

    def __init__(self, buffer_id: str, nbytes: int, fd: int, mm: mmap.mmap | None) -> None:
        """Internal: `create` (the daemon) and `attach` (the trainer) as for SharedBuffer."""
        super().__init__(buffer_id, nbytes, fd, mm)
        self.device = DEVICE
        self._private = torch.zeros(nbytes, dtype=torch.uint8)

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        nbytes = check_view_range(self, dtype, offset, count)
        with self._lock:
            if self._mm is None:
                raise SharedBufferError(f"buffer {self.buffer_id!r} is closed")
            return self._private[offset:offset + nbytes].view(dtype)

    def _shared(self) -> torch.Tensor:
        if self._mm is None:
            raise SharedBufferError(f"buffer {self.buffer_id!r} is closed")
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=self.nbytes)

    def publish(self) -> None:
        with self._lock:
            self._shared().copy_(self._private)

    def acquire(self) -> None:
        with self._lock:
            self._private.copy_(self._shared())
