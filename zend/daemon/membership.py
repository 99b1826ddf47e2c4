"""Who is in the cluster: every rank's data-plane address, the generation, and the settings all agreed on.

Ranks that disagree on a setting (a hash seed, a scheme, the protocol version) would exchange
gradients that silently do not line up, so membership is where that is refused, with an error
naming the setting, the rank and both values. Membership is either given (`static_membership`)
or found by a rendezvous through torch's TCPStore with torchrun's conventions (`rendezvous`).

Store lifetime: rank 0 hosts the TCPStore only for the length of one `rendezvous` call, listening
on the rendezvous address alone. Every rank confirms, through the store, that it has read the
whole membership; rank 0 returns only after all have confirmed (or the timeout passes), and then
closes the store. Nobody needs the store afterwards, so there is nothing for the caller to keep
alive or close. One call is one round, of generation 1.

The store has no authentication, so nothing in it is taken on trust: every value a rank reads
(claims, entries, confirmations) is sealed with the cluster secret (store_seal.py) and bound to
the round by rank 0's random nonce; entries are parsed to an exact schema (member_entry.py). A
value a stranger wrote is refused and overwritten, never obeyed: it can neither take a rank,
redirect a peer's address, nor end the round early.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from zend.daemon import member_entry
from zend.daemon.agreement import disagreements, show_value
from zend.daemon.settings import AUTO_RANK
from zend.daemon.store_seal import StoreSeal
from zend.transport import parse_uri
from zend.transport.handshake import PROTOCOL_VERSION

PROTOCOL_KEY = "protocol_version"
# `--rendezvous env`: a per-node daemon takes node-level variables, first set wins. Never RANK /
# WORLD_SIZE: under torchrun those are per trainer process. Never MASTER_PORT: torchrun's agent
# (or the trainers' process group) owns it; zend's store has a port of its own.
NODE_RANK_VARIABLES = ("ZEN_NODE_RANK", "GROUP_RANK", "NODE_RANK", "PET_NODE_RANK", "JOB_COMPLETION_INDEX")
NODE_COUNT_VARIABLES = ("ZEN_NUM_NODES", "GROUP_WORLD_SIZE", "NNODES", "PET_NNODES")
ADDRESS_VARIABLES = ("ZEN_RENDEZVOUS_ADDR", "MASTER_ADDR", "PET_MASTER_ADDR")
PORT_VARIABLE = "ZEN_RENDEZVOUS_PORT"
DEFAULT_RENDEZVOUS_PORT = 7001  # beside the data plane's 7000; not torchrun's 29400 / 29500
POLL_S = 0.02


class MembershipError(ValueError):
    """Membership is invalid or the ranks disagree; the message names the field, rank(s) and values."""


class RendezvousTimeoutError(MembershipError, TimeoutError):
    """Some ranks did not show up (or confirm) within the timeout; the message names them."""


class RankTaken(MembershipError):
    """Another daemon of the cluster claimed this rank first (a sealed claim)."""


class StoreLost(MembershipError):
    """The rendezvous store went away (rank 0 gave up or exited) during a round."""


@dataclass(frozen=True)
class Membership:
    """One rank's view of the cluster; every rank of a round holds an equal one (but `rank`)."""

    rank: int
    world_size: int
    peers: dict[int, str]  # data-plane URI of every rank, own included
    generation: int
    cluster_id: str
    agreed: dict[str, object]  # the settings every rank agreed on (JSON-able), protocol_version included
    source: str  # "static", "rendezvous tcpstore://host:port" or "elastic tcpstore://host:port"
    members: tuple[int, ...] = ()  # (elastic) the --rank of each member, in rank order; () for all of them
    job_steps: dict[str, int] = field(default_factory=dict)  # (elastic) job -> the step it is at, over members


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (torch's store errors append a C++ backtrace), or its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_int(field: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MembershipError(f"{field}={value!r} is not an integer")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise MembershipError(f"{field}={value} must be {bound}")
    return value


def _check_world(rank: object, world_size: object) -> tuple[int, int]:
    size = _check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise MembershipError(f"rank={rank!r} is not an integer")
    if not 0 <= rank < size:
        raise MembershipError(f"rank={rank} is outside [0, {size}) for world_size={size}")
    return rank, size


def _check_cluster_id(cluster_id: object) -> str:
    if not isinstance(cluster_id, str) or not cluster_id.strip():
        raise MembershipError(f"cluster_id={cluster_id!r} must be a non-empty string")
    return cluster_id


def with_protocol(agreed: object) -> dict[str, object]:
    """`agreed` plus the protocol version, round-tripped through JSON so every rank compares like with like."""
    if not isinstance(agreed, Mapping):
        raise MembershipError(f"agreed={agreed!r} must be a dict of setting name to JSON value")
    for key in agreed:
        if not isinstance(key, str):
            raise MembershipError(f"agreed has key {key!r}: setting names must be strings")
    if PROTOCOL_KEY in agreed and agreed[PROTOCOL_KEY] != PROTOCOL_VERSION:
        raise MembershipError(f"agreed has {PROTOCOL_KEY}={show_value(agreed[PROTOCOL_KEY])} but this zend speaks "
                              f"{PROTOCOL_KEY}={PROTOCOL_VERSION}")
    try:
        text = json.dumps({**agreed, PROTOCOL_KEY: PROTOCOL_VERSION}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise MembershipError(f"agreed is not JSON-able: {exc}") from None
    result: dict[str, object] = json.loads(text)
    return result


def _address(label: str, uri: object) -> tuple[str, int]:
    """(host, port) a peer listens on, or MembershipError naming `label` (e.g. 'peers[2]' or 'rank 2')."""
    if not isinstance(uri, str):
        raise MembershipError(f"{label} URI {uri!r} is not a string")
    try:
        _, host, port = parse_uri(uri)
    except ValueError as exc:
        raise MembershipError(f"{label}: {exc}") from None
    if port == 0:
        raise MembershipError(f"{label} URI {uri!r} has port 0; a peer must name the port it listens on")
    return host.lower(), port


def check_unique(uris: Mapping[int, str], label: str) -> None:
    """Two ranks on one host:port would each dial the other's listener; refuse with both named."""
    seen: dict[tuple[str, int], int] = {}
    for index, uri in uris.items():
        address = _address(label.format(index), uri)
        if address in seen:
            first = seen[address]
            raise MembershipError(f"{label.format(first)} and {label.format(index)} both use data-plane address "
                                  f"{address[0]}:{address[1]} ({uris[first]!r} and {uri!r})")
        seen[address] = index


def static_membership(rank: int, world_size: int, peers: Sequence[str], *, cluster_id: str,
                      agreed: dict[str, object], generation: int = 0) -> Membership:
    """Membership given in full (flags or a config file): validated here, agreed on by nobody else."""
    rank, world_size = _check_world(rank, world_size)
    if isinstance(peers, str) or not isinstance(peers, Sequence):
        raise MembershipError(f"peers={peers!r} must be a list of {world_size} URIs")
    if len(peers) != world_size:
        raise MembershipError(f"peers has {len(peers)} URIs {list(peers)!r} but world_size={world_size}")
    by_rank = dict(enumerate(peers))
    check_unique(by_rank, "peers[{}]")
    return Membership(rank=rank, world_size=world_size, peers=by_rank,
                      generation=_check_int("generation", generation, 0), cluster_id=_check_cluster_id(cluster_id),
                      agreed=with_protocol(agreed), source="static")


def from_environment(env: Mapping[str, str]) -> tuple[str, int, int, int]:
    """(address, port, node count, node rank) of `--rendezvous env`, validated. Each comes from the
    first variable of its list that is set: torchrun's node-level names (GROUP_RANK, ...), Kubeflow's
    PET_*, an Indexed Job's JOB_COMPLETION_INDEX, or zen's own ZEN_* that override them all."""

    def first(names: tuple[str, ...]) -> tuple[str, str] | None:
        for name in names:
            if env.get(name, "").strip():
                return name, env[name].strip()
        return None

    def integer(found: tuple[str, str]) -> int:
        try:
            return int(found[1])
        except ValueError:
            elastic = " (a range: an elastic job; set ZEN_NUM_NODES to the nodes zend waits for)" \
                if ":" in found[1] else ""
            raise MembershipError(f"environment variable {found[0]}={found[1]!r} is not an integer{elastic}") from None

    address, rank_var, count_var = first(ADDRESS_VARIABLES), first(NODE_RANK_VARIABLES), first(NODE_COUNT_VARIABLES)
    missing = [" / ".join(names) for names, found in ((ADDRESS_VARIABLES, address), (NODE_RANK_VARIABLES, rank_var),
                                                      (NODE_COUNT_VARIABLES, count_var)) if found is None]
    if missing:
        per_process = [n for n in ("RANK", "WORLD_SIZE") if env.get(n)]
        hint = (f"; {' and '.join(per_process)} {'is' if len(per_process) == 1 else 'are'} set, but under torchrun "
                "they count trainer processes, not nodes, so zend does not read them") if per_process else ""
        raise MembershipError(f"--rendezvous env needs one of each: {'; '.join(missing)} (not set){hint}")
    assert address is not None and rank_var is not None and count_var is not None
    port_found = first((PORT_VARIABLE,))
    port = integer(port_found) if port_found else DEFAULT_RENDEZVOUS_PORT
    world_size, rank = integer(count_var), integer(rank_var)
    if not 1 <= port <= 65535:
        raise MembershipError(f"environment variable {PORT_VARIABLE}={port} is not a port in [1, 65535]")
    if world_size < 1:
        raise MembershipError(f"environment variable {count_var[0]}={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise MembershipError(f"environment variable {rank_var[0]}={rank} is outside [0, {world_size}) for "
                              f"{count_var[0]}={world_size}")
    return address[1], port, world_size, rank


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def check_agreement(agreed_by_rank: Mapping[int, Mapping[str, object]]) -> None:
    """MembershipError listing every setting where a rank differs from rank 0 (which must be present)."""
    problem = disagreements(agreed_by_rank)
    if problem:
        raise MembershipError("ranks disagree on settings: " + problem)


def bound_store_socket(host: str, port: int) -> socket.socket:
    """A listening socket on exactly `host`:`port`, for a TCPStore server to take (`master_listen_fd`):
    torch's server would otherwise listen on every interface, whatever address it is given."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve the store address {host!r}: {exc}") from None
    listener = socket.socket(infos[0][0], socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(infos[0][4])
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


class _Round:
    """One rank's side of one rendezvous round.

    The store is reached only through `self._store`, never bound to a local, so that dropping it
    in `close` really stops rank 0's server even while a traceback still holds our frames.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, cluster_id: str, timeout_s: float,
                 seal: StoreSeal):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.auto = rank == AUTO_RANK  # until the round gives this daemon a rank (open, claim)
        self.prefix = f"zen/{cluster_id}/"
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.where = f"tcpstore://{host}:{port}"
        self.seal = seal
        self.nonce = ""  # rank 0's, for this round: every sealed value of the round carries it
        self._store: Any = None

    def remaining(self) -> timedelta:
        return timedelta(seconds=max(self.deadline - time.monotonic(), 0.05))

    def open(self) -> None:
        from torch.distributed import DistError, TCPStore

        listener = None
        if self.auto:  # the daemon that can listen on the store's address hosts it, and is rank 0
            with contextlib.suppress(OSError):  # not this host's address, or another daemon here was first
                listener = bound_store_socket(self.host, self.port)
            if listener is not None:
                self.rank, self.auto = 0, False
        hosting = self.rank == 0
        if not hosting:
            self.await_store()
        try:
            if hosting:  # the store takes the listening descriptor over, and closes it when it goes
                listener = listener or bound_store_socket(self.host, self.port)
                self._store = TCPStore(self.host, self.port, self.world_size, True, self.remaining(),
                                       wait_for_workers=False, master_listen_fd=listener.detach())
            else:
                self._store = TCPStore(self.host, self.port, self.world_size, False, self.remaining(),
                                       wait_for_workers=False)
        except (DistError, OSError) as exc:
            first = first_line(exc)
            if hosting:
                raise MembershipError(f"rank 0 could not host the rendezvous store on port {self.port} "
                                      f"({self.where}): {first}") from None
            raise RendezvousTimeoutError(f"rank {self.rank} could not reach the rendezvous store at {self.where}, "
                                         f"hosted by rank 0, within {self.timeout_s:g}s: rank 0 is missing "
                                         f"(or the rendezvous address is wrong): {first}") from None

    def await_store(self) -> None:
        """Wait for rank 0's store to accept connections; TCPStore's own retries overshoot the timeout."""
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=min(self.remaining().total_seconds(), 1)):
                    return
            except OSError as exc:
                if time.monotonic() >= self.deadline:
                    raise RendezvousTimeoutError(
                        f"rank {self.rank} could not reach the rendezvous store at {self.where}, hosted by rank 0, "
                        f"within {self.timeout_s:g}s: rank 0 is missing (or the rendezvous address is wrong): "
                        f"{exc}") from None
            time.sleep(5 * POLL_S)

    def close(self) -> None:
        self._store = None

    def call(self, method: str, *args: Any) -> Any:
        """A store operation; a lost store (rank 0 gone) becomes a MembershipError naming it."""
        from torch.distributed import DistError

        try:
            return getattr(self._store, method)(*args)
        except DistError as exc:
            raise StoreLost(f"rank {self.rank} lost the rendezvous store at {self.where} (rank 0 gave up or "
                            f"exited): {first_line(exc)}") from None

    def read(self, key: str) -> bytes | None:
        """The payload sealed under `key` (the round's nonce included), or None: absent or refused."""
        if not self.call("check", [self.prefix + key]):
            return None
        payload = self.seal.open_value(self.prefix + key, self.call("get", self.prefix + key))
        if payload is None or not payload.startswith(self.nonce.encode() + b"\0"):
            return None
        return payload[len(self.nonce) + 1:]

    def write(self, key: str, payload: bytes) -> bytes:
        sealed = self.seal.seal(self.prefix + key, self.nonce.encode() + b"\0" + payload)
        self.call("set", self.prefix + key, sealed)
        return sealed

    def claim(self) -> None:
        """Refuse a second process claiming the same rank: its publication would overwrite the first's. A
        claim is sealed: one a stranger wrote is overwritten, not obeyed. `--rank auto`: the lowest rank
        from 1 that nobody has claimed."""
        if self.auto:
            for rank in range(1, self.world_size):
                self.rank = rank
                with contextlib.suppress(RankTaken):
                    self._claim_rank()
                    self.auto = False
                    return
            raise MembershipError(f"every rank of world_size={self.world_size} is taken at {self.where}: more "
                                  "daemons with --rank auto than --world-size (check --world-size)")
        self._claim_rank()

    def _claim_rank(self) -> None:
        key = f"{self.prefix}claim/{self.rank}"
        mine = self.seal.seal(key, secrets.token_hex(16).encode())
        expected = ""
        for _ in range(100):
            current = self.call("compare_set", key, expected, mine)
            if current == mine:
                return
            if self.seal.open_value(key, current) is not None:
                raise RankTaken(f"rank {self.rank} is already taken in cluster {self.prefix[4:-1]!r} at "
                                      f"{self.where}: another process published it first (check RANK)")
            expected = current  # a stranger's value: replace it
        raise MembershipError(f"rank {self.rank} could not claim its place at {self.where}: the value kept changing")

    def wait_for(self, kind: str, what: str, accept: Any, republish: Any = None) -> dict[int, bytes]:
        """Every rank's valid `{kind}/{rank}` payload (`accept(rank, payload)` raises MembershipError for one
        that may not stand); RendezvousTimeoutError names the ranks without one. `republish` writes ours
        again if a stranger replaced it."""
        found: dict[int, bytes] = {}
        try:
            while True:
                if republish is not None:
                    republish()
                for r in range(self.world_size):
                    if r not in found and (payload := self.read(f"{kind}/{r}")) is not None:
                        accept(r, payload)
                        found[r] = payload
                if len(found) == self.world_size:
                    return found
                if time.monotonic() >= self.deadline:
                    break
                time.sleep(POLL_S)
        except StoreLost as exc:  # rank 0 gave up first: say whom we were still waiting for
            missing = [r for r in range(self.world_size) if r not in found]
            raise MembershipError(f"{exc}; {_ranks(missing)} of world_size={self.world_size} had not {what} "
                                  f"by then") from None
        missing = [r for r in range(self.world_size) if r not in found]
        raise RendezvousTimeoutError(f"rendezvous at {self.where}: {_ranks(missing)} of world_size="
                                     f"{self.world_size} did not {what} within {self.timeout_s:g}s "
                                     f"(rank {self.rank} waited)")

    def run(self, my_uri: str, agreed: dict[str, object], cluster_id: str) -> Membership:
        self.open()
        self.claim()
        if self.rank == 0:
            self.nonce = secrets.token_hex(16)
            self.call("set", f"{self.prefix}nonce", self.seal.seal(f"{self.prefix}nonce", self.nonce.encode()))
        else:
            self.nonce = self._rank0_nonce()
        entry = member_entry.MemberEntry(self.rank, my_uri, agreed, generation=1 if self.rank == 0 else 0,
                                         nonce=self.nonce).encode()
        sealed = self.write(f"rank/{self.rank}", entry)

        def republish() -> None:
            if self.call("get", f"{self.prefix}rank/{self.rank}") != sealed:
                self.call("set", f"{self.prefix}rank/{self.rank}", sealed)

        entries: dict[int, member_entry.MemberEntry] = {}

        def accept(rank: int, payload: bytes) -> None:
            try:
                entries[rank] = member_entry.parse(payload, self.world_size)
            except member_entry.EntryError as exc:
                raise MembershipError(f"rank {rank} published an unreadable entry at {self.where} (a different zend "
                                      f"version?): {exc}") from None
            if entries[rank].rank != rank:
                raise MembershipError(f"the entry under rank {rank} at {self.where} says rank {entries[rank].rank}")

        self.wait_for("rank", "publish a URI and settings", accept, republish)
        self.write(f"read/{self.rank}", b"read")
        if self.rank == 0:  # everyone must have read before the store goes away
            self.wait_for("read", "confirm reading the membership", lambda r, p: None)
        uris = {r: e.uri for r, e in entries.items()}
        check_unique(uris, "rank {}")
        check_agreement({r: e.agreed for r, e in entries.items()})
        return Membership(rank=self.rank, world_size=self.world_size, peers=uris, generation=entries[0].generation,
                          cluster_id=cluster_id, agreed=entries[0].agreed, source=f"rendezvous {self.where}")

    def _rank0_nonce(self) -> str:
        """Rank 0's nonce for this round, once it is there with a valid seal."""
        key = f"{self.prefix}nonce"
        while True:
            if self.call("check", [key]):
                payload = self.seal.open_value(key, self.call("get", key))
                if payload is not None and len(payload) == 32:
                    return payload.decode()
            if time.monotonic() >= self.deadline:
                raise RendezvousTimeoutError(f"rendezvous at {self.where}: rank 0 did not start the round within "
                                             f"{self.timeout_s:g}s (rank {self.rank} waited)")
            time.sleep(POLL_S)


def rendezvous(store_host: str, store_port: int, rank: int, world_size: int, my_uri: str, *, cluster_id: str,
               agreed: dict[str, object], secret: bytes, timeout_s: float = 60.0) -> Membership:
    """Find every rank's data-plane URI and check all agree on `agreed`, through a TCPStore rank 0 hosts.

    Blocks until all `world_size` ranks have published (bounded by `timeout_s`: RendezvousTimeoutError
    names the missing ranks) and, on rank 0, until all have read the result, so that closing the
    store on return strands nobody. `my_uri` must be the address this rank's transport listens on;
    `secret` (the cluster's) seals every value of the round. `rank` AUTO_RANK: the round assigns it.
    """
    rank, world_size = (rank, _check_int("world_size", world_size, 1)) if rank == AUTO_RANK \
        else _check_world(rank, world_size)
    cluster_id = _check_cluster_id(cluster_id)
    if not isinstance(store_host, str) or not store_host:
        raise MembershipError(f"store_host={store_host!r} must be a host name or address")
    store_port = _check_int("store_port", store_port, 1, 65535)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise MembershipError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    _address(f"rank {rank} my_uri", my_uri)
    agreed = with_protocol(agreed)
    round_ = _Round(store_host, store_port, rank, world_size, cluster_id, float(timeout_s),
                    StoreSeal(secret, cluster_id))
    try:
        return round_.run(my_uri, agreed, cluster_id)
    finally:
        round_.close()
