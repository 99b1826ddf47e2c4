"""Where an elastic cluster's rounds live: a TCPStore (`zend store`), or an etcd cluster.

`--rendezvous HOST:PORT` names a TCPStore: simple, but one process; while it is down no membership
change can happen (running generations need nothing from it). `--rendezvous etcd://H:P,H:P,H:P`
names the client URLs of an etcd cluster (v2 API: etcd 3.4 with `--enable-v2`), replicated by Raft:
it answers while a majority of its members live, so no single process is the cluster's to lose.

Either way torch does the work: the rounds are `DynamicRendezvousHandler`'s, over torch's
`C10dRendezvousBackend`-like store backend (store_seal.store_backend) or torch's
`EtcdRendezvousBackend`, and the members' entries go into torch's `TCPStore` or `EtcdStore`. What
zen adds is the seal: the handler only ever unpickles a state blob a member holding the cluster
secret wrote (torch's backends unpickle whatever the store holds).
"""

from __future__ import annotations

import binascii
import random
import re
from base64 import b64decode
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from zend.daemon.membership import RendezvousTimeoutError, first_line
from zend.daemon.store_seal import StoreSeal, sealed_backend, store_backend

ETCD = "etcd://"
ETCD_PREFIX = "/zen"  # every key of zen's under it: /zen/<cluster>/rdzv (torch's state), /zen/<cluster>/store/...
ETCD_STATE_TTL_S = 24 * 3600  # torch re-writes the state at every heartbeat: only an abandoned cluster's expires
# one request to one member (connect, then read): below the rendezvous' dead time (3 s at least), so that a
# member whose host went dark costs a heartbeat's delay, not the members' standing (the client fails over)
ETCD_REQUEST_S = 1.5


@dataclass(frozen=True)
class RendezvousTls:
    """TLS to an etcd cluster's members (PEM files; empty: plain http)."""

    ca_file: str = ""  # the CA that signed the members' certificates: https, the members checked
    cert_file: str = ""  # this daemon's client certificate (etcd --client-cert-auth), with its key
    key_file: str = ""

    @property
    def on(self) -> bool:
        return bool(self.ca_file or self.cert_file)


def etcd_members(address: str) -> list[tuple[str, int]] | None:
    """The (host, port) client URLs of `etcd://H:P[,H:P...]`; None for a TCPStore's HOST:PORT. ValueError
    names the part that is not HOST:PORT."""
    if not address.startswith(ETCD):
        return None
    members = []
    for part in address.removeprefix(ETCD).split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rendezvous {address!r}: {part!r} is not HOST:PORT of an etcd member")
        members.append((host, int(port)))  # an IPv6 host keeps its brackets: python-etcd puts it in a URL
    return members


class TcpRounds:
    """The rounds in torch's TCPStore at host:port."""

    def __init__(self, address: str, cluster_id: str, seal: StoreSeal):
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        self.run_id, self.seal = f"zen-{cluster_id}", seal
        self.where = f"tcpstore://{host}:{port} (elastic)"
        self.errors: tuple[type[BaseException], ...] = ()  # the store's own beyond torch's RuntimeErrors

    def connect(self, timeout_s: float, op_timeout_s: float) -> Any:
        """A client of the store, tried for up to `timeout_s`; its operations time out after op_timeout_s."""
        from torch.distributed import DistError, TCPStore

        try:
            store = TCPStore(self.host, self.port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)
        except DistError as exc:
            raise RendezvousTimeoutError(f"could not reach the rendezvous store at {self.where} within {timeout_s:g}s "
                                         f"(is `zend store` running there?): {first_line(exc)}") from None
        store.set_timeout(timedelta(seconds=op_timeout_s))
        return store

    def backend(self, connection: Any) -> Any:
        return store_backend(connection, self.run_id, self.seal)

    def forget_rounds_before(self, round_: int) -> int:
        """Nothing: a TCPStore cannot list its keys, and what old rounds leave (a few hundred bytes a member)
        is bounded by `zend store --max-memory-bytes`, past which the store restarts empty."""
        return 0


class EtcdRounds:
    """The rounds in an etcd cluster (python-etcd, as torch's etcd backend uses it)."""

    def __init__(self, members: list[tuple[str, int]], cluster_id: str, seal: StoreSeal, tls: RendezvousTls):
        self.members, self.cluster_id, self.seal, self.tls = members, cluster_id, seal, tls
        self.run_id = f"zen-{cluster_id}"
        self.errors: tuple[type[BaseException], ...] = ()  # python-etcd's, once imported
        self._inner: Any = None  # torch's backend: it follows each new client
        self.where = ("etcd://" + ",".join(f"{h}:{p}" for h, p in members) + (" (elastic, TLS)" if tls.on else
                                                                              " (elastic)"))
        self._client: Any = None

    def connect(self, timeout_s: float, op_timeout_s: float) -> Any:
        """torch's EtcdStore over a client that fails over among the members (a majority must answer)."""
        try:
            import etcd
            from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore
        except ImportError as exc:
            raise RendezvousTimeoutError(f"{self.where} needs python-etcd (pip install 'zen[etcd]'): {exc}") from None
        self.errors = (etcd.EtcdException,)
        members = random.sample(self.members, len(self.members))  # daemons spread over the members
        try:
            t = self.tls
            client = etcd.Client(host=tuple(members), allow_reconnect=True, read_timeout=ETCD_REQUEST_S,
                                 protocol="https" if t.on else "http", ca_cert=t.ca_file or None,
                                 cert=(t.cert_file, t.key_file) if t.cert_file else None)
            client.machines  # noqa: B018 (a request: is any member there?)
        except etcd.EtcdException as exc:
            raise RendezvousTimeoutError(f"could not reach any etcd member of {self.where}: {first_line(exc)}") \
                from None
        old, self._client = self._client, client
        if self._inner is not None:  # a client that lost members from its list fails over no more: replace it
            self._inner._client = client
        if old is not None:
            old.http.clear()
        return EtcdStore(self._client, f"{ETCD_PREFIX}/{self.cluster_id}/store",
                         timeout=timedelta(seconds=op_timeout_s))

    def backend(self, connection: Any) -> Any:
        from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend

        self._inner = EtcdRendezvousBackend(self._client, self.run_id, ttl=ETCD_STATE_TTL_S,
                                            key_prefix=f"{ETCD_PREFIX}/{self.cluster_id}/rdzv")
        return sealed_backend(self._inner, f"torch.rendezvous.{self.run_id}", self.seal)

    def forget_rounds_before(self, round_: int) -> int:
        """Delete the keys of every round before `round_` (the members' entries and torch's bootstrap keys,
        `torch.rendezvous.<run>.<round>/...`); how many went. etcd keeps a key until it is deleted, and torch's
        EtcdStore lists its whole directory at every read, so without this a long-lived cluster's reads
        would grow with every generation it ever formed. Keys it did not write are left alone."""
        import etcd

        directory = f"{ETCD_PREFIX}/{self.cluster_id}/store"
        ours = re.compile(rf"torch\.rendezvous\.{re.escape(self.run_id)}\.(\d+)/")
        try:
            listing = self._client.get(directory)
        except etcd.EtcdKeyNotFound:
            return 0
        gone = 0
        for node in listing.children:
            if node.dir or node.key is None:
                continue
            try:
                key = b64decode(node.key.rsplit("/", 1)[-1], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                continue
            found = ours.match(key)
            if found is not None and int(found.group(1)) < round_:
                try:
                    self._client.delete(node.key)
                except etcd.EtcdKeyNotFound:  # another member deleted it first
                    continue
                gone += 1
        return gone


def open_rounds(address: str, cluster_id: str, seal: StoreSeal, tls: RendezvousTls) -> TcpRounds | EtcdRounds:
    members = etcd_members(address)
    return TcpRounds(address, cluster_id, seal) if members is None else EtcdRounds(members, cluster_id, seal, tls)
