"""A peer that holds the cluster secret and turns hostile: it completes a real handshake with node 0
as node 1 would, then sends whatever it likes, sealed with the link's own keys. The daemon refuses
(drops the link, naming the peer) or discards what no step can need, fails a step it corrupted on
every node alike naming the peer, and keeps serving the honest job with exact sums."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import node_status, poll_for
from zend.daemon.jobs import job_key, tensor_id
from zend.transport import handshake as hs
from zend.transport import parse_uri
from zend.transport.frames import ABORT, DATA, FRAME, FRAME_VERSION, GOODBYE, HEARTBEAT, MAGIC
from zend.transport.sealing import LinkCipher

pytestmark = pytest.mark.daemon

SETTINGS = settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow], deadline=None)


class HostilePeer:
    """Node 1 as an insider could fake it: a real handshake with node 0 (it knows the secret)."""

    def __init__(self, cluster, rank: int = 1):  # type: ignore[no-untyped-def]
        _, host, port = parse_uri(cluster.peers[0])
        self.sock = socket.create_connection((host, port), timeout=10)
        me = hs.Identity(hs.PROTOCOL_VERSION, "zen", cluster.nodes, 0, rank, "aead")
        cipher = hs.connect_side(self._send, self._recv, me, cluster.secret, 0)
        assert isinstance(cipher, LinkCipher)
        self.cipher = cipher

    def _send(self, message: hs.Message) -> None:
        body = hs.dump(message)
        self.sock.sendall(struct.pack("<I", len(body)) + body)

    def _recv(self) -> hs.Message:
        length = struct.unpack("<I", self._exactly(4))[0]
        return hs.parse(self._exactly(length))

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = self.sock.recv(n - len(data))
            if not more:
                raise ConnectionError("closed")
            data += more
        return data

    def send(self, kind: int, tag: bytes, payload: bytes, announced: int | None = None) -> None:
        """A frame sealed with the link's keys; `announced`: a payload size that lies."""
        header = FRAME.pack(MAGIC, FRAME_VERSION, kind, len(tag), len(payload) if announced is None else announced)
        head = self.cipher.seal_head(header, tag)
        self.sock.sendall(head + b"".join(bytes(r) for r in self.cipher.seal_records(memoryview(payload))))

    def dropped_within(self, seconds: float) -> bool:
        """Whether node 0 closed the link within `seconds` (what a refusal looks like from here)."""
        self.sock.settimeout(seconds)
        try:
            while self.sock.recv(1 << 16):  # its heartbeats, until it closes
                pass
        except TimeoutError:
            return False
        except OSError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


def _plausible_tags(target) -> st.SearchStrategy[bytes]:  # type: ignore[no-untyped-def]
    honest = f"{job_key('honest')}/{tensor_id('honest', 'emb')}"
    steps = st.integers(0, 2**63)
    return st.one_of(
        st.builds(lambda s, a, ph, r: f"{honest}/{s}/{a}/{ph}/{r}".encode(), steps, st.integers(0, 5),
                  st.sampled_from(["push", "pull", "agree", "commit1", "x"]), st.integers(0, 3)),
        st.builds(lambda k, t, s: f"{k}/{t}/{s}/0/agree/0".encode(), st.text("0123456789abcdef", min_size=12,
                                                                           max_size=12), st.integers(0, 2**32), steps),
        st.binary(max_size=236), st.text(max_size=60).map(str.encode).filter(lambda b: len(b) <= 236))


def test_a_hostile_peer_with_the_secret_cannot_stop_or_corrupt_a_daemon(target, tally):
    surface = "data port, a peer with the secret"
    frames = st.lists(st.tuples(st.sampled_from([DATA, DATA, DATA, ABORT, HEARTBEAT, GOODBYE, 0, 9]),
                                _plausible_tags(target), st.binary(max_size=3000),
                                st.one_of(st.none(), st.integers(0, 2**40))), min_size=1, max_size=5)

    @SETTINGS
    @given(sent=frames)
    def attack(sent: list[tuple[int, bytes, bytes, int | None]]) -> None:
        peer = HostilePeer(target.cluster)
        try:
            for kind, tag, payload, announced in sent:
                peer.send(kind, tag, payload, announced)
        except OSError:
            pass  # refused (dropped) part-way: what a refusal looks like
        finally:
            peer.close()
        outcome = "clear" if target.alive() and target.healthy() else "crash"
        tally.count(surface, outcome)
        assert outcome == "clear", sent

    attack()
    _relinked(target)
    target.honest_step(tally, surface)


def test_a_malformed_tag_from_a_peer_drops_its_link_at_once(target, tally):
    peer = HostilePeer(target.cluster)
    try:
        peer.send(DATA, b"not/a/step", b"x" * 100)
        dropped = peer.dropped_within(5.0)
    finally:
        peer.close()
    tally.count("data port, a peer with the secret", "clear" if dropped else "hang")
    assert dropped
    assert _logged(target, lambda line: "refuses" in line and "not a step's tag" in line and "rank 1" in line)


def test_junk_for_steps_no_node_runs_is_discarded_not_buffered(target, tally):
    peer = HostilePeer(target.cluster)
    try:
        honest = f"{job_key('honest')}/{tensor_id('honest', 'emb')}"
        for i in range(200):  # 200 x 64 KiB for a tensor nobody registered, and for steps long done
            peer.send(DATA, f"ffffffffffff/{i}/0/0/push/0".encode(), b"j" * (64 << 10))
            peer.send(DATA, f"{honest}/0/0/push/{i}".encode(), b"j" * (64 << 10))
    except OSError:
        pass  # node 1 dialled again and took its link back: node 0 closed ours, as it does a replaced link
    finally:
        peer.close()
    assert _logged(target, lambda line: "discarded a message from rank 1" in line)
    log = target.cluster.log_path(0).read_text(errors="replace")
    assert "ffffffffffff" not in "".join(line for line in log.splitlines() if "refuses" in line)  # not a refusal
    _relinked(target)
    target.honest_step(tally, "data port, a peer with the secret")


def test_a_corrupt_message_from_a_peer_fails_the_step_on_every_node_naming_the_peer(target, tally):
    """The insider pushes junk for the honest job's next step before the real node 1 does: node 0
    takes the junk, the step fails on both nodes alike, naming rank 1; the retry gets the exact sum.
    Node 1's trainer may submit only after node 0's abort reached node 1: it then joins the redo at once
    (0477c8b: a step opens at the first attempt not aborted anywhere) and sees no failure."""
    for _ in range(3):  # the junk must be read before node 1 dials again and takes its link back
        step = target.next_step()
        honest = f"{job_key('honest')}/{tensor_id('honest', 'emb')}/{step}/0"
        peer = HostilePeer(target.cluster)
        try:
            for phase in ("push", "pull"):
                peer.send(DATA, f"{honest}/{phase}/0".encode(), b"\x07" * 333)
            time.sleep(0.1)  # kept: node 0 reads the junk before we go (no Status shows a peer's mailbox)
        finally:
            peer.close()
        _relinked(target)  # node 1 is back on its own link
        errors = target.honest_step(tally, "data port, a peer with the secret", step=step)
        if errors:
            break
    # the first attempt failed on node 0, and alike on node 1 if its trainer had submitted it; the retry got
    # the sum (honest_step checks it on both)
    assert [e.split(" attempt")[0] for e in errors] in (["node 0", "node 1"], ["node 0"]), errors
    assert all(e.startswith(f"node {n} attempt 0: ") for n, e in enumerate(errors)), errors
    codes = {e.split(": ")[1] for e in errors}
    assert len(codes) == 1 and all("rank 1" in e for e in errors), errors


def test_a_huge_frame_no_step_needs_drops_the_link_without_taking_memory(target, tally):
    """A frame for a tensor nobody registered, announcing 16 GiB: refused at its tag, nothing allocated."""
    rss_before = _rss(target.cluster.procs[0].pid)
    peer = HostilePeer(target.cluster)
    try:
        peer.send(DATA, b"ffffffffffff/1/0/0/push/0", b"x" * 1000, announced=16 << 30)
        dropped = peer.dropped_within(5.0)
    finally:
        peer.close()
    tally.count("data port, a peer with the secret", "clear" if dropped else "hang")
    assert dropped and _rss(target.cluster.procs[0].pid) < rss_before + (256 << 20)
    assert _logged(target, lambda line: "refuses" in line and "job key ffffffffffff" in line
                   and str(16 << 30) in line)
    _relinked(target)
    target.honest_step(tally, "data port, a peer with the secret")


def test_an_abort_for_a_whole_job_is_refused(target, tally):
    """An abort voids every message under its prefix, wherever it is replayed: a peer may name one
    attempt of one step, never a job or a tensor."""
    peer = HostilePeer(target.cluster)
    try:
        body = json.dumps({"code": "ABORTED", "reason": "all of it"}).encode()
        peer.send(ABORT, f"{job_key('honest')}/".encode(), body)
        dropped = peer.dropped_within(5.0)
    finally:
        peer.close()
    tally.count("data port, a peer with the secret", "clear" if dropped else "hang")
    assert dropped
    assert _logged(target, lambda line: "is not one step's attempt" in line and "'" + job_key("honest") in line)
    _relinked(target)
    target.honest_step(tally, "data port, a peer with the secret")  # the job's steps are not void


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def _logged(target, wanted, within_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    """Whether node 0's log gets a line `wanted` accepts (a refusal is logged just after the link closes)."""
    def seen() -> bool:
        return any(wanted(line) for line in target.cluster.log_path(0).read_text(errors="replace").splitlines())

    try:
        return poll_for(seen, within_s, "a log line on node 0", interval_s=0.1)
    except AssertionError:
        return False


def _relinked(target) -> None:  # type: ignore[no-untyped-def]
    """Wait until node 1 has dialled node 0 again once the hostile links are gone: both see the link up."""
    c = target.cluster
    poll_for(lambda: all(p.connected for n in range(c.nodes) for p in node_status(c, n).peers), 30,
             "nodes 0 and 1 linked to each other again", interval_s=0.1)
