"""Membership on a replicated engine (`--elastic 1 --rendezvous etcd://H:P,H:P,H:P`): a three-member etcd
cluster (Debian's etcd-server 3.4, v2 API) holds the elastic rounds, so no single store process is the
cluster's to lose. With one etcd member killed a daemon killed -9 still rejoins in a new generation; with
every etcd member gone the running generation steps on; and a state blob that no member sealed (a
stranger's pickle written straight into etcd) is never unpickled."""

from __future__ import annotations

import base64
import contextlib
import json
import pickle
import shutil
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zen

from tests.certificates import Ca
from tests.helpers import random_grad, run_all
from zend.cluster.local import LocalCluster, free_port

ETCD = shutil.which("etcd")
pytestmark = [pytest.mark.daemon,
              pytest.mark.skipif(ETCD is None, reason="no etcd (Debian's etcd-server: .ci/run installs it)")]

EXTRA = ["--peer-timeout-s", "2", "--step-timeout-s", "60", "--log-format", "text", "--connect-timeout-s", "60"]
ROWS, WIDTH = 200, 4


class EtcdCluster:
    """Three etcd members on loopback, each in a process of its own (v2 API on)."""

    def __init__(self, workdir: Path, members: int = 3, tls: Ca | None = None):
        self.ports = [(free_port(), free_port()) for _ in range(members)]
        initial = ",".join(f"e{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(self.ports))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.scheme, secured = "http", []
        self.client_tls: tuple[str, ...] = ()
        if tls is not None:  # clients must show a certificate the CA signed (--client-cert-auth)
            (workdir / "ca.pem").write_bytes(tls.pem())
            tls.issue(workdir / "etcd.pem", workdir / "etcd.key")
            tls.issue(workdir / "client.pem", workdir / "client.key")
            self.scheme = "https"
            secured = ["--cert-file", str(workdir / "etcd.pem"), "--key-file", str(workdir / "etcd.key"),
                       "--trusted-ca-file", str(workdir / "ca.pem"), "--client-cert-auth=true"]
            self.client_tls = (str(workdir / "ca.pem"), str(workdir / "client.pem"), str(workdir / "client.key"))
        for i, (client, peer) in enumerate(self.ports):
            log = open(workdir / f"etcd{i}.log", "wb")  # noqa: SIM115 (the child owns it)
            assert ETCD is not None
            self.procs.append(subprocess.Popen(
                [ETCD, "--name", f"e{i}", "--data-dir", str(workdir / f"etcd{i}"),
                 "--listen-client-urls", f"{self.scheme}://127.0.0.1:{client}",
                 "--advertise-client-urls", f"{self.scheme}://127.0.0.1:{client}", *secured,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", "zen-test", "--enable-v2=true"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + 60
        for client, _ in self.ports:
            while not self.healthy(client, self.client_tls):
                assert time.monotonic() < deadline, "the etcd cluster did not become healthy within 60 s"
                time.sleep(0.2)

    @staticmethod
    def healthy(client: int, tls: tuple[str, ...] = ()) -> bool:
        context = None
        if tls:
            context = ssl.create_default_context(cafile=tls[0])
            context.load_cert_chain(tls[1], tls[2])
        url = f"{'https' if tls else 'http'}://127.0.0.1:{client}/health"
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=2, context=context) as r:
            return bool(json.loads(r.read()).get("health") == "true")
        return False

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{client}" for client, _ in self.ports)

    def kill(self, member: int) -> None:
        proc = self.procs[member]
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def close(self) -> None:
        for member in range(len(self.procs)):
            self.kill(member)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()


def grad(step: int, node: int) -> torch.Tensor:
    return random_grad(ROWS, WIDTH, 1000 * step + node).to_torch_sparse()


def expected(step: int) -> torch.Tensor:
    return sum(random_grad(ROWS, WIDTH, 1000 * step + n).to_dense() for n in range(2))  # type: ignore[return-value]


def client(c: LocalCluster, node: int) -> zen.Client:
    return zen.Client(c.socket_dir(node), job="j", token=c.token("j"), local_rank=0, local_world_size=1,
                      timeout_s=60)


def step_all(trainers: list[zen.Client], step: int) -> None:
    outs = run_all([lambda z=z, n=n: z.allreduce(grad(step, n), name="emb", step=step)
                    for n, z in enumerate(trainers)])
    for out in outs:
        assert isinstance(out, torch.Tensor), out
        torch.testing.assert_close(out.to_dense(), expected(step))


def test_daemons_rejoin_over_etcd_with_a_member_down_and_step_on_with_none(etcd: EtcdCluster, tmp_path: Path):
    c = LocalCluster(2, tmp_path / "c", elastic=True, extra=EXTRA)
    c.store = etcd.address  # no `zend store`: the rounds live in etcd
    trainers: list[zen.Client] = []
    try:
        for node in range(2):
            c.start_node(node)
        for node in range(2):
            c.wait_ready(node, 90)
        trainers = [client(c, n) for n in range(2)]
        step_all(trainers, 0)
        first = trainers[0].generation

        etcd.kill(0)  # one member of three: etcd keeps its quorum
        c.kill(1)
        c.start_node(1)
        for node in range(2):
            c.wait_ready(node, 90)
        trainers[1].close()
        trainers[1] = client(c, 1)
        trainers[0].wait_ready(60)  # the new generation: node 0 left its old one for it
        assert trainers[0].generation > first and trainers[1].generation == trainers[0].generation
        step_all(trainers, 1)

        etcd.kill(1)
        etcd.kill(2)  # no etcd at all: the running generation needs nothing from it
        for step in (2, 3):
            step_all(trainers, step)
        assert all(c.procs[n].poll() is None for n in range(2)), c.log_tail(0)
    finally:
        for z in trainers:
            z.close()
        c.close()


def test_daemons_reach_an_etcd_that_asks_for_client_certificates_and_one_without_is_refused(tmp_path: Path):
    from zend.daemon.elastic import ElasticRendezvous
    from zend.daemon.membership import RendezvousTimeoutError
    from zend.daemon.round_store import RendezvousTls

    etcd = EtcdCluster(tmp_path, tls=Ca())
    ca, cert, key = etcd.client_tls
    c = LocalCluster(2, tmp_path / "c", elastic=True, extra=[*EXTRA, "--rendezvous-tls-ca-file", ca,
                                                             "--rendezvous-tls-cert-file", cert,
                                                             "--rendezvous-tls-key-file", key])
    c.store = etcd.address
    trainers: list[zen.Client] = []
    try:
        with pytest.raises(RendezvousTimeoutError, match="could not reach any etcd member"):  # no certificate
            ElasticRendezvous(etcd.address, 0, 2, "tcp://127.0.0.1:7000", cluster_id="zen", agreed={},
                              dead_after_s=3.0, timeout_s=5.0, secret=b"s" * 32, tls=RendezvousTls(ca_file=ca))
        for node in range(2):
            c.start_node(node)
        for node in range(2):
            c.wait_ready(node, 90)
        trainers = [client(c, n) for n in range(2)]
        step_all(trainers, 0)
    finally:
        for z in trainers:
            z.close()
        c.close()
        etcd.close()


def test_a_state_blob_no_member_sealed_is_never_unpickled(etcd: EtcdCluster, tmp_path: Path):
    """Whoever can write to etcd writes a pickle that would run code into torch's state key; the members
    read it as an empty rendezvous, write theirs over it, and form their generation."""
    import etcd as python_etcd

    from zend.daemon.elastic import ElasticRendezvous

    marker = tmp_path / "pwned"
    evil = base64.b64encode(pickle.dumps(_Evil(str(marker)))).decode()
    client_port = etcd.ports[0][0]
    python_etcd.Client(host="127.0.0.1", port=client_port).write("/zen/c/rdzv/zen-c", evil)

    def member(rank: int) -> ElasticRendezvous:
        return ElasticRendezvous(etcd.address, rank, 2, f"tcp://127.0.0.1:{7000 + rank}", cluster_id="c",
                                 agreed={}, dead_after_s=3.0, timeout_s=60.0, secret=b"s" * 32)

    members = [member(0), member(1)]
    joined: dict[int, object] = {}
    try:
        threads = [threading.Thread(target=lambda r=r: joined.setdefault(r, members[r].join())) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not marker.exists(), "a state blob nobody sealed was unpickled"
        assert len(joined) == 2, joined
        assert joined[0].generation == joined[1].generation == 1  # type: ignore[attr-defined]
    finally:
        for m in members:
            m.close()


def test_old_rounds_keys_are_deleted_so_reads_do_not_grow_with_every_generation(etcd: EtcdCluster):
    """torch's EtcdStore lists its whole directory at every read: the keys of every round a cluster ever
    formed would be listed at every poll of every later round. The first member of a round that forms
    deletes those of rounds before the previous one (which a slow member may still read); keys that are
    not a round's stay."""
    import etcd as python_etcd

    from zend.daemon.elastic import ElasticRendezvous

    raw = python_etcd.Client(host="127.0.0.1", port=etcd.ports[0][0])
    stranger = "/zen/c/store/" + base64.b64encode(b"someone else's key").decode()
    raw.write(stranger, "kept")

    def member(rank: int) -> ElasticRendezvous:
        return ElasticRendezvous(etcd.address, rank, 2, f"tcp://127.0.0.1:{7000 + rank}", cluster_id="c",
                                 agreed={}, dead_after_s=3.0, timeout_s=60.0, secret=b"s" * 32)

    def rounds_held() -> set[int]:
        keys = [base64.b64decode(n.key.rsplit("/", 1)[-1]).decode() for n in raw.get("/zen/c/store").children]
        return {int(k.split("/")[0].rsplit(".", 1)[1]) for k in keys if k.startswith("torch.rendezvous.zen-c.")}

    members = [member(0), member(1)]
    try:
        generations = []
        for _ in range(5):
            joined = dict(enumerate(run_all([m.join for m in members])))
            generations.append(joined[0].generation)  # type: ignore[attr-defined]
        assert generations == [1, 2, 3, 4, 5], generations
        newest = members[0].round
        held = rounds_held()
        assert newest in held and held <= {newest - 1, newest}, (newest, held)
        assert raw.read(stranger).value == "kept"
    finally:
        for m in members:
            m.close()


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (self.path,))  # type: ignore[return-value]
