"""TLS on the operator endpoints (--operator-tls-cert-file / --operator-tls-key-file): the gRPC port and
the metrics endpoint of a real daemon serve TLS with a certificate from a self-signed CA made here,
the tools (`zend health`, `zend status`) and a scraper trust that CA, nothing is served in clear on
those ports, a rotated certificate is served without a restart, and bad files are refused naming them."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from tests.certificates import Ca
from tests.helpers import poll_for
from tests.subprocess_env import with_project
from zend.cluster.local import free_port
from zend.daemon.secret import new_secret
from zend.protocol.health import health_status
from zend.protocol.operator_channel import OperatorChannelTls

pytestmark = pytest.mark.daemon


@pytest.fixture
def tls_daemon(fresh_cluster, tmp_path):
    ca = Ca()
    (tmp_path / "ca.pem").write_bytes(ca.pem())
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    serial = ca.issue(cert, key)
    grpc_port = free_port()
    c = fresh_cluster(1, extra=["--grpc-listen", f"127.0.0.1:{grpc_port}", "--operator-tls-cert-file", str(cert),
                                "--operator-tls-key-file", str(key), "--log-format", "text"])
    return c, ca, grpc_port, serial


def zend(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zend", *args], capture_output=True, text=True, timeout=60,
                          env=with_project(**(env or {})))


def https_get(port: int, cafile: Path, token: str | None = None) -> tuple[str, ssl.SSLObject | None]:
    context = ssl.create_default_context(cafile=str(cafile))
    request = urllib.request.Request(f"https://localhost:{port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
        return reply.read().decode(), None


def served_serial(port: int, cafile: Path) -> int:
    context = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_the_grpc_port_serves_tls_to_the_tools_and_nothing_in_clear(tls_daemon, tmp_path):
    c, _, grpc_port, _ = tls_daemon
    address, ca_file = f"127.0.0.1:{grpc_port}", tmp_path / "ca.pem"
    tls = OperatorChannelTls.from_files(str(ca_file), "localhost")
    assert health_status(address, 10, tls) == "SERVING"
    with pytest.raises(grpc.RpcError) as clear:  # a client in clear gets no answer on the TLS port
        health_status(address, 3)
    assert clear.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    other = tmp_path / "other-ca.pem"
    other.write_bytes(Ca("a stranger's CA").pem())
    with pytest.raises(grpc.RpcError):  # a certificate the tool does not trust: no answer either
        health_status(address, 3, OperatorChannelTls.from_files(str(other), "localhost"))

    run = zend("health", "--address", address, "--tls-ca", str(ca_file), "--tls-server-name", "localhost")
    assert run.returncode == 0 and "SERVING" in run.stdout, run.stdout + run.stderr
    run = zend("status", "--json", "--address", f"localhost:{grpc_port}",
               env={"ZEN_OPERATOR_TLS_CA_FILE": str(ca_file), "ZEN_CLUSTER_SECRET_FILE": str(c.secret_file)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout)["redacted"] is False, run.stdout + run.stderr  # the operator's full view
    run = zend("health", "--address", address, "--tls-ca", str(tmp_path / "missing.pem"))
    assert run.returncode == 2 and "missing.pem" in run.stderr, run.stderr


def test_the_metrics_endpoint_serves_https_and_names_only_for_the_operator(tls_daemon, tmp_path):
    c, _, _, _ = tls_daemon
    port, ca_file = c.metrics_ports[0], tmp_path / "ca.pem"
    page, _ = https_get(port, ca_file)
    assert "zen_node_state" in page and "process_open_fds" in page
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP gets no page
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    with pytest.raises(urllib.error.URLError) as untrusted:  # nor a client that does not trust the CA
        urllib.request.urlopen(f"https://localhost:{port}/metrics", timeout=5,
                               context=ssl.create_default_context())
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)
    # a client that stalls its handshake holds one slot, not the listener
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
    try:
        page, _ = https_get(port, ca_file, c.operator_token())
        assert 'zen_node_state{state="serving"} 1.0' in page
    finally:
        for s in stalled:
            s.close()


def test_a_rotated_certificate_is_served_without_a_restart(tls_daemon, tmp_path):
    c, ca, grpc_port, first = tls_daemon
    ca_file = tmp_path / "ca.pem"
    assert served_serial(c.metrics_ports[0], ca_file) == first
    time.sleep(0.01)  # a new mtime even on coarse clocks
    second = ca.issue(tmp_path / "tls.crt", tmp_path / "tls.key")
    assert second != first
    poll_for(lambda: served_serial(c.metrics_ports[0], ca_file) == second, 10, "the metrics endpoint's new cert")
    poll_for(lambda: served_serial(grpc_port, ca_file) == second, 10, "the gRPC port's new certificate")
    tls = OperatorChannelTls.from_files(str(ca_file), "localhost")
    assert health_status(f"127.0.0.1:{grpc_port}", 10, tls) == "SERVING"


def test_serve_refuses_half_a_pair_and_files_that_do_not_load(tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    Ca().issue(cert, key)
    run = zend("serve", "--world-size", "1", "--rank", "0", "--socket-dir", str(tmp_path / "s"),
               "--operator-tls-cert-file", str(cert))
    assert run.returncode == 2
    assert "operator_tls_cert_file" in run.stderr and "needs operator_tls_key_file" in run.stderr, run.stderr
    other_key = tmp_path / "other.key"
    Ca().issue(tmp_path / "other.crt", other_key)
    run = zend("serve", "--world-size", "1", "--rank", "0", "--socket-dir", str(tmp_path / "s"),
               "--metrics-port", "0", "--operator-tls-cert-file", str(cert), "--operator-tls-key-file",
               str(other_key), env={"ZEN_CLUSTER_SECRET": new_secret()})
    assert run.returncode == 2 and str(cert) in run.stderr and "do not load" in run.stderr, run.stderr
    run = zend("serve", "--world-size", "1", "--rank", "0", "--socket-dir", str(tmp_path / "s"),
               "--metrics-port", "0", "--operator-tls-cert-file", str(tmp_path / "nope.crt"),
               "--operator-tls-key-file", str(key), env={"ZEN_CLUSTER_SECRET": new_secret()})
    assert run.returncode == 2 and "nope.crt" in run.stderr, run.stderr
