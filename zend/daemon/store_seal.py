"""What zen reads from a rendezvous store is authenticated first: a MAC under a key of the cluster secret.

The rendezvous store (torch's TCPStore, `zend store`) has no authentication: whoever reaches its
port can read and write every key. torch's elastic rendezvous keeps its state there as a pickle and
unpickles it on every keep-alive, so a forged value would run code in every daemon; zen's own entries
(data-plane addresses, settings, job steps) would redirect dials or feed bad numbers. So every value
zen or torch's handler reads is sealed by its writer (`seal`: HMAC-SHA256 under a key derived from the
cluster secret, bound to the key it is stored under) and opened by its reader (`open_value`), which
refuses anything else. A refused value is never obeyed: the reader acts as if the key held nothing, so
an honest writer overwrites it. Values are authenticated, not hidden: the store's port belongs inside
the cluster's network.

`store_backend` is torch's rendezvous backend over a TCPStore with this built in: the blobs it hands
the handler are the ones an honest member sealed, and a refused blob reads as an empty rendezvous,
with the real token, so that the handler's next write replaces it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("zend.store")
VERSION = b"zs1"
MAC_BYTES = 32
_REFUSALS_LOGGED = 256  # distinct refused values logged, at most (a flood of garbage logs once per kind)


class StoreSeal:
    """Seals and opens store values for one cluster (the secret and the cluster id bind the key)."""

    def __init__(self, secret: bytes, cluster_id: str):
        self._key = hmac.new(secret, b"zen-store-mac\0" + cluster_id.encode(), hashlib.sha256).digest()
        self._logged: set[tuple[str, bytes]] = set()
        self._lock = threading.Lock()

    def _mac(self, label: str, payload: bytes) -> bytes:
        return hmac.new(self._key, VERSION + label.encode() + b"\0" + payload, hashlib.sha256).digest()

    def seal(self, label: str, payload: bytes) -> bytes:
        """`payload` as stored under `label` (the store key, or what names the value's place)."""
        return VERSION + self._mac(label, payload) + payload

    def open_value(self, label: str, blob: bytes | None) -> bytes | None:
        """The payload of a value sealed for `label`, or None (absent, or refused: logged once per value)."""
        if blob is None:
            return None
        head = len(VERSION) + MAC_BYTES
        if len(blob) >= head and blob[:len(VERSION)] == VERSION:
            payload = blob[head:]
            if hmac.compare_digest(blob[len(VERSION):head], self._mac(label, payload)):
                return payload
        self.refused(label, blob)
        return None

    def refused(self, label: str, blob: bytes) -> None:
        """Log a refused value once (by its key and digest), at WARNING: someone without the secret wrote it."""
        digest = hashlib.blake2b(blob, digest_size=8).digest()
        with self._lock:
            if (label, digest) in self._logged or len(self._logged) >= _REFUSALS_LOGGED:
                return
            self._logged.add((label, digest))
        log.warning("refused an unauthenticated rendezvous store value", extra={
            "event": "store_value_refused", "key": label[:200], "bytes": len(blob),
            "reason": "not sealed with this cluster's secret (someone who reaches the store wrote it, or a daemon "
                      "of another cluster or secret); ignored, and overwritten by the next honest write"})


def empty_state_bits() -> bytes:
    """torch's state of a rendezvous nobody has joined, as its handler reads it (made here, never read)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    return pickle.dumps(_RendezvousState())


def store_backend(connection: Callable[[], Any], run_id: str, seal: StoreSeal) -> Any:
    """A torch `RendezvousBackend` over the TCPStore `connection()` gives (a new one after the store restarts),
    as torch's c10d backend is, but with its state blobs sealed: torch's handler only ever unpickles what a
    member holding the cluster secret wrote.

    Unlike torch's backend it never blocks on a missing key (a deleted state is written again, empty, at
    once: a TCPStore `get` of a missing key would wait for the store's whole timeout) and never raises
    on a value it cannot read (garbage reads as an empty rendezvous, with its real token, so the
    handler's next write replaces it)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    key = f"torch.rendezvous.{run_id}"
    empty = b"-"  # what the key holds before anyone joined (never a sealed value: those start with VERSION)

    class SealedStoreBackend(RendezvousBackend):
        @property
        def name(self) -> str:
            return "zen-sealed-c10d"

        def _call(self, op: str, *args: Any) -> Any:
            try:
                return getattr(connection(), op)(*args)
            except (ValueError, RuntimeError, TimeoutError) as exc:
                raise RendezvousConnectionError(f"the rendezvous store failed on {op} of {key!r}: {exc}") from exc

        def _read(self, blob: bytes) -> tuple[bytes, Any] | None:
            if blob == empty:
                return None
            payload = seal.open_value(key, blob)
            return (empty_state_bits() if payload is None else payload), blob

        def get_state(self) -> tuple[bytes, Any] | None:
            if not self._call("check", [key]):  # deleted: there again, empty
                self._call("compare_set", key, "", empty)
            return self._read(self._call("get", key))

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            sealed = seal.seal(key, state)
            if not self._call("check", [key]):
                self._call("compare_set", key, "", empty)
            current = self._call("compare_set", key, token if isinstance(token, bytes) else empty, sealed)
            read = self._read(current)
            if read is None:
                return None
            return read[0], read[1], current == sealed

    return SealedStoreBackend()


def sealed_backend(inner: Any, key: str, seal: StoreSeal) -> Any:
    """torch's backend `inner` with its state blobs sealed under `key`: a blob without a valid seal reads as
    an empty rendezvous, with its real token, so the handler's next write replaces it."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    def opened(blob: bytes) -> bytes:
        payload = seal.open_value(key, blob)
        return empty_state_bits() if payload is None else payload

    class SealedBackend(RendezvousBackend):
        @property
        def name(self) -> str:
            return f"zen-sealed-{inner.name}"

        def get_state(self) -> tuple[bytes, Any] | None:
            got = inner.get_state()
            return None if got is None else (opened(got[0]), got[1])

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            got = inner.set_state(seal.seal(key, state), token)
            return None if got is None else (opened(got[0]), got[1], got[2])

    return SealedBackend()
