"""The metrics endpoint's HTTP server: bounded, so that no scraper (or stranger) can starve the daemon.

A plain threading server spends a thread and a descriptor on every connection for as long as the
peer keeps it open: 287 idle connections at a 300-descriptor limit stalled the daemon's health checks
and trainers, and a 4-thread scrape flood cut a job from 264 to 20 steps/s. Here a fixed set of
`workers` threads serves at most `max_connections` connections at once and at most `rate_per_s`
requests a second (more are closed at once, unread: the cost of an accept), each given `timeout_s`
to send its request and take the answer, and the page is rendered at most once per `cache_s` per
kind of scrape (named or opaque, text or OpenMetrics). Running out of descriptors is logged (once a
minute) instead of spinning. With TLS (operator_tls.py), the handshake is made on the worker, within the
same timeout, so a client that stalls it holds one slot, never the accepting thread.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from socketserver import BaseServer
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

log = logging.getLogger("zend.metrics")
Render = Callable[[bool, str], tuple[bytes, str]]  # (named, Accept header) -> (body, content type)
TlsContext = Callable[[], ssl.SSLContext]  # the server context for a new connection (None: plain HTTP)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news: nothing on stderr per request."""


class _Bounded(WSGIServer):
    """A WSGI server that hands each connection to a small pool and refuses what would exceed it."""

    workers = 4
    max_connections = 16
    timeout_s = 5.0
    rate_per_s = 10.0  # requests served a second, on average (Prometheus scrapes every few seconds)
    burst = 20
    tls: TlsContext | None = None

    def server_activate(self) -> None:
        super().server_activate()
        self.pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="metrics")
        self.slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0
        self._last_log = 0.0
        self._tokens, self._refilled = float(self.burst), time.monotonic()

    def _within_rate(self) -> bool:
        """A token bucket: a flood beyond `rate_per_s` is closed unread, at the cost of an accept."""
        now = time.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * self.rate_per_s)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            conn, address = super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._complain("the metrics listener cannot accept: the process is out of file descriptors")
                time.sleep(0.1)  # the listener stays readable: do not spin
            raise
        conn.settimeout(self.timeout_s)  # a request, and the answer's read, within this
        return conn, address

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._within_rate():
            self.refused += 1
            self._complain(f"the metrics listener refused connections: more than {self.rate_per_s:g} a second")
            self.shutdown_request(request)
            return
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self._complain(f"the metrics listener refused a connection: {self.max_connections} are open")
            self.shutdown_request(request)
            return
        self.pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            if self.tls is not None:  # the handshake here, on a worker, within the connection's timeout
                request = self.tls().wrap_socket(request, server_side=True)
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A scraper that hangs up or times out is not an error of ours: no traceback on stderr."""

    def _complain(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= 60:
            self._last_log = now
            log.warning(message, extra={"event": "metrics_listener", "refused": self.refused})


def serve(host: str, port: int, render: Render, named: Callable[[str | None], bool],
          cache_s: float = 1.0, tls: TlsContext | None = None) -> BaseServer:
    """Serve `render`'s page on http://host:port/ (https:// with `tls`; any path) on threads of its own;
    OSError naming the port if it will not bind. `named(authorization header)` says whether a scrape sees names;
    `render(named, accept)` is called at most once per `cache_s` per kind of scrape."""
    cache: dict[tuple[bool, str], tuple[float, bytes, str]] = {}
    lock = threading.Lock()

    def page(named: bool, accept: str) -> tuple[bytes, str]:
        kind = (named, "openmetrics" if "application/openmetrics-text" in accept else "text")
        with lock:  # one render at a time: concurrent scrapes of one kind wait for it and share it
            hit = cache.get(kind)
            if hit is None or time.monotonic() - hit[0] >= cache_s:
                body, content_type = render(named, accept)
                hit = cache[kind] = (time.monotonic(), body, content_type)
        return hit[1], hit[2]

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body, content_type = page(named(environ.get("HTTP_AUTHORIZATION")), environ.get("HTTP_ACCEPT", ""))
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return _start(host, port, app, tls)


def _start(host: str, port: int, app: Any, tls: TlsContext | None = None) -> BaseServer:
    try:
        server = make_server(host, port, app, _Bounded, handler_class=_Quiet)
    except OSError as exc:  # name the port: "Address already in use" alone does not say which
        raise OSError(exc.errno, f"metrics port {port} on {host}: {exc.strerror} (set --metrics-port, "
                                 "0 turns metrics off)") from exc
    server.tls = tls
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
