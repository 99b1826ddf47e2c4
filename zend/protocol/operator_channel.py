"""The channel operator tools open to a daemon's gRPC port: in clear (the unix socket, or a port without
TLS), or TLS trusting a given CA (a daemon with operator_tls_cert_file, zend/daemon/operator_tls.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

TLS_CA_ENV = "ZEN_OPERATOR_TLS_CA_FILE"  # the CA certificates `zend status` / `zend health` trust (PEM)


@dataclass(frozen=True)
class OperatorChannelTls:
    root_certificates: bytes
    server_name: str | None = None  # the name to check on the certificate, if not the address's host

    @classmethod
    def from_files(cls, ca_file: str, server_name: str | None = None) -> OperatorChannelTls:
        """OSError naming `ca_file` if it cannot be read."""
        try:
            with open(ca_file, "rb") as f:
                return cls(f.read(), server_name)
        except OSError as exc:
            raise OSError(exc.errno, f"operator TLS CA file {ca_file!r}: {exc.strerror}") from None


def operator_channel(address: str, tls: OperatorChannelTls | None = None) -> grpc.Channel:
    """A channel to `address`: TLS with `tls`, else in clear."""
    import grpc  # here: the tools' --help and `zend token` load no grpc

    if tls is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(tls.root_certificates), options=options)
