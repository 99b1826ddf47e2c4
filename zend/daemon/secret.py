"""The cluster secret: read once at start, from a file or the environment, never from the command line.

Every daemon of a cluster holds the same secret; it authenticates the data plane between them
(zend.transport.handshake), seals what they write to the rendezvous store (store_seal.py) and
derives each job's token (zend.daemon.jobs). `zend secret` makes one: 32 random bytes, written as
`zen1.` and their URL-safe base64, which is what every example and manifest uses. Any other secret of
16 bytes or more works too, but one made only of printable text (a passphrase, a word) is logged as
weak: whoever records a single handshake can test guesses against it offline.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import secrets

SECRET_ENV = "ZEN_CLUSTER_SECRET"
SECRET_FILE_ENV = "ZEN_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 16
PREFIX = b"zen1."  # `zend secret`'s format: the prefix, then 32 random bytes in URL-safe base64
RANDOM_BYTES = 32
HOW_TO_SET = (f"give --secret-file FILE, or set ${SECRET_FILE_ENV} to a file holding it or ${SECRET_ENV} to the "
              "secret itself (`zend secret` makes one)")
log = logging.getLogger("zend.secret")
_warned: set[str] = set()


def secret_given(path: str | None = None) -> bool:
    """Whether a secret is named at all (`path`, or either variable): what load_secret would read."""
    return bool(path or os.environ.get(SECRET_FILE_ENV) or os.environ.get(SECRET_ENV))


class SecretError(ValueError):
    """The secret that was found cannot be used; the message says where it came from and why."""


def new_secret() -> str:
    """A fresh random secret in `zend secret`'s format."""
    return (PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(RANDOM_BYTES)).rstrip(b"=")).decode()


def weakness(text: bytes) -> str | None:
    """Why a secret as given (before decoding) may be guessed, or None."""
    if text.startswith(PREFIX):
        return None
    if all(32 <= b < 127 for b in text):
        return ("it is made only of printable text: if it is a passphrase or a word, whoever records one data-plane "
                "handshake can test guesses against it offline; `zend secret` makes a random one")
    return None


def decode(text: bytes, source: str) -> bytes:
    """The key bytes of a secret as given: `zend secret`'s format decoded, any other secret as it is."""
    if not text.startswith(PREFIX):
        return text
    body = text[len(PREFIX):]
    try:
        key = base64.urlsafe_b64decode(body + b"=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise SecretError(f"cluster secret from {source} starts with {PREFIX.decode()!r} but the rest is not URL-safe "
                          "base64 (copy the whole line `zend secret` printed)") from None
    if len(key) != RANDOM_BYTES:
        raise SecretError(f"cluster secret from {source} decodes to {len(key)} bytes, not {RANDOM_BYTES} (copy the "
                          "whole line `zend secret` printed)")
    return key


def load_secret(path: str | None = None) -> bytes:
    """The cluster secret's key bytes: from `path`, else $ZEN_CLUSTER_SECRET_FILE, else $ZEN_CLUSTER_SECRET.

    Never from the command line (it would show in `ps`). OSError if the file cannot be read. A weak
    secret is logged once per source, at WARNING.
    """
    path = path or os.environ.get(SECRET_FILE_ENV)
    if path:
        with open(path, "rb") as f:
            text = f.read().strip()
        source = f"file {path}"
    elif os.environ.get(SECRET_ENV):
        text = os.environ[SECRET_ENV].encode()
        source = f"${SECRET_ENV}"
    else:  # nothing to measure: say where a secret goes, not that it is 0 bytes
        raise SecretError(f"no cluster secret is set: {HOW_TO_SET} (at least {MIN_SECRET_BYTES} bytes, the same "
                          "on every node)")
    secret = decode(text, source)
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"cluster secret from {source} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are "
                          "required")
    why = weakness(text)
    if why is not None and source not in _warned:
        _warned.add(source)
        log.warning("weak cluster secret", extra={"event": "weak_secret", "source": source, "reason": why})
    return secret
