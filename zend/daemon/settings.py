"""Every setting of `zend serve`, from flags, then ZEND_* variables, then a TOML file, then defaults.

Resolved once at start into a frozen `Settings`; anything invalid stops the daemon at once
with a message naming the setting, its value and where it came from.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from zend.protocol import paths
from zend.transport import parse_uri

ENV_PREFIX = "ZEND_"
AUTO_RANK = -1  # `--rank auto`: the one-shot rendezvous assigns it (its store's host is 0, the others in arrival order)


class SettingsError(ValueError):
    """A setting that cannot work; the message names it, its value and its source."""


@dataclass(frozen=True)
class Settings:
    # membership: static (rank, world_size, peers) or rendezvous (a store's host:port, or env)
    rank: int = 0
    world_size: int = 1
    peers: tuple[str, ...] = ()          # data-plane URI of every node, in rank order
    rendezvous: str = ""                 # "host:port" of torch's TCPStore; "env": membership.from_environment
    elastic: int = 0                     # 1: the rendezvous store outlives the daemons; a restarted one rejoins
    min_nodes: int = 0                   # (elastic) below world_size: the survivors of a lost node go on (scale-in)
    rendezvous_tls_ca_file: str = ""     # etcd://: https to the members, whose certificates this CA signed (PEM)
    rendezvous_tls_cert_file: str = ""   # etcd://: this daemon's client certificate (etcd --client-cert-auth)
    rendezvous_tls_key_file: str = ""    # ... its key (both or neither)
    listen: str = ""                     # own data-plane URI (default: peers[rank])
    transport: str = "auto"              # tcp, ucx or auto (resolved from the peers' URIs)
    cluster_id: str = "zen"
    generation: int = 0
    secret_file: str = ""                # else $ZEN_CLUSTER_SECRET_FILE, else $ZEN_CLUSTER_SECRET
    data_plane_security: str = "aead"    # aead: frames between daemons sealed (AES-GCM); none: in clear
    data_plane_engine: str = "auto"      # native (the C++ engine), python, or auto: native where it loads
    # the trainers' side
    socket_dir: str = paths.DEFAULT_SOCKET_DIR  # zend.sock (gRPC) and buffers.sock live here
    grpc_listen: str = ""                # optional TCP address for operators and probes, e.g. 0.0.0.0:7070
    grpc_listen_trainers: int = 0        # 1: the Trainer service on grpc_listen too (job tokens in clear)
    grpc_workers: int = 64               # handler threads for short calls (a waiting Submit holds none)
    threads: int = 0                     # torch threads for the daemon's tensor work (0: a quarter of the cores)
    max_session_bytes: int = 16 << 30    # shared buffers one trainer may hold
    max_pool_bytes: int = 64 << 30       # shared buffers all trainers may hold
    max_tensors_per_job: int = 4096      # tensors one job may register on this node
    max_job_buffer_bytes: int = 0        # shared buffers one job may hold (0: half of max_pool_bytes)
    max_sessions_per_job: int = 1024     # trainer sessions one job may open on this node
    max_submits_in_flight_per_job: int = 1024  # steps one job's trainers may have waiting in the daemon at once
    max_buffer_connections: int = 1024   # connections to buffers.sock at once (a thread each); beyond: refused
    max_buffer_connections_per_pid: int = 64  # of them from one trainer process (pid 0, unknown: not counted)
    buffer_hello_timeout_s: float = 5.0  # a buffers.sock connection that has not said hello by then is closed
    # in-memory checkpoints (GEMINI)
    checkpoint_memory_bytes: int = 16 << 30  # checkpoint bytes this daemon holds, its jobs' and replicas (0: none)
    checkpoint_job_bytes: int = 0        # of them, one job's (0: all of checkpoint_memory_bytes)
    checkpoint_replicas: int = 1         # copies of each node's checkpoint objects on other nodes
    # the scheme
    scheme: str = "auto"
    hash_seed: int = 0
    min_slice_width: int = 16
    reprofile_every: int = 50
    # time bounds
    step_timeout_s: float = 300.0        # a step waiting for its node's trainers or for peers
    peer_timeout_s: float = 5.0          # a peer that sends nothing, not even heartbeats, is lost after this
    connect_timeout_s: float = 120.0     # all peers must be connected at start within this
    drain_timeout_s: float = 30.0
    claim_timeout_s: float = 60.0        # an opened session must connect its buffer socket within this
    # observability
    metrics_port: int = 7071             # 0 turns it off; beside 7000/7001/7070 (9400 is the DCGM exporter's)
    metrics_host: str = "127.0.0.1"      # this host only; 0.0.0.0 (or the pod's IP) for a Prometheus elsewhere
    operator_tls_cert_file: str = ""     # PEM: TLS on the gRPC port (grpc_listen) and the metrics endpoint
    operator_tls_key_file: str = ""      # ... its key (both or neither; reloaded when they change)
    log_format: str = "json"             # json or text
    log_level: str = "INFO"
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def grpc_socket(self) -> str:
        return paths.grpc_socket(self.socket_dir)

    @property
    def buffer_socket(self) -> str:
        return paths.buffer_socket(self.socket_dir)

    @property
    def job_buffer_bytes(self) -> int:
        """The buffer bytes one job may hold: max_job_buffer_bytes, or half the pool (one job never takes it all)."""
        return self.max_job_buffer_bytes or max(1, self.max_pool_bytes // 2)

    @property
    def job_checkpoint_bytes(self) -> int:
        return self.checkpoint_job_bytes or self.checkpoint_memory_bytes

    @property
    def data_uri(self) -> str:
        return self.listen or (self.peers[self.rank] if self.peers else "")

    def agreed(self) -> dict[str, object]:
        """What every node must agree on (checked at rendezvous and in every data-plane handshake)."""
        return {"scheme": self.scheme, "hash_seed": self.hash_seed, "min_slice_width": self.min_slice_width,
                "reprofile_every": self.reprofile_every, "world_size": self.world_size}


FIELDS = {f.name: f for f in fields(Settings) if f.name != "sources"}


def _convert(name: str, value: Any, source: str) -> Any:
    default = getattr(Settings, name)
    if name == "rank" and str(value).strip() == "auto":
        return AUTO_RANK
    try:
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            items = value if isinstance(value, list | tuple) else str(value).split(",")
            return tuple(str(x).strip() for x in items if str(x).strip())
        return str(value)
    except (TypeError, ValueError):
        raise SettingsError(f"setting {name}={value!r} (from {source}) is not a valid "
                            f"{type(default).__name__}") from None


def resolve(flags: Mapping[str, Any], env: Mapping[str, str] | None = None,
            config_file: str | None = None) -> Settings:
    """Flags (None = not given) beat ZEND_<NAME> variables, which beat the file, which beats defaults."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    if config_file:
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"config file {config_file!r}: {exc}") from None
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in FIELDS:
                raise SettingsError(f"config file {config_file!r}: unknown setting {key!r}")
            values[name], sources[name] = _convert(name, value, f"file {config_file}"), f"file {config_file}"
    for name in FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in env:
            values[name], sources[name] = _convert(name, env[var], f"${var}"), f"${var}"
    for name, value in flags.items():
        if value is not None and name in FIELDS:
            values[name], sources[name] = _convert(name, value, f"--{name.replace('_', '-')}"), "flag"
    if values.get("rendezvous") == "env":
        _from_environment(values, sources, env)
    settings = Settings(**values, sources=sources)
    validate(settings)
    return settings


def _from_environment(values: dict[str, Any], sources: dict[str, str], env: Mapping[str, str]) -> None:
    """`rendezvous = env`: the node's rank, the node count and the store's address from the variables
    a launcher or operator sets (membership.from_environment), resolved here, before anything starts."""
    from zend.daemon.membership import MembershipError, from_environment

    given = [n for n in ("rank", "world_size") if n in sources]
    if given:
        raise SettingsError(f"setting {given[0]}={values[given[0]]!r} (from {sources[given[0]]}): rendezvous env "
                            "takes the node's rank and count from the environment; drop it, or give "
                            "--rendezvous HOST:PORT")
    try:
        host, port, world_size, rank = from_environment(env)
    except MembershipError as exc:
        raise SettingsError(f"setting rendezvous='env': {exc}") from None
    values.update(rendezvous=f"{host}:{port}", rank=rank, world_size=world_size)
    sources.update(rendezvous="the environment", rank="the environment", world_size="the environment")


def _check_quotas(s: Settings, bad: Callable[[str, str], SettingsError]) -> None:
    """The per-job quotas and the buffer socket's bounds fit the node-wide ones."""
    from zend.daemon.jobs import MAX_LOCAL_WORLD_SIZE

    if not 0 <= s.max_job_buffer_bytes <= s.max_pool_bytes:
        raise bad("max_job_buffer_bytes", f"must be 0 (half of max_pool_bytes) or in [1, {s.max_pool_bytes}] "
                                          "(max_pool_bytes)")
    if s.checkpoint_memory_bytes < 0:
        raise bad("checkpoint_memory_bytes", "must be 0 (no checkpoints) or more")
    if not 0 <= s.checkpoint_job_bytes <= s.checkpoint_memory_bytes:
        raise bad("checkpoint_job_bytes", f"must be 0 (all of checkpoint_memory_bytes) or in [1, "
                                          f"{s.checkpoint_memory_bytes}] (checkpoint_memory_bytes)")
    if not 0 <= s.checkpoint_replicas <= 16:
        raise bad("checkpoint_replicas", "must be in [0, 16]")
    if s.max_sessions_per_job > MAX_LOCAL_WORLD_SIZE:
        raise bad("max_sessions_per_job", f"must be at most {MAX_LOCAL_WORLD_SIZE} (trainers of one job on a node)")
    if s.max_buffer_connections_per_pid > s.max_buffer_connections:
        raise bad("max_buffer_connections_per_pid", f"must be at most max_buffer_connections "
                                                    f"({s.max_buffer_connections})")


def validate(s: Settings) -> None:
    from zend.core.schemes import SCHEMES  # imports torch: here, not when `zend --help` builds the parser

    def bad(name: str, why: str) -> SettingsError:
        return SettingsError(f"setting {name}={getattr(s, name)!r} (from {s.sources.get(name, 'default')}): {why}")

    if s.world_size < 1:
        raise bad("world_size", "must be at least 1")
    if s.rank == AUTO_RANK:
        if not s.rendezvous or s.elastic:
            raise bad("rank", "auto needs the one-shot rendezvous (--rendezvous HOST:PORT, not --elastic 1): "
                              "its store assigns the ranks")
    elif not 0 <= s.rank < s.world_size:
        raise bad("rank", f"must be in [0, {s.world_size}) or 'auto'")
    if s.peers and s.rendezvous:
        raise bad("peers", "give either peers (static membership) or rendezvous, not both")
    if s.peers and len(s.peers) != s.world_size:
        raise bad("peers", f"lists {len(s.peers)} addresses for a world size of {s.world_size}")
    if not s.peers and not s.rendezvous and s.world_size > 1:
        raise bad("world_size", "more than one node needs peers or rendezvous")
    if s.elastic not in (0, 1):
        raise bad("elastic", "must be 0 or 1")
    if s.elastic and not s.rendezvous:
        raise bad("elastic", "needs rendezvous: HOST:PORT of a store that outlives the daemons (`zend store`)")
    if s.rendezvous.startswith("etcd://"):
        from zend.daemon.round_store import etcd_members

        if not s.elastic:
            raise bad("rendezvous", "an etcd cluster holds elastic rounds only: add --elastic 1")
        try:
            etcd_members(s.rendezvous)
        except ValueError as exc:
            raise bad("rendezvous", str(exc)) from None
    tls = ("rendezvous_tls_ca_file", "rendezvous_tls_cert_file", "rendezvous_tls_key_file")
    for name in tls:
        if getattr(s, name) and not s.rendezvous.startswith("etcd://"):
            raise bad(name, "TLS to the rendezvous is for an etcd cluster (--rendezvous etcd://...); torch's "
                            "TCPStore (`zend store`) has none")
    if bool(s.rendezvous_tls_cert_file) != bool(s.rendezvous_tls_key_file):
        given, missing = (tls[1], tls[2]) if s.rendezvous_tls_cert_file else (tls[2], tls[1])
        raise bad(given, f"needs {missing} too (a client certificate and its key, PEM)")
    if s.min_nodes and not 1 <= s.min_nodes <= s.world_size:
        raise bad("min_nodes", f"must be 0 (no scale-in) or in [1, {s.world_size}] (the world size)")
    if s.min_nodes and s.min_nodes < s.world_size and not s.elastic:
        raise bad("min_nodes", "scale-in needs an elastic cluster (--elastic 1)")
    if s.rendezvous and not s.listen:
        raise bad("listen", "rendezvous needs this node's own data-plane URI")
    for uri in [*s.peers, *([s.listen] if s.listen else [])]:
        try:
            parse_uri(uri)
        except ValueError as exc:
            raise bad("peers" if uri in s.peers else "listen", str(exc)) from None
    if s.transport not in ("tcp", "ucx", "auto"):
        raise bad("transport", "must be tcp, ucx or auto")
    if s.data_plane_security not in ("aead", "none"):
        raise bad("data_plane_security", "must be aead or none")
    if s.data_plane_engine not in ("auto", "native", "python"):
        raise bad("data_plane_engine", "must be auto, native or python")
    if s.scheme not in SCHEMES:
        raise bad("scheme", f"must be one of {', '.join(SCHEMES)}")
    for name in ("step_timeout_s", "peer_timeout_s", "connect_timeout_s", "drain_timeout_s", "claim_timeout_s",
                 "buffer_hello_timeout_s"):
        if getattr(s, name) <= 0:
            raise bad(name, "must be positive")
    if s.peer_timeout_s < 0.2:
        raise bad("peer_timeout_s", "must be at least 0.2 s (heartbeats go every tenth of it)")
    if s.threads < 0:
        raise bad("threads", "must be 0 (a quarter of the cores) or more")
    for name in ("grpc_workers", "max_session_bytes", "max_pool_bytes", "max_tensors_per_job", "min_slice_width",
                 "reprofile_every", "max_sessions_per_job", "max_submits_in_flight_per_job", "max_buffer_connections",
                 "max_buffer_connections_per_pid"):
        if getattr(s, name) < 1:
            raise bad(name, "must be at least 1")
    _check_quotas(s, bad)
    if not 0 <= s.metrics_port < 65536:
        raise bad("metrics_port", "must be a port number (0 turns metrics off)")
    if s.log_format not in ("json", "text"):
        raise bad("log_format", "must be json or text")
    if s.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise bad("log_level", "must be DEBUG, INFO, WARNING or ERROR")
    if s.grpc_listen and ":" not in s.grpc_listen:
        raise bad("grpc_listen", "must be HOST:PORT")
    if s.grpc_listen_trainers not in (0, 1):
        raise bad("grpc_listen_trainers", "must be 0 or 1")
    if bool(s.operator_tls_cert_file) != bool(s.operator_tls_key_file):
        given, missing = (("operator_tls_cert_file", "operator_tls_key_file") if s.operator_tls_cert_file
                          else ("operator_tls_key_file", "operator_tls_cert_file"))
        raise bad(given, f"needs {missing} too (a certificate and its key, PEM)")
    if s.grpc_listen_trainers and not s.grpc_listen:
        raise bad("grpc_listen_trainers", "needs grpc_listen (HOST:PORT) to serve the Trainer service on")
