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

Nothing read from the store is trusted unless a member sealed it (store_seal.py): torch's state
blob (a pickle) reaches the handler only with a valid MAC, and members' entries are MACed and
parsed to an exact schema (member_entry.py). The generation is not a counter in the store (a
stranger could set it): each member publishes the highest generation it has been in, and the
round's generation is one more than the highest of its members', so a store that restarts empty
does not count from 1 again while any member lives.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from zend.daemon import member_entry
from zend.daemon.membership import (
    Membership,
    MembershipError,
    RendezvousTimeoutError,
    bound_store_socket,
    check_agreement,
    check_unique,
    first_line,
    with_protocol,
)
from zend.daemon.round_store import RendezvousTls, open_rounds
from zend.daemon.store_seal import StoreSeal

POLL_S = 0.02
log = logging.getLogger("zend.membership")
LOOK_EVERY_S = 1.0  # while waiting for a round's entries: how often to look whether the round is still worth it
STORE_OP_S = 10.0  # a store operation that takes longer failed (the store is down or a key never came)
RECONNECT_S = 2.0  # one try at reaching a store that went away
# a round's join window is never shorter: daemons retrying with backoff (daemon.py caps it at 10 s) always
# meet inside one window; with a window of 1 s (--connect-timeout-s 1) they would meet about one try in eight
JOIN_WINDOW_MIN_S = 20.0
KEEP_ALIVE_S = 1  # torch's heartbeat period (whole seconds); a member is dead after max(3, peer_timeout_s) s
# of silence: torch skips a beat that comes a hair early, so one beat may take two periods


class ElasticRendezvous:
    """This daemon's place in the elastic rendezvous `cluster_id` at `address`: a TCPStore's HOST:PORT, or
    etcd://HOST:PORT,... of an etcd cluster (round_store.py)."""

    def __init__(self, address: str, rank: int, world_size: int, my_uri: str, *, cluster_id: str,
                 agreed: dict[str, object], dead_after_s: float, timeout_s: float, secret: bytes,
                 min_nodes: int = 0, tls: RendezvousTls | None = None):
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

        # torch would start a second TCPStore on rank 0 for the workers' bootstrap: zen has no use for it
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        self.rank, self.world_size, self.my_uri = rank, world_size, my_uri
        self.min_nodes = min_nodes or world_size  # below world_size: a round may form without lost nodes
        self.dead_after_s = KEEP_ALIVE_S * max(3, math.ceil(dead_after_s / KEEP_ALIVE_S))
        self.cluster_id, self.agreed = cluster_id, with_protocol(agreed)
        self.seal = StoreSeal(secret, cluster_id)
        self.rounds = open_rounds(address, cluster_id, self.seal, tls or RendezvousTls())
        self.where = self.rounds.where
        self.timeout_s = max(timeout_s, JOIN_WINDOW_MIN_S)  # how long a round and its entries are waited for
        self.generation_seen = 0  # the highest generation this daemon has been in
        self.round = -1  # torch's round this daemon joined last
        self._seen: Any = None  # that round's state as last seen intact (what a lost state is written back as)
        self._store: Any = self._connect(timeout_s)
        backend = self.rounds.backend(lambda: self._store)
        self._handler = DynamicRendezvousHandler.from_backend(
            f"zen-{cluster_id}", self._store, backend, self.min_nodes, world_size, local_addr=_host_of(my_uri),
            # last call: with --min-nodes, how long a round that could form waits for the rest (a slow start)
            timeout=RendezvousTimeout(join=timedelta(seconds=self.timeout_s),
                                      last_call=timedelta(seconds=self.dead_after_s), close=timedelta(seconds=10)),
            keep_alive_interval=KEEP_ALIVE_S, keep_alive_max_attempt=round(self.dead_after_s / KEEP_ALIVE_S))
        self._lock = threading.Lock()  # the handler is not meant for two threads at once

    def _connect(self, timeout_s: float) -> Any:
        """A client of the store, tried for up to `timeout_s`; its operations time out after STORE_OP_S (a
        read of a key that never comes, such as torch's bootstrap address from a frozen member, must not
        hold a round for the whole join timeout)."""
        try:
            return self.rounds.connect(timeout_s, STORE_OP_S)
        except RendezvousTimeoutError as exc:
            raise RendezvousTimeoutError(f"rank {self.rank} {exc}") from None

    def _reconnect(self) -> None:
        """A fresh connection to the store (torch's TCPStore client does not come back after its server restarts),
        for the handler and the backend alike; MembershipError if the store does not answer."""
        self._store = self._connect(RECONNECT_S)
        self._handler._store = self._store  # the store torch derives each round's store from

    def _with_store(self, op: Any) -> Any:
        """`op()`, once more on a fresh connection if the connection failed it (a restarted `zend store`)."""
        from torch.distributed import DistNetworkError
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            return op()
        except (RendezvousConnectionError, DistNetworkError):
            self._reconnect()
            return op()

    def join(self, job_steps: dict[str, int] | None = None) -> Membership:
        """Leave the current round (if in one) and join the next; the membership of that round.

        Blocks until `world_size` daemons are in it, or `min_nodes` and dead_after_s have passed (a member
        that died counts until its heartbeats have been silent for dead_after_s);
        RendezvousTimeoutError after `timeout_s`."""
        from torch.distributed.elastic.rendezvous import RendezvousError

        store_errors: tuple[type[BaseException], ...] = (RuntimeError, *self.rounds.errors)  # torch's, python-etcd's
        with self._lock:
            try:
                info = self._with_store(self._handler.next_rendezvous)
                membership = self._publish(info.store, info.rank, info.world_size, job_steps or {})
                if info.rank == 0:
                    self._forget_old_rounds()
                return membership
            except RendezvousError as exc:
                raise RendezvousTimeoutError(f"rank {self.rank}: no complete round of {self.min_nodes}-"
                                             f"{self.world_size} nodes at {self.where} within {self.timeout_s:g}s: "
                                             f"{first_line(exc)}") from None
            except store_errors as exc:
                raise MembershipError(f"rank {self.rank}: the rendezvous store at {self.where} failed: "
                                      f"{first_line(exc)}") from None

    def _forget_old_rounds(self) -> None:
        """(the first member of a round that formed) Delete what rounds before the previous one left in the
        store; the previous one's stay for a member still reading them. A failure costs only space."""
        try:
            gone = self.rounds.forget_rounds_before(self.round - 1)
        except Exception as exc:
            log.warning("could not delete old rounds' keys at %s: %s", self.where, first_line(exc))
            return
        if gone:
            log.info("deleted %d keys of rounds before %d at %s", gone, self.round - 1, self.where)

    def waiting(self) -> int:
        """Daemons waiting to join (a restarted one): the members should `join` the next round."""
        with self._lock:
            try:
                return int(self._with_store(self._handler.num_nodes_waiting))
            except Exception as exc:
                raise MembershipError(f"rank {self.rank} lost the rendezvous store at {self.where}: "
                                      f"{first_line(exc)}") from None

    def round_intact(self) -> bool:
        """False once the members have moved past the round this daemon joined (it then joins the next
        one too); True while that round stands.

        A state that went back (deleted, refused garbage, a store restarted empty, an older state written
        again: an earlier round, or ours incomplete, since torch keeps a round complete while anyone is in
        it) is written back as this daemon last saw it, its members' heartbeats as of now (they could not
        beat into a state that was gone; a member that really died is found by the data plane, and by the
        rendezvous once its beats stop again), so that the running generation needs nothing new from the
        store; if another writer wins that race, the next poll looks again. A member dropped from
        its round for standing still (SIGSTOP) finds the round standing and goes on in its generation."""
        with self._lock:
            try:
                holder = self._handler._state_holder  # torch keeps no public view of the round
                self._with_store(holder.sync)
                state = holder.state
                if state.round > self.round:
                    return False
                if state.round == self.round and state.complete:
                    self._seen = copy.deepcopy(state)  # fresh heartbeats: what a write-back restores
                elif self._seen is not None:
                    log.warning("rendezvous state lost; writing back the last one seen", extra={
                        "event": "rendezvous_restored", "round": self.round, "found_round": state.round})
                    restored = copy.deepcopy(self._seen)
                    now = datetime.now(UTC)  # torch's clock: while the state was gone nobody could
                    restored.last_heartbeats = {node: now for node in restored.last_heartbeats}  # beat in it
                    holder._state = restored
                    holder.mark_dirty()
                    holder.sync()
                return True
            except Exception as exc:
                raise MembershipError(f"rank {self.rank} lost the rendezvous store at {self.where}: "
                                      f"{first_line(exc)}") from None

    def _publish(self, store: Any, slot: int, members: int, job_steps: dict[str, int]) -> Membership:
        """Within one round's store: every member's sealed entry (URI, settings, --rank, job steps and the
        highest generation it has been in), read back once all are there and valid.

        Members publish under the handler's rank (`slot`, 0..members-1); zen ranks are their --ranks in
        order, so with every node present each keeps its own, and a smaller generation (--min-nodes)
        numbers its members 0..members-1 in the same order. An entry that is absent, refused (not sealed
        with the secret) or off the schema is waited for; a member rewrites its own while it waits, so a
        stranger's overwrite does not stall the round."""
        deadline = time.monotonic() + self.timeout_s
        round_ = self.round = self._handler._state_holder.state.round
        self._seen = copy.deepcopy(self._handler._state_holder.state)
        label = f"zen-{self.cluster_id}/round/{round_}/member/{{}}"
        mine = self.seal.seal(label.format(slot), member_entry.MemberEntry(
            self.rank, self.my_uri, self.agreed, job_steps, self.generation_seen).encode())
        keys = [f"zen/member/{i}" for i in range(members)]
        entries: dict[int, member_entry.MemberEntry] = {}
        problems: dict[int, str] = {}
        next_look = time.monotonic() + LOOK_EVERY_S
        while True:
            if store.check([keys[slot]]) is False or store.get(keys[slot]) != mine:
                store.set(keys[slot], mine)
            present = [i for i in range(members) if i not in entries and store.check([keys[i]])]
            for i in present:
                payload = self.seal.open_value(label.format(i), store.get(keys[i]))
                if payload is None:
                    problems[i] = "its entry is not sealed with the cluster secret"
                    continue
                try:
                    entries[i] = member_entry.parse(payload, self.world_size)
                except member_entry.EntryError as exc:
                    problems[i] = f"its entry is refused: {exc}"
            if len(entries) == members:
                break
            if time.monotonic() >= next_look:  # a member that died before publishing stalls nobody long
                next_look = time.monotonic() + LOOK_EVERY_S
                over = self._round_over(round_, members)
                if over is not None:
                    missing = sorted(set(range(members)) - set(entries))
                    raise RendezvousTimeoutError(f"round {round_} at {self.where}: members {missing} published no "
                                                 f"entry and {over}: joining the next round")
            if time.monotonic() > deadline:
                missing = sorted(set(range(members)) - set(entries))
                why = "; ".join(f"member {i}: {problems.get(i, 'no entry')}" for i in missing)
                raise RendezvousTimeoutError(f"round {round_} at {self.where}: not every one of {members} members "
                                             f"published a valid entry within {self.timeout_s:g}s ({why})")
            time.sleep(POLL_S)
        generation = 1 + max(e.generation for e in entries.values())
        by_rank: dict[int, member_entry.MemberEntry] = {}
        steps: dict[str, int] = {}
        for e in entries.values():
            if e.rank in by_rank:
                raise MembershipError(f"--rank {e.rank} is claimed by two daemons in generation {generation} at "
                                      f"{self.where}: {by_rank[e.rank].uri!r} and {e.uri!r}")
            by_rank[e.rank] = e
            for job, step in e.job_steps.items():  # a restarted member knows none
                steps[job] = max(steps.get(job, 0), step)
        order = sorted(by_rank)
        uris = {i: by_rank[r].uri for i, r in enumerate(order)}
        check_unique(uris, "member {}")
        check_agreement({i: by_rank[r].agreed for i, r in enumerate(order)})
        self.generation_seen = generation
        return Membership(rank=order.index(self.rank), world_size=members, peers=uris, generation=generation,
                          cluster_id=self.cluster_id, agreed=by_rank[order[0]].agreed, source=f"elastic {self.where}",
                          members=tuple(order), job_steps=steps)

    def _round_over(self, round_: int, members: int) -> str | None:
        """(under _lock, while publishing) Why the members of `round_` should not wait for its entries any
        longer, or None: the store moved on, a daemon waits to join (a member that died and restarted), or a
        member's heartbeats stopped (it died, or stands still, before it published)."""
        holder = self._handler._state_holder  # torch keeps no public view of the round
        self._with_store(holder.sync)
        state = holder.state
        if state.round != round_:
            return f"the rendezvous is at round {state.round} now"
        if state.wait_list or state.redundancy_list:  # a restart that came while its dead self is a member
            return f"{len(state.wait_list) + len(state.redundancy_list)} daemon(s) wait to join"
        if len(state.participants) < members:  # torch dropped them: their heartbeats stopped
            return f"{members - len(state.participants)} member(s) left it (no heartbeat for {self.dead_after_s:g} s)"
        now = datetime.now(UTC)
        silent = [node for node in state.participants
                  if (now - state.last_heartbeats.get(node, now)).total_seconds() > self.dead_after_s]
        if silent:
            return f"{len(silent)} member(s) sent no heartbeat for {self.dead_after_s:g} s"
        return None

    def close(self) -> None:
        """Stop heartbeating; our entry expires and the others' next round goes on without us. Not under
        the lock: a `join` in progress may hold it for its whole timeout (the daemon is stopping)."""
        self._handler._stop_heartbeats()  # torch has no public "leave" but shutdown, which closes it for all


def _host_of(uri: str) -> str:
    from zend.transport import parse_uri

    return parse_uri(uri)[1]


def serve_store(host: str, port: int, stop: threading.Event, ready: Any = None) -> None:
    """Host the TCPStore an elastic cluster's rounds live in, until `stop` (`zend store`), listening on
    `host` alone (torch's own server would listen on every interface)."""
    from torch.distributed import TCPStore

    # the store takes the listening descriptor over, and closes it when it goes
    store = TCPStore(host, port, None, True, timedelta(seconds=30), wait_for_workers=False,
                     master_listen_fd=bound_store_socket(host, port).detach())
    try:
        if ready is not None:
            ready()
        stop.wait()
    finally:
        del store
