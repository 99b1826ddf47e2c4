"""Where a node's daemon listens for its trainers: one folder, two unix sockets.

`zend.sock` carries the gRPC control plane, `buffers.sock` the shared-buffer hand-off. The
folder is `$ZEN_SOCKET_DIR` for everything that talks to a daemon (the client, `zend status`,
`zend health`); the daemon's own setting is `--socket-dir` (`$ZEND_SOCKET_DIR`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

DEFAULT_SOCKET_DIR = "/run/zend"
GRPC_SOCKET = "zend.sock"
BUFFER_SOCKET = "buffers.sock"
SOCKET_DIR_ENV = "ZEN_SOCKET_DIR"
# the daemon's own setting (--socket-dir), which `zend status` and `zend health` used to read too:
# still honoured here, with a warning, for tools and scripts that set only it
DAEMON_SOCKET_DIR_ENV = "ZEND_SOCKET_DIR"

log = logging.getLogger("zend.protocol")


def socket_dir_from_env(env: Mapping[str, str] | None = None) -> str:
    """The daemon's socket folder as a trainer or an operator tool finds it."""
    env = os.environ if env is None else env
    if env.get(SOCKET_DIR_ENV):
        return env[SOCKET_DIR_ENV]
    if env.get(DAEMON_SOCKET_DIR_ENV):
        log.warning("$%s is deprecated for reaching a daemon; set $%s (both name the socket folder)",
                    DAEMON_SOCKET_DIR_ENV, SOCKET_DIR_ENV)
        return env[DAEMON_SOCKET_DIR_ENV]
    return DEFAULT_SOCKET_DIR


def grpc_socket(socket_dir: str) -> str:
    return os.path.join(socket_dir, GRPC_SOCKET)


def buffer_socket(socket_dir: str) -> str:
    return os.path.join(socket_dir, BUFFER_SOCKET)


def grpc_address(socket_dir: str) -> str:
    """The gRPC target of the daemon whose sockets are in `socket_dir`."""
    return f"unix:{grpc_socket(socket_dir)}"
