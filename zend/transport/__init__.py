"""How bytes cross between ranks: implementations of zend.core.comm.Communicator.

Network transports are chosen by URI scheme (`tcp://host:port`, `ucx://host:port`);
each backend module is imported only when its scheme is used, so that a CPU-only install
never loads UCX.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("zend.transport")
RDMA_TRANSPORTS = {"rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs", "ud_mlx5", "ib"}

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


NATIVE_BACKENDS = {"tcp": "zend.transport.native_tcp:NativeTcpTransport"}  # engine_choice.py


def create(uri: str, rank: int, world_size: int, engine: str = "python", **options: Any) -> Any:
    """A started transport listening at `uri` (see each backend for its options); `engine` "native" puts
    the native engine on its links (engine_choice.choose_engine resolves a setting to it)."""
    scheme, host, port = parse_uri(uri)
    if engine not in ("python", "native"):
        raise ValueError(f"data-plane engine {engine!r} is not 'python' or 'native'")
    if engine == "native" and scheme not in NATIVE_BACKENDS:
        raise ValueError(f"data-plane engine 'native' serves {sorted(NATIVE_BACKENDS)} links, not {scheme}://")
    module, _, name = (NATIVE_BACKENDS if engine == "native" else BACKENDS)[scheme].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(rank, world_size, host=host, port=port, **options).start()


def choose_transport(setting: str, hosts: Sequence[str], gpu_tensors: bool = False,
                     ucx_transports: set[str] | None = None) -> tuple[str, str]:
    """Resolve a transport setting ('tcp', 'ucx' or 'auto') to a scheme, with the reason.

    `auto` takes UCX where it brings something plain TCP does not: RDMA in the UCX build, or
    GPU tensors (sent from device memory); TCP otherwise. On plain TCP networks our sockets
    beat ucxx over TCP, and between ranks of one host they beat ucxx's shared memory up to
    16 MiB messages (benchmarks/transport_throughput.py: 64 KiB 0.93 vs 0.07 GB/s, 129 vs
    1001 us latency; ucx wins only at 16 MiB and above). `ucx_transports` is what UCX offers
    (by default asked of ucxx when it is installed). The choice and its reason are logged.
    """
    if setting in ("tcp", "ucx"):
        return setting, f"set to {setting}"
    if setting != "auto":
        raise ValueError(f"transport setting {setting!r} is not 'tcp', 'ucx' or 'auto'")
    if ucx_transports is None:
        ucx_transports = set()
        if importlib.util.find_spec("ucxx") is not None:
            from zend.transport.ucx import offered_transports

            ucx_transports = offered_transports()
    if not ucx_transports:
        choice, reason = "tcp", "ucxx is not installed"
    elif ucx_transports & RDMA_TRANSPORTS:
        choice, reason = "ucx", f"UCX offers RDMA ({', '.join(sorted(ucx_transports & RDMA_TRANSPORTS))})"
    elif gpu_tensors and {"cuda_copy", "cuda_ipc"} & ucx_transports:
        choice, reason = "ucx", "GPU tensors go from device memory without staging through the host"
    elif len(set(hosts)) < len(hosts):
        choice, reason = "tcp", "ranks share a host: our sockets beat ucxx's shared memory below 16 MiB messages"
    else:
        choice, reason = "tcp", "plain TCP network: our sockets beat ucxx over TCP"
    log.info("transport auto -> %s: %s", choice, reason)
    return choice, reason
