"""Shared buffers between trainers and their node's daemon: gradient bytes never go through gRPC.

The daemon owns every buffer (:class:`BufferServer`); a trainer asks for them over a unix
socket (:class:`BufferClient`) and maps the same memory: :class:`SharedBuffer` on the CPU
(memfd), :class:`CudaBuffer` on a GPU (CUDA IPC). The wire format is in :mod:`.wire`.
The names load on first use, so that a trainer never imports the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zend.buffers.buffer_client import BufferClient
    from zend.buffers.buffer_server import BufferServer, ClaimRefused, SessionInfo
    from zend.buffers.cuda import CudaBuffer
    from zend.buffers.shared import SharedBuffer, SharedBufferError
    from zend.buffers.wire import ProtocolError

_HOMES = {
    "BufferClient": "buffer_client",
    "BufferServer": "buffer_server", "ClaimRefused": "buffer_server", "SessionInfo": "buffer_server",
    "CudaBuffer": "cuda",
    "SharedBuffer": "shared", "SharedBufferError": "shared",
    "ProtocolError": "wire",
}

__all__ = [
    "BufferClient",
    "BufferServer",
    "ClaimRefused",
    "CudaBuffer",
    "ProtocolError",
    "SessionInfo",
    "SharedBuffer",
    "SharedBufferError",
]


def __getattr__(name: str) -> Any:  # PEP 562; its twin in zend.core stays: neither layer may import the other
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zend.buffers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zend.buffers.{home}"), name)
