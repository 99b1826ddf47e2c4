"""Membership that can change: one generation per round of torch's elastic rendezvous.

The rounds, keep-alive heartbeats, join and leave are torch's (`DynamicRendezvousHandler`, the
c10d backend over a TCPStore, as torchrun's `--rdzv-backend c10d` uses); this module adds what
zen needs on top: each round's members publish their data-plane URI, zen rank and settings in
that round's store, and the round is a new *generation* (a counter in the store, bumped once
per round). A daemon that restarts calls `join` and lands on the handler's wait list; the
members see `waiting() > 0`, leave their round and `join` again, and torch starts the next
round once every member has left or its heartbeats stopped. Links of the old generation are
refused by the data-plane handshake, which carries the generation.

The store must outlive any one daemon (`zend store`, or torchrun's agent store): a round needs
it. zen ranks are the daemons' own (`--rank`), not the handler's (it sorts by host and pid,
which changes on a restart); two daemons claiming one rank in a round are refused.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from datetime import timedelta
from typing import Any

from zend.daemon.membership import (
    Membership,
    MembershipError,
    RendezvousTimeoutError,
    check_agreement,
    check_unique,
    first_line,
    with_protocol,
)

POLL_S = 0.02
KEEP_ALIVE_S = 1  # torch's heartbeat period (whole seconds); a member is dead after max(3, peer_timeout_s) s
# of silence: torch skips a beat that comes a hair early, so one beat may take two periods


class ElasticRendezvous:
    """This daemon's place in the elastic rendezvous `cluster_id` at the TCPStore `host:port`."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, my_uri: str, *, cluster_id: str,
                 agreed: dict[str, object], dead_after_s: float, timeout_s: float, min_nodes: int = 0):
        from torch.distributed import DistError, TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

        # torch would start a second TCPStore on rank 0 for the workers' bootstrap: zen has no use for it
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        self.rank, self.world_size, self.my_uri = rank, world_size, my_uri
        self.min_nodes = min_nodes or world_size  # below world_size: a round may form without lost nodes
        self.dead_after_s = KEEP_ALIVE_S * max(3, math.ceil(dead_after_s / KEEP_ALIVE_S))
        self.cluster_id, self.agreed = cluster_id, with_protocol(agreed)
        self.where = f"tcpstore://{host}:{port} (elastic)"
        self.timeout_s = timeout_s
        self._store: Any = None
        try:
            self._store = TCPStore(host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)
        except DistError as exc:
            raise RendezvousTimeoutError(f"rank {rank} could not reach the rendezvous store at {self.where} within "
                                         f"{timeout_s:g}s (is `zend store` running there?): "
                                         f"{first_line(exc)}") from None
        backend = C10dRendezvousBackend(self._store, f"zen-{cluster_id}")
        self._handler = DynamicRendezvousHandler.from_backend(
            f"zen-{cluster_id}", self._store, backend, self.min_nodes, world_size, local_addr=_host_of(my_uri),
            # last call: with --min-nodes, how long a round that could form waits for the rest (a slow start)
            timeout=RendezvousTimeout(join=timedelta(seconds=timeout_s), last_call=timedelta(seconds=self.dead_after_s),
                                      close=timedelta(seconds=10)),
            keep_alive_interval=KEEP_ALIVE_S, keep_alive_max_attempt=round(self.dead_after_s / KEEP_ALIVE_S))
        self._lock = threading.Lock()  # the handler is not meant for two threads at once

    def join(self, job_steps: dict[str, int] | None = None) -> Membership:
        """Leave the current round (if in one) and join the next; the membership of that round.

        Blocks until `world_size` daemons are in it, or `min_nodes` and dead_after_s have passed (a member
        that died counts until its heartbeats have been silent for dead_after_s);
        RendezvousTimeoutError after `timeout_s`."""
        from torch.distributed.elastic.rendezvous import RendezvousError

        with self._lock:
            try:
                info = self._handler.next_rendezvous()
                return self._publish(info.store, info.rank, info.world_size, job_steps or {})
            except RendezvousError as exc:
                raise RendezvousTimeoutError(f"rank {self.rank}: no complete round of {self.min_nodes}-"
                                             f"{self.world_size} nodes at {self.where} within {self.timeout_s:g}s: "
                                             f"{first_line(exc)}") from None
            except RuntimeError as exc:  # torch's store errors (DistStoreError, DistNetworkError)
                raise MembershipError(f"rank {self.rank}: the rendezvous store at {self.where} failed: "
                                      f"{first_line(exc)}") from None

    def waiting(self) -> int:
        """Daemons waiting to join (a restarted one): the members should `join` the next round."""
        with self._lock:
            try:
                return int(self._handler.num_nodes_waiting())
            except Exception as exc:
                raise MembershipError(f"rank {self.rank} lost the rendezvous store at {self.where}: "
                                      f"{first_line(exc)}") from None

    def _publish(self, store: Any, slot: int, members: int, job_steps: dict[str, int]) -> Membership:
        """Within one round's store: the generation, then every member's URI, settings and --rank.

        Members publish under the handler's rank (`slot`, 0..members-1); zen ranks are their
        --ranks in order, so with every node present each keeps its own, and a smaller generation
        (--min-nodes) numbers its members 0..members-1 in the same order."""
        deadline = time.monotonic() + self.timeout_s
        if slot == 0:  # one member per round bumps the cluster's generation counter
            generation = int(self._store.add(f"zen/{self.cluster_id}/generation", 1))
            store.set("zen/generation", str(generation))
        generation = int(store.get("zen/generation"))
        store.set(f"zen/member/{slot}", json.dumps({"uri": self.my_uri, "agreed": self.agreed, "rank": self.rank,
                                                    "job_steps": job_steps}, sort_keys=True))
        keys = [f"zen/member/{i}" for i in range(members)]
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(f"generation {generation} at {self.where}: not every one of {members} "
                                             f"members published within {self.timeout_s:g}s")
            time.sleep(POLL_S)
        by_rank: dict[int, tuple[str, dict[str, object]]] = {}
        steps: dict[str, int] = {}
        for raw in store.multi_get(keys):
            try:
                entry = json.loads(raw)
                rank, uri, agreed = int(entry["rank"]), str(entry["uri"]), dict(entry["agreed"])
                for job, step in dict(entry.get("job_steps", {})).items():  # a restarted member knows none
                    steps[str(job)] = max(steps.get(str(job), 0), int(step))
            except (ValueError, KeyError, TypeError):
                raise MembershipError(f"a member published an unreadable entry {raw[:200]!r} at {self.where} "
                                      "(a different zend version?)") from None
            if rank in by_rank:
                raise MembershipError(f"--rank {rank} is claimed by two daemons in generation {generation} at "
                                      f"{self.where}: {by_rank[rank][0]!r} and {uri!r}")
            by_rank[rank] = (uri, agreed)
        order = sorted(by_rank)
        uris = {i: by_rank[r][0] for i, r in enumerate(order)}
        check_unique(uris, "member {}")
        check_agreement({i: by_rank[r][1] for i, r in enumerate(order)})
        return Membership(rank=order.index(self.rank), world_size=members, peers=uris, generation=generation,
                          cluster_id=self.cluster_id, agreed=by_rank[order[0]][1], source=f"elastic {self.where}",
                          members=tuple(order), job_steps=steps)

    def close(self) -> None:
        """Stop heartbeating; our entry expires and the others' next round goes on without us. Not under
        the lock: a `join` in progress may hold it for its whole timeout (the daemon is stopping)."""
        self._handler._stop_heartbeats()  # torch has no public "leave" but shutdown, which closes it for all


def _host_of(uri: str) -> str:
    from zend.transport import parse_uri

    return parse_uri(uri)[1]


def serve_store(host: str, port: int, stop: threading.Event, ready: Any = None) -> None:
    """Host the TCPStore an elastic cluster's rounds live in, until `stop` (`zend store`)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, None, True, timedelta(seconds=30), wait_for_workers=False)
    try:
        if ready is not None:
            ready()
        stop.wait()
    finally:
        del store
