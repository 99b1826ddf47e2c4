"""TLS for the operator endpoints (the gRPC port of --grpc-listen and the metrics endpoint): one
certificate and key, PEM files, reloaded when they change on disk.

The operator token and job names cross these ports; in clear, anyone on the path reads them. Both
servers take their certificate from here: grpc's dynamic server credentials ask `_fetch` at each new
connection, and the metrics server asks `context()` for each connection, so a certificate rotated in
place (cert-manager renewing a Secret, a mounted file replaced) is served without a restart. The unix
socket stays in clear: its file permissions are its guard.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from typing import Any

log = logging.getLogger("zend.tls")


class OperatorTlsError(ValueError):
    """The certificate or key cannot be used; the message names the file."""


class OperatorTls:
    def __init__(self, cert_file: str, key_file: str):
        self.cert_file, self.key_file = cert_file, key_file
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        self._pair, self._context = self._load()  # OperatorTlsError at once: at start, never at a scrape
        self._version = 0  # +1 per reload; grpc's fetcher remembers the one it serves
        self._grpc_version = 0

    # ------------------------------------------------------------------ the metrics endpoint
    def context(self) -> ssl.SSLContext:
        """The server context for a new connection, reloaded first if the files changed."""
        self._reload_if_changed()
        with self._lock:
            return self._context

    # ------------------------------------------------------------------ the gRPC port
    def grpc_credentials(self) -> Any:
        """grpc server credentials whose certificate follows the files (grpc calls `_fetch` per handshake)."""
        import grpc

        with self._lock:
            key, cert = self._pair
        initial = grpc.ssl_server_certificate_configuration([(key, cert)])
        return grpc.dynamic_ssl_server_credentials(initial, self._fetch)

    def _fetch(self) -> Any:
        import grpc

        self._reload_if_changed()
        with self._lock:
            if self._grpc_version == self._version:
                return None  # grpc keeps the configuration it has
            self._grpc_version, (key, cert) = self._version, self._pair
        return grpc.ssl_server_certificate_configuration([(key, cert)])

    # ------------------------------------------------------------------ loading
    def _read_stamp(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in (self.cert_file, self.key_file):
            try:
                st = os.stat(path)
            except OSError as exc:
                raise OperatorTlsError(f"operator TLS file {path!r}: {exc.strerror}") from None
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(stamps)

    def _load(self) -> tuple[tuple[bytes, bytes], ssl.SSLContext]:
        try:
            with open(self.cert_file, "rb") as f:
                cert = f.read()
            with open(self.key_file, "rb") as f:
                key = f.read()
        except OSError as exc:
            raise OperatorTlsError(f"operator TLS file {exc.filename!r}: {exc.strerror}") from None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2 and newer
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise OperatorTlsError(f"operator TLS certificate {self.cert_file!r} and key {self.key_file!r} do not "
                                   f"load as a PEM pair: {exc}") from None
        return (key, cert), context

    def _reload_if_changed(self) -> bool:
        """Reload the pair if either file changed; True if it did. A pair that no longer loads (a
        rotation caught half way) is logged and the old one kept."""
        try:
            stamp = self._read_stamp()
        except OperatorTlsError as exc:
            log.warning("keeping the operator TLS certificate in use: %s", exc, extra={"event": "tls_reload"})
            return False
        with self._lock:
            if stamp == self._stamp:
                return False
        try:
            pair, context = self._load()
        except OperatorTlsError as exc:
            log.warning("keeping the operator TLS certificate in use: %s", exc, extra={"event": "tls_reload"})
            return False
        with self._lock:
            self._stamp, self._pair, self._context = stamp, pair, context
            self._version += 1
        log.info("operator TLS certificate reloaded", extra={"event": "tls_reload", "file": self.cert_file})
        return True
