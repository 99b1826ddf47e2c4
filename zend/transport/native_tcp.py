"""tcp:// with the native engine on the wire: Python dials, authenticates and keeps membership; the engine
(`zend._engine`, C++) owns every authenticated link's bytes.

What moves to the engine: framing, sealing and opening (AES-256-GCM through OpenSSL), the receive loop
(one epoll thread for every link), the mailboxes and their backpressure, heartbeats, the watchdog and our
own stalls, aborts and their replay to a reconnected peer, and the admission of each frame by its tag (the
daemon tells the engine each tensor's last step: no Python call per frame). What stays in Python
(tcp.py, peer_links.py, handshake.py): listening, dialling and redialling, the handshake and its keys.
A send, a recv, or a whole round (`exchange`) crosses into the engine once, with the GIL released while
it waits. The wire format is the Python transport's, so a native node and a Python node interoperate.

The engine's events come back on one thread (`_events_loop`): a link it dropped is failed here too, so
PeerLinks redials and states say why; a stall it saw is logged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch

from zend.core.comm import CommAborted, CommError, CommTimeout
from zend.transport.engine_choice import load_native
from zend.transport.link_transport import MAX_DISCARDED_BYTES
from zend.transport.receive_pool import PoolStats
from zend.transport.sealing import LinkCipher
from zend.transport.tcp import TcpTransport

log = logging.getLogger("zend.transport")
_EVENT_WAIT_S = 0.2


def _host_bytes(payload: torch.Tensor) -> Any:
    """A payload's bytes as a buffer the engine reads (host memory: tcp:// stages GPU tensors through it)."""
    if payload.dtype is not torch.uint8 or not payload.is_contiguous():
        payload = payload.contiguous().view(torch.uint8)
    if payload.is_cuda:
        payload = payload.cpu()
    return payload.numpy()


def _tensor(message: Any) -> torch.Tensor:
    """A received message as a 1-D uint8 tensor over the engine's memory (no copy; the memory returns to
    the engine's pool once the tensor is gone)."""
    if len(message) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(message, dtype=torch.uint8)


class NativeTcpTransport(TcpTransport):
    engine_name = "native"

    def __init__(self, rank: int, world_size: int, **options: Any):
        super().__init__(rank, world_size, **options)
        native, why = load_native()
        if native is None:
            raise RuntimeError(why)
        self._native = native
        self.engine = native.Engine(rank, world_size, max_buffered_bytes=self.mailboxes.max_buffered_bytes,
                                    max_message_bytes=self.max_message_bytes, peer_timeout_s=self.timeout_s,
                                    heartbeat_s=self.liveness.heartbeat_s, max_discarded_bytes=MAX_DISCARDED_BYTES)
        self._held: dict[int, tuple[int, Any]] = {}  # peer -> (serial, socket) of the link the engine holds

    # ------------------------------------------------------------------ admission: judged in the engine
    def judge_in_engine(self, step_window: int, max_agreement_bytes: int) -> None:
        """Judge frames in the engine by zend.daemon.admission's table (no Python call per frame; `admission`
        is not asked), from each tensor's last step as `note_last_step` tells it."""
        self.engine.set_admission(True, step_window, max_agreement_bytes)

    def note_last_step(self, job_key: str, tensor: int, last_step: int) -> None:
        with contextlib.suppress(self._native.Closed):  # a generation's engine closed: the next one is told
            self.engine.set_last_step(job_key, tensor, last_step)

    @property
    def discarded_messages(self) -> int:
        return int(self.engine.stats().get("discarded", 0)) if hasattr(self, "engine") else 0

    @discarded_messages.setter
    def discarded_messages(self, value: int) -> None:  # the base class's initial 0
        pass

    @property
    def dropped_messages(self) -> int:
        return int(self.engine.stats().get("dropped", 0))

    # ------------------------------------------------------------------ links: handed to the engine
    def start(self) -> NativeTcpTransport:
        super().start()
        self._spawn(self._events_loop, "engine-events")
        return self

    def link_up(self, j: int, link: Any, cipher: LinkCipher | None, first: bool) -> Exception | None:
        """(PeerLinks, under the peer's send lock) The authenticated socket and its keys go to the engine,
        which replays its recent aborts on it before anything else; Python reads it no more."""
        send_key, recv_key = (cipher.keys if cipher is not None else (None, None))
        # under the condition the events thread takes: the engine may drop the link (a peer that sends
        # junk at once) before attach returns, and its "down" must find the serial it names
        with self._cond:
            try:
                self._prepare_link(link)
                self._held[j] = (self.engine.attach(j, link.fileno(), send_key, recv_key), link)
            except Exception as exc:
                return exc
        return None

    def receive_on(self, j: int, link: Any) -> None:
        """Nothing to start: the engine's thread reads every link."""

    def _events_loop(self) -> None:
        """The engine's news: a dropped link fails its peer here (redial, states); stalls and discards are
        logged as the Python data plane logs them."""
        while not self._closed:
            try:
                events = self.engine.next_events(_EVENT_WAIT_S)
            except self._native.Closed:
                return
            for kind, peer, number, text in events:
                if kind == "down":
                    text = text.removeprefix(f"rank {peer} ")  # PeerLinks names the peer, with its address
                    with self._cond:
                        serial, link = self._held.get(peer, (None, None))
                        link = link if serial == number else None
                    if link is not None:
                        self.links.fail(peer, link, text)
                elif kind == "stall":
                    log.warning("rank %d: the data plane stood still for %s s: peers may have dropped us",
                                self.rank, text)
                elif kind == "discarded":
                    log.warning("rank %d: discarded a message from rank %d (%d so far): %s", self.rank, peer,
                                number, text)

    def _close_link(self, link: Any) -> None:
        with self._cond:
            peers = [j for j, (_, mine) in self._held.items() if mine is link]
            for j in peers:
                del self._held[j]
        for j in peers:
            with contextlib.suppress(self._native.Closed):
                self.engine.detach(j, "link closed")
        super()._close_link(link)
        self.links.link_done(link)

    def close(self) -> None:
        if self._closed:
            return
        self.engine.close()  # goodbye to every peer, links closed, its thread joined
        super().close()

    def stalled_since(self, since: float) -> float | None:
        return self.engine.stalled_since(since)

    def voided(self, prefix: str) -> bool:
        return self.engine.voided(prefix) is not None

    def holds(self, src: int, prefix: str) -> bool:
        return bool(0 <= src < self.world_size and self.engine.holds(src, prefix))

    def mailbox_bytes(self) -> int:
        return int(self.engine.buffered(-1))

    def pool_stats(self) -> PoolStats:
        s = self.engine.stats()
        return PoolStats(reused=s.get("pool_reused", 0), allocated=s.get("pool_allocated", 0),
                         unpooled=s.get("pool_unpooled", 0), pooled_bytes=s.get("pool_bytes", 0))

    def buffered_from(self, src: int) -> int:
        return int(self.engine.buffered(src))

    # ------------------------------------------------------------------ the Communicator, through the engine
    def _error(self, exc: Exception) -> CommError:
        """The engine's error as the Python data plane words it: a lost peer named with its address."""
        if isinstance(exc, self._native.Aborted):
            return CommAborted(exc.reason, exc.code)
        if isinstance(exc, self._native.Closed):
            return CommError(f"rank {self.rank}: transport closed")
        text = str(exc)
        for j, peer in self.peers.items() if isinstance(exc, self._native.LinkDown) else ():
            named = f"rank {j} "
            if peer.address is not None and named in text and f"rank {j} at " not in text:
                text = text.replace(named, f"rank {j} at {peer.address[0]}:{peer.address[1]} ", 1)
                break
        me = f"rank {self.rank}: "
        text = text if text.startswith(me) else me + text  # the engine's words name this rank already
        return CommTimeout(text) if isinstance(exc, self._native.Timeout) else CommError(text)

    def _linked(self, dst: int) -> None:
        """Wait until rank dst's link is up and in the engine: a first connection may still be coming (a
        lost one fails now), and a link PeerLinks has published is handed to the engine under its send lock."""
        peer = self.links.live_link(dst)
        if dst not in self._held:
            with peer.send_lock:
                pass

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        if dst not in self._held:  # once the engine holds a link, it says itself if it is lost
            self._linked(dst)
        try:
            self.engine.send(dst, tag, _host_bytes(payload))
        except self._native.EngineError as exc:
            raise self._error(exc) from None

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        if src not in self.peers:
            raise CommError(f"rank {self.rank}: invalid peer {src} (world size {self.world_size})")
        try:
            return _tensor(self.engine.recv(src, tag, self.timeout_s if timeout_s is None else timeout_s))
        except self._native.EngineError as exc:
            raise self._error(exc) from None

    def exchange(self, sends: Sequence[tuple[int, str, torch.Tensor]], recvs: Sequence[tuple[int, str]],
                 timeout_s: float | None = None) -> list[torch.Tensor]:
        """One round in one call into the engine: every send queued, then every receive awaited."""
        for dst in {dst for dst, _, _ in sends if dst not in self._held}:
            self._linked(dst)
        for src, _ in recvs:
            if src not in self.peers:
                raise CommError(f"rank {self.rank}: invalid peer {src} (world size {self.world_size})")
        views = [(dst, tag, _host_bytes(payload)) for dst, tag, payload in sends]
        try:
            got = self.engine.exchange(views, list(recvs), self.timeout_s if timeout_s is None else timeout_s)
        except self._native.EngineError as exc:
            raise self._error(exc) from None
        return [_tensor(m) for m in got]

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        self.engine.abort(prefix, code, reason)
