"""The cluster secret: read once at start, from a file or the environment, never from the command line.

Every daemon of a cluster holds the same secret; it authenticates the data plane between them
(zend.transport.handshake) and derives each job's token (zend.daemon.jobs).
"""

from __future__ import annotations

import os

SECRET_ENV = "ZEN_CLUSTER_SECRET"
SECRET_FILE_ENV = "ZEN_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 16
HOW_TO_SET = (f"give --secret-file FILE, or set ${SECRET_FILE_ENV} to a file holding it or ${SECRET_ENV} to the "
              "secret itself")


def secret_given(path: str | None = None) -> bool:
    """Whether a secret is named at all (`path`, or either variable): what load_secret would read."""
    return bool(path or os.environ.get(SECRET_FILE_ENV) or os.environ.get(SECRET_ENV))


class SecretError(ValueError):
    """The secret that was found cannot be used; the message says where it came from and why."""


def load_secret(path: str | None = None) -> bytes:
    """The cluster secret: from `path`, else $ZEN_CLUSTER_SECRET_FILE, else $ZEN_CLUSTER_SECRET.

    Never from the command line (it would show in `ps`). OSError if the file cannot be read.
    """
    path = path or os.environ.get(SECRET_FILE_ENV)
    if path:
        with open(path, "rb") as f:
            secret = f.read().strip()
        source = f"file {path}"
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV].encode()
        source = f"${SECRET_ENV}"
    else:  # nothing to measure: say where a secret goes, not that it is 0 bytes
        raise SecretError(f"no cluster secret is set: {HOW_TO_SET} (at least {MIN_SECRET_BYTES} bytes, the same "
                          "on every node)")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"cluster secret from {source} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are "
                          "required")
    return secret
