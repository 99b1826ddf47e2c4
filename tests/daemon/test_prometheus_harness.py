"""The Prometheus harness itself: a real server scrapes a prometheus_client exporter in this process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from tests.daemon.prometheus import PrometheusQueryError, PrometheusServer, prometheus_binary

pytestmark = pytest.mark.skipif(prometheus_binary() is None,
                                reason="prometheus is not installed (Debian/CI: apt-get install prometheus)")


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    """An HTTP exporter on loopback with zen_harness_test_total = 3; yields its 'host:port'."""
    registry = CollectorRegistry()
    counter = Counter("zen_harness_test", "Incremented by the Prometheus harness test", registry=registry)
    counter.inc(3)  # exposed as zen_harness_test_total
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def prometheus(exporter: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    with PrometheusServer([exporter], tmp_path_factory.mktemp("prometheus"), scrape_interval_s=0.5) as server:
        yield server


@pytest.mark.daemon
def test_prometheus_scrapes_the_exporter(prometheus: PrometheusServer, exporter: str) -> None:
    result = prometheus.wait_for("zen_harness_test_total > 0", timeout_s=30)
    assert len(result) == 1
    assert result[0]["metric"]["job"] == "zend"
    assert result[0]["metric"]["instance"] == exporter
    assert float(result[0]["value"][1]) == 3
    assert prometheus.query("scalar(up)")[0]["value"][1] == "1"


@pytest.mark.daemon
def test_bad_expression_raises_prometheus_message(prometheus: PrometheusServer) -> None:
    expected = r"refused query 'sum\(zen_harness_test_total': bad_data: .*parse error"
    with pytest.raises(PrometheusQueryError, match=expected) as info:
        prometheus.query("sum(zen_harness_test_total")
    assert "unclosed left parenthesis" in str(info.value) or "unexpected end of input" in str(info.value)
    with pytest.raises(PrometheusQueryError, match="parse error"):
        prometheus.wait_for("rate(zen_harness_test_total[5x])", timeout_s=5)


@pytest.mark.daemon
def test_wait_for_timeout_names_expr_and_target_health(prometheus: PrometheusServer, exporter: str) -> None:
    with pytest.raises(AssertionError) as info:
        prometheus.wait_for("zen_harness_absent_total", timeout_s=1)
    message = str(info.value)
    assert "'zen_harness_absent_total' stayed empty for 1s" in message
    assert f"http://{exporter}/metrics: health=up" in message


@pytest.mark.daemon
def test_exit_stops_prometheus_even_on_error(exporter: str, tmp_path: Path) -> None:
    server = PrometheusServer([exporter], tmp_path, scrape_interval_s=0.5, job="other")
    config = json.loads(server.config_path.read_text().partition("\n")[2])  # after the comment line
    assert config["scrape_configs"] == [{"job_name": "other", "static_configs": [{"targets": [exporter]}]}]
    with pytest.raises(ZeroDivisionError), server:
        proc = server.process
        assert proc is not None and proc.poll() is None
        1 / 0  # noqa: B018
    assert proc is not None and proc.poll() is not None
    assert server.process is None


@pytest.mark.inprocess
def test_target_must_be_host_port(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="target 'http://x:1/metrics' is not 'host:port'"):
        PrometheusServer(["http://x:1/metrics"], tmp_path)
