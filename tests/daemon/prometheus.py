"""A real Prometheus server for tests: what zend exports must survive a real scrape and real PromQL.

Our own parsing of the exposition format would agree with our own mistakes; Prometheus does not.
CI installs the Debian package (`apt-get install prometheus`); tests skip where it is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tests.helpers import poll_for
from zend.cluster.local import free_port

DEFAULT_BINARY = "/usr/bin/prometheus"
READY_TIMEOUT_S = 60.0
START_ATTEMPTS = 3  # a free port can be taken between our probe and Prometheus' bind


def end_process(proc: subprocess.Popen[bytes] | None, log: IO[bytes] | None) -> None:
    """Terminate, then kill, a server the test started, and close its log (either may be None)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if log is not None:
        log.close()


class PrometheusQueryError(RuntimeError):
    """Prometheus refused a request; the message carries its error type and text."""


def prometheus_binary() -> str | None:
    """The Prometheus executable: on PATH, else the Debian package's, else None."""
    found = shutil.which("prometheus")
    if found:
        return found
    return DEFAULT_BINARY if os.access(DEFAULT_BINARY, os.X_OK) else None


def _duration(seconds: float) -> str:
    """Seconds as a Prometheus duration (whole milliseconds: it takes no fractions)."""
    return f"{max(1, round(seconds * 1000))}ms"


class PrometheusServer:
    """A Prometheus process scraping `targets` ("host:port"), for the length of a `with` block.

    prometheus.yml, the TSDB (data/) and the log (prometheus.log) go into `workdir`.
    """

    def __init__(self, targets: Sequence[str], workdir: Path, scrape_interval_s: float = 1.0, job: str = "zend",
                 bearer_token: str | None = None):
        if isinstance(targets, str) or not targets:
            raise ValueError(f"targets={targets!r} must be a non-empty list of 'host:port'")
        for target in targets:
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"target {target!r} is not 'host:port'")
        if not scrape_interval_s > 0:
            raise ValueError(f"scrape_interval_s={scrape_interval_s!r} must be positive")
        self.targets = list(targets)
        self.workdir = Path(workdir)
        self.scrape_interval_s = scrape_interval_s
        self.job = job
        self.bearer_token = bearer_token  # scrapes present it (zend's operator token: names in the labels)
        self.config_path = self.workdir / "prometheus.yml"
        self.log_path = self.workdir / "prometheus.log"
        self.data_path = self.workdir / "data"
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self._config())

    def _config(self) -> str:
        interval = _duration(self.scrape_interval_s)
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       # Prometheus refuses a scrape timeout longer than the interval
                       "scrape_timeout": _duration(min(self.scrape_interval_s, 10.0))},
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}],
        }
        if self.bearer_token is not None:
            config["scrape_configs"][0]["authorization"] = {"type": "Bearer", "credentials": self.bearer_token}
        return "# written by tests/daemon/prometheus.py (JSON is YAML)\n" + json.dumps(config, indent=2) + "\n"

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("PrometheusServer is not started: use it in a `with` block")
        return f"http://127.0.0.1:{self.port}"

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log at {self.log_path}: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> PrometheusServer:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError(f"prometheus is not installed (not on PATH, not at {DEFAULT_BINARY}); "
                               "on Debian: apt-get install prometheus")
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                if self._start(binary, attempt == START_ATTEMPTS):
                    return self
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable")

    def _start(self, binary: str, last_attempt: bool) -> bool:
        """Start Prometheus and wait for /-/ready; False when its port was taken and another may be tried."""
        self.stop()
        self.port = free_port()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (held open for the process' life; closed in stop)
        self._proc = subprocess.Popen(
            [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.data_path}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if "address already in use" in self.log_tail() and not last_attempt:
                    return False
                raise RuntimeError(f"prometheus exited with status {self._proc.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus at {self.url} was not ready within {READY_TIMEOUT_S:g}s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        """Terminate, then kill, the process; always safe to call."""
        proc, self._proc = self._proc, None
        log, self._log = self._log, None
        end_process(proc, log)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _get(self, what: str, path: str, params: dict[str, str] | None = None) -> Any:
        """The `data` of a Prometheus API answer; PrometheusQueryError with its message for `what` otherwise."""
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # Prometheus answers a bad request with a JSON error body
            text = exc.read().decode(errors="replace")
            try:
                body = json.loads(text)
            except ValueError:
                raise PrometheusQueryError(f"Prometheus refused {what} ({url}): HTTP {exc.code}: "
                                           f"{text[:500]}") from None
        if body.get("status") != "success":
            raise PrometheusQueryError(f"Prometheus refused {what}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: the vector's samples ({"metric": labels, "value": [time, "value"]})."""
        data = self._get(f"query {expr!r}", "/api/v1/query", {"query": expr})
        if data["resultType"] in ("vector", "matrix"):
            result: list[dict[str, Any]] = data["result"]
            return result
        return [{"metric": {}, "value": data["result"]}]  # a scalar or a string

    def target_health(self) -> list[dict[str, Any]]:
        """The active scrape targets, with their health and last error."""
        active: list[dict[str, Any]] = self._get("the targets request", "/api/v1/targets")["activeTargets"]
        return active

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll `expr` until its result is non-empty; a bad expression raises at once."""
        try:
            return poll_for(lambda: self.query(expr), timeout_s, expr, interval_s=min(self.scrape_interval_s / 2, 0.5))
        except AssertionError:
            pass
        health = "\n".join(f"  {t.get('scrapeUrl')}: health={t.get('health')} lastError={t.get('lastError')!r} "
                           f"lastScrape={t.get('lastScrape')}" for t in self.target_health()) or "  (no active targets)"
        raise AssertionError(f"Prometheus query {expr!r} stayed empty for {timeout_s:g}s; targets:\n{health}")
