"""Shared buffers between trainers and their node's daemon: gradient bytes never go through gRPC.

The daemon owns every buffer (:class:`BufferServer`); a trainer asks for them over a unix
socket (:class:`BufferClient`) and maps the same memory: :class:`SharedBuffer` on the CPU
(memfd), :class:`CudaBuffer` on a GPU (CUDA IPC). The wire format is in :mod:`.wire`.
"""

from zend.buffers.buffer_client import BufferClient
from zend.buffers.buffer_server import BufferServer, ClaimRefused, SessionInfo
from zend.buffers.cuda import CudaBuffer
from zend.buffers.shared import SharedBuffer, SharedBufferError
from zend.buffers.wire import ProtocolError

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
