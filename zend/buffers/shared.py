"""CPU buffers in anonymous shared memory: how gradient bytes reach the daemon without a copy.

A buffer is a memfd (``os.memfd_create``) mapped with ``mmap``: it has no name in /dev/shm, so
nothing is left behind when a process dies, and the memory goes away when the last file
descriptor and the last mapping are gone. The daemon creates the buffer and sends the descriptor
over the buffer socket; the trainer maps the same pages. The file is sealed against shrinking
and growing, so a peer cannot truncate it under the other side's mapping (which would turn its
next access into SIGBUS).

Views are ``torch.frombuffer`` tensors over the mapping. torch keeps a reference to the mmap
object but does not hold its buffer export, so ``mmap.close()`` would succeed under live views
and leave them pointing at unmapped memory (a segfault, not an exception). ``close()`` therefore
never unmaps: it drops its reference and the mapping goes away with the last view.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import warnings
import weakref
from typing import Self

import torch

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; Python's fcntl may lack it
BUFFER_MODE = 0o600  # of the memfd's inode: owner only (the descriptor passed over the socket needs no more)


class SharedBufferError(ValueError):
    """A buffer request that cannot be served: bad id, bad size, out-of-range view, closed buffer.
    `code` is RESOURCE_EXHAUSTED where the request was fine and the daemon is out of something."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
# what creating a buffer can run out of: descriptors (the process's, the system's), memory, space
EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC})


class SharedBuffer:
    """A CPU buffer in anonymous shared memory (os.memfd_create + mmap): no name in /dev/shm, so nothing can leak.

    Create it with :meth:`create` (the owner) or :meth:`attach` (the side that received the file
    descriptor). Thread safe: views may be taken while another thread closes the buffer.
    """

    buffer_id: str
    nbytes: int
    device: str

    def __init__(self, buffer_id: str, nbytes: int, fd: int, mm: mmap.mmap | None) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        self.buffer_id = buffer_id
        self.nbytes = nbytes
        self.device = "cpu"
        self._fd = fd
        self._mm = mm
        self._lock = threading.Lock()
        self._readonly = False  # attach_readonly: a PROT_READ mapping
        self._released: weakref.ref[mmap.mmap] | None = None  # the mapping, once closed: alive while views are

    @classmethod
    def create(cls, nbytes: int, buffer_id: str) -> Self:
        """A new zero-filled buffer of ``nbytes`` (at least 1) bytes."""
        return cls._create(nbytes, buffer_id, _SEALS)

    @classmethod
    def create_sealable(cls, nbytes: int, buffer_id: str) -> Self:
        """As `create`, its seals left open for `seal_writes` (a checkpoint segment: filled by the daemon, then
        lent read-only)."""
        return cls._create(nbytes, buffer_id, _SEALS & ~fcntl.F_SEAL_SEAL, "zend-checkpoint")

    @classmethod
    def _create(cls, nbytes: int, buffer_id: str, seals: int, kind: str = "zend-buffer") -> Self:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise SharedBufferError(f"buffer {buffer_id!r}: nbytes must be an integer >= 1, got {nbytes!r}")
        # the name is what /proc/<pid>/fd shows: a trainer's buffer and checkpoint memory told apart
        fd = os.memfd_create(f"{kind}-{buffer_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # memfds are born 0777: anyone who could reach the descriptor by /proc/<pid>/fd/N could open
            # it. The trainer gets it over the socket and maps it from there, so the inode owes nobody else.
            os.fchmod(fd, BUFFER_MODE)
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError, ValueError) as exc:
            os.close(fd)
            exhausted = isinstance(exc, OSError) and exc.errno in EXHAUSTED_ERRNOS  # the mapping: memory
            raise SharedBufferError(f"buffer {buffer_id!r}: cannot allocate {nbytes} bytes of shared memory: "
                                    f"{exc}", RESOURCE_EXHAUSTED if exhausted else None) from exc
        return cls(buffer_id, nbytes, fd, mm)

    @classmethod
    def attach(cls, fd: int, nbytes: int, buffer_id: str) -> Self:
        """Map ``nbytes`` of a descriptor received from the other side.

        The descriptor must be a memfd sealed against shrinking and hold at least ``nbytes``
        bytes. On success the buffer owns ``fd`` (``close()`` closes it); on failure the caller
        still owns it.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise SharedBufferError(f"buffer {buffer_id!r}: nbytes must be an integer >= 1, got {nbytes!r}")
        try:
            size = os.fstat(fd).st_size
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise SharedBufferError(f"buffer {buffer_id!r}: fd {fd} is not a sealed memfd: {exc}") from exc
        if size < nbytes:
            raise SharedBufferError(f"buffer {buffer_id!r}: fd {fd} holds {size} bytes, fewer than nbytes={nbytes}")
        if not seals & fcntl.F_SEAL_SHRINK:
            raise SharedBufferError(f"buffer {buffer_id!r}: fd {fd} is not sealed against shrinking (seals {seals:#x})")
        try:
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise SharedBufferError(f"buffer {buffer_id!r}: cannot map {nbytes} bytes of fd {fd}: {exc}") from exc
        return cls(buffer_id, nbytes, fd, mm)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def fileno(self) -> int:
        """The memfd, to send to the other side with ``socket.send_fds``."""
        with self._lock:
            if self._mm is None:
                raise SharedBufferError(f"buffer {self.buffer_id!r} is closed")
            return self._fd

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        """A 1-D zero-copy tensor over bytes ``[offset, offset + count * itemsize)``.

        ``offset`` must be a multiple of the dtype's item size. The view shares memory with the
        other side: writes are visible there at once (synchronise through the protocol above).
        """
        nbytes = check_view_range(self, dtype, offset, count)
        with self._lock:
            if self._mm is None:
                raise SharedBufferError(f"buffer {self.buffer_id!r} is closed")
            if nbytes == 0:
                return torch.empty(0, dtype=dtype)
            if self._readonly:  # torch warns of a buffer it cannot write; the caller only reads it
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    return torch.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)
            return torch.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)

    def seal_writes(self) -> None:
        """No more writes, by anyone: F_SEAL_FUTURE_WRITE (this side's mapping stays, unused from now on; no
        new writable mapping and no write() is allowed), so the descriptor may be handed to a reader."""
        with self._lock:
            if self._mm is None:
                raise SharedBufferError(f"buffer {self.buffer_id!r} is closed")
            try:
                if fcntl.fcntl(self._fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE:
                    return  # sealed before (a segment used again): its own mapping still writes
                fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            except OSError as exc:
                raise SharedBufferError(f"buffer {self.buffer_id!r}: cannot seal it against writes: {exc}") from exc

    @classmethod
    def attach_readonly(cls, fd: int, nbytes: int, buffer_id: str) -> Self:
        """Map ``nbytes`` of a memfd sealed against writes (seal_writes), read-only. Views of it must only be
        read (torch cannot mark them so); on success the buffer owns ``fd``."""
        try:
            size, seals = os.fstat(fd).st_size, fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise SharedBufferError(f"buffer {buffer_id!r}: fd {fd} is not a sealed memfd: {exc}") from exc
        if size < nbytes or not seals & F_SEAL_FUTURE_WRITE:
            raise SharedBufferError(f"buffer {buffer_id!r}: fd {fd} holds {size} bytes (want {nbytes}), seals "
                                    f"{seals:#x} (want writes sealed)")
        try:
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise SharedBufferError(f"buffer {buffer_id!r}: cannot map {nbytes} bytes of fd {fd}: {exc}") from exc
        buffer = cls(buffer_id, nbytes, fd, mm)
        buffer._readonly = True
        return buffer

    def publish(self) -> None:
        """Make this side's writes visible to the other process before handing the buffer over (a step
        submitted, a result answered). Shared memory needs nothing: a device buffer orders its stream."""

    def acquire(self) -> None:
        """See what the other process published before reading (its counterpart of `publish`)."""

    def close(self) -> None:
        """Close the descriptor and drop the mapping; idempotent.

        Views taken before must not be used any more: they are no longer part of this buffer
        (the daemon may have freed it from its pool). They stay memory safe, though: the mapping
        is released when the last of them is dropped, never under them.
        """
        with self._lock:
            if self._mm is None:
                return
            self._released = weakref.ref(self._mm)
            self._mm = None  # unmapped by the mmap object's finaliser, after the last view
            os.close(self._fd)
            self._fd = -1

    @property
    def still_mapped(self) -> bool:
        """Closed, and its mapping (with the mmap's own copy of the descriptor) still held by a view."""
        return self._released is not None and self._released() is not None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"{type(self).__name__}({self.buffer_id!r}, nbytes={self.nbytes}, device={self.device!r}, {state})"


def check_view_range(buffer: SharedBuffer, dtype: torch.dtype, offset: int, count: int) -> int:
    """The byte length of a view of ``count`` items at ``offset``; SharedBufferError naming the values if bad."""
    if not isinstance(dtype, torch.dtype):
        raise SharedBufferError(f"buffer {buffer.buffer_id!r}: dtype must be a torch.dtype, got {dtype!r}")
    for name, value in (("offset", offset), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SharedBufferError(f"buffer {buffer.buffer_id!r}: {name} must be an integer >= 0, got {value!r}")
    itemsize = dtype.itemsize
    if offset % itemsize:
        raise SharedBufferError(f"buffer {buffer.buffer_id!r}: offset={offset} is not aligned to the "
                                f"{itemsize}-byte items of {dtype}")
    end = offset + count * itemsize
    if end > buffer.nbytes:
        raise SharedBufferError(f"buffer {buffer.buffer_id!r}: view of offset={offset}, count={count} {dtype} "
                                f"ends at byte {end}, past nbytes={buffer.nbytes}")
    return end - offset
