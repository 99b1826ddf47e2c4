"""How bytes cross between ranks: implementations of zend.core.comm.Communicator.

Network transports are chosen by URI scheme (`tcp://host:port`, `ucx://host:port`);
each backend module is imported only when its scheme is used, so that a CPU-only install
never loads UCX.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

BACKENDS = {
    "tcp": "zend.transport.tcp:TcpTransport",
    "ucx": "zend.transport.ucx:UcxTransport",
}


def parse_uri(uri: str) -> tuple[str, str, int]:
    """'tcp://198.18.0.2:7000' -> ('tcp', '198.18.0.2', 7000); port 0 means any free port."""
    parts = urlsplit(uri)
    if parts.scheme not in BACKENDS:
        raise ValueError(f"transport URI {uri!r}: scheme {parts.scheme!r} is not one of {sorted(BACKENDS)}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"transport URI {uri!r}: invalid port") from None
    if not parts.hostname or port is None:
        raise ValueError(f"transport URI {uri!r}: expected {parts.scheme}://HOST:PORT")
    return parts.scheme, parts.hostname, port


def create(uri: str, rank: int, world_size: int, **options: Any) -> Any:
    """A started transport listening at `uri` (see each backend for its options)."""
    scheme, host, port = parse_uri(uri)
    module, _, name = BACKENDS[scheme].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(rank, world_size, host=host, port=port, **options).start()
