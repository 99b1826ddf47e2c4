"""`zend serve`, `zend status`, `zend health`, `zend store`, `zend secret`, `zend token`: the daemon's
commands, for zend.cli."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from zend.daemon.settings import FIELDS, SettingsError, resolve
from zend.protocol import paths
from zend.protocol.descriptors import is_repeated
from zend.protocol.operator_channel import TLS_CA_ENV, OperatorChannelTls

log = logging.getLogger("zend.daemon")
HELP = {
    "rank": "this node's rank, or 'auto' with --rendezvous HOST:PORT (the node that can host the store is 0, the "
            "others take 1, 2, ... as they arrive: no static node rank needed, e.g. under torchrun's c10d "
            "rendezvous)", "world_size": "number of nodes",
    "peers": "comma-separated data-plane URIs of every node, in rank order (tcp://HOST:PORT or ucx://HOST:PORT)",
    "rendezvous": "HOST:PORT of torch's TCPStore (rank 0 hosts it; with --elastic 1 a `zend store`), "
                  "etcd://HOST:PORT,HOST:PORT,... of an etcd cluster (--elastic 1; v2 API), or 'env': the node's "
                  "rank from GROUP_RANK (torchrun), NODE_RANK, PET_NODE_RANK (Kubeflow) or JOB_COMPLETION_INDEX "
                  "(Indexed Job / JobSet), "
                  "the node count from GROUP_WORLD_SIZE, NNODES or PET_NNODES, the host from MASTER_ADDR, the port "
                  "from ZEN_RENDEZVOUS_PORT (default 7001, not MASTER_PORT); ZEN_NODE_RANK, ZEN_NUM_NODES and "
                  "ZEN_RENDEZVOUS_ADDR override",
    "rendezvous_tls_ca_file": "etcd://: talk https to the etcd members, whose certificates this CA (PEM) signed",
    "rendezvous_tls_cert_file": "etcd://: this daemon's client certificate (PEM), for an etcd with "
                                "--client-cert-auth",
    "rendezvous_tls_key_file": "PEM private key of --rendezvous-tls-cert-file",
    "elastic": "1: membership by torch's elastic rendezvous over a store that outlives the daemons (`zend store`); "
               "a restarted daemon rejoins, every node moves to a new generation",
    "min_nodes": "with --elastic 1: when a node is lost for --peer-timeout-s, go on as soon as this many nodes "
                 "are left (a smaller generation; 0: wait for every node)",
    "listen": "this node's data-plane URI (default: its entry in --peers)",
    "transport": "tcp, ucx or auto", "secret_file": "file with the cluster secret (or $ZEN_CLUSTER_SECRET_FILE / "
                                                    "$ZEN_CLUSTER_SECRET; never on the command line)",
    "data_plane_security": "aead: every frame between daemons authenticated and encrypted (AES-256-GCM, keys "
                           "per link from the handshake); none: in clear, for fabrics you trust (logged loudly)",
    "data_plane_engine": "what moves tcp:// frames: native (the C++ engine: epoll thread, OpenSSL sealing; "
                         "refuses to start without it), python, or auto (native where it was built and loads); "
                         "both speak the same wire format",
    "socket_dir": "folder of the trainer sockets zend.sock and buffers.sock",
    "grpc_listen": "extra HOST:PORT (TCP) for the Operator service and health checks (operators, probes); the "
                   "Trainer service stays on the unix socket unless --grpc-listen-trainers 1",
    "grpc_listen_trainers": "1: serve the Trainer service on --grpc-listen too (job tokens cross the network in "
                            "clear; trainers normally use the unix socket)",
    "metrics_host": "address the Prometheus endpoint binds (0.0.0.0 for a Prometheus on another host or pod)",
    "operator_tls_cert_file": "PEM certificate (chain) for TLS on the operator endpoints: the gRPC port of "
                              "--grpc-listen and the metrics endpoint (https); reloaded when the file changes",
    "operator_tls_key_file": "PEM private key of --operator-tls-cert-file",
    "metrics_port": "Prometheus port (0: off)",
    "max_tensors_per_job": "tensors one job may register on this node (RESOURCE_EXHAUSTED beyond)",
    "max_job_buffer_bytes": "shared-buffer bytes one job may hold on this node, all its trainers together "
                            "(RESOURCE_EXHAUSTED beyond; 0: half of --max-pool-bytes, so one job never takes the "
                            "whole pool)",
    "checkpoint_memory_bytes": "in-memory checkpoint bytes this daemon holds, its trainers' and its peers' replicas "
                               "(RESOURCE_EXHAUSTED naming it beyond; 0: no checkpoints)",
    "checkpoint_job_bytes": "of --checkpoint-memory-bytes, what one job's checkpoints may hold (0: all of it)",
    "checkpoint_replicas": "copies of each node's checkpoint objects kept on other nodes (GEMINI's groups of "
                           "replicas + 1 nodes hold each other's)",
    "max_sessions_per_job": "trainer sessions one job may open on this node (RESOURCE_EXHAUSTED beyond; at most 1024)",
    "max_submits_in_flight_per_job": "steps one job's trainers may have waiting in the daemon at once, by Submit or "
                                     "on buffers.sock (RESOURCE_EXHAUSTED beyond)",
    "max_buffer_connections": "connections to buffers.sock at once (a thread each); more are refused with a message",
    "max_buffer_connections_per_pid": "connections to buffers.sock from one process at once (a trainer needs one, "
                                      "plus one per submitting thread); peers of unknown pid (0: another pid "
                                      "namespace) count only towards --max-buffer-connections",
    "buffer_hello_timeout_s": "a connection to buffers.sock that has not said hello by then is closed",
    "grpc_workers": "threads for the short gRPC calls (a Submit or Ready that waits holds none; health never "
                    "needs one)",
}


def add_commands(sub: Any) -> None:
    """Add serve, status, health and token to the `zend` command's subparsers."""
    serve = sub.add_parser("serve", help="run the zend daemon of this node",
                           description="Run the zend daemon. Every flag also reads ZEND_<NAME> (e.g. ZEND_WORLD_SIZE) "
                                       "and the TOML file given by --config or $ZEND_CONFIG; flags win.")
    serve.add_argument("--config", default=None, help="TOML file of settings (names as the flags, with _)")
    for f in FIELDS.values():
        kind = {int: int, float: float}.get(type(f.default), str) if f.name not in ("peers", "rank") else str
        serve.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                           help=f"{HELP.get(f.name, f.name.replace('_', ' '))} (default {f.default!r})"
                           if f.name != "peers" else HELP["peers"])
    serve.set_defaults(run=cmd_serve)
    status = sub.add_parser("status", help="show a running daemon's members, peers, tensors and steps",
                            description="Show a running daemon's node, generation, peers, trainer sessions and "
                                        "tensors as tables; --json prints the Status reply (zen.v1.StatusReply, "
                                        "every field by its proto name, numbers as JSON numbers) for scripts. "
                                        "It presents the operator token, derived from the cluster secret; "
                                        "without a secret the daemon shows node-level fields only (no jobs, "
                                        "tensors, sessions or peer addresses), and --drain / --undrain refuse.")
    _add_daemon_address(status)
    change = status.add_mutually_exclusive_group()
    change.add_argument("--drain", type=float, default=None, metavar="SECONDS",
                        help="ask the daemon to drain (finish steps in flight, refuse new ones; health NOT_SERVING)")
    change.add_argument("--undrain", action="store_true",
                        help="undo a drain: admit steps again (health SERVING once the node is whole)")
    _add_secret_file(status)
    status.add_argument("--json", action="store_true", help="print the reply as JSON instead of tables")
    status.set_defaults(run=cmd_status)
    health = sub.add_parser("health", help="exit 0 if the daemon's grpc.health.v1 check says SERVING (probes)")
    _add_daemon_address(health)
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(run=cmd_health)
    store = sub.add_parser("store", help="host the rendezvous store of an elastic cluster (--elastic 1)",
                           description="Host torch's TCPStore that the rounds of an elastic zen cluster live in; "
                                       "it must outlive every daemon (run it beside the cluster, not in a node).")
    store.add_argument("--listen", required=True, metavar="HOST:PORT",
                       help="the address to listen on, and only that one (0.0.0.0 for every interface)")
    store.add_argument("--max-memory-bytes", type=int, default=2 << 30,
                       help="memory the store may take for what clients write (default 2 GiB); past it the store "
                            "process ends, to be restarted by its supervisor: the daemons' running generations do "
                            "not need it, and they write their round back into a store that restarted empty")
    store.set_defaults(run=cmd_store)
    secret = sub.add_parser("secret", help="print a new random cluster secret (or write it to a file, mode 0600)",
                            description="Make a cluster secret: 32 random bytes, printed as one line starting with "
                                        "'zen1.'. Give every node the same one (--secret-file, "
                                        "$ZEN_CLUSTER_SECRET_FILE or $ZEN_CLUSTER_SECRET).")
    secret.add_argument("--out", default=None, metavar="FILE",
                        help="write it to FILE (created with mode 0600; an existing file is refused)")
    secret.set_defaults(run=cmd_secret)
    token = sub.add_parser("token", help="print a job's token (what its trainers present to the daemon), or the "
                                         "operator token (zend status, Drain, Undrain)")
    which = token.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", help="the job whose token to print")
    which.add_argument("--operator", action="store_true",
                       help="print the operator token: gRPC metadata 'authorization: Bearer <token>' of the "
                            "Operator service (full Status, Drain, Undrain)")
    _add_secret_file(token)
    token.set_defaults(run=cmd_token)


def _add_secret_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--secret-file", default=None,
                        help="file with the cluster secret (default $ZEN_CLUSTER_SECRET_FILE, else the secret "
                             "itself from $ZEN_CLUSTER_SECRET)")


def _add_daemon_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket-dir", default=None,
                        help=f"the daemon's socket folder (default ${paths.SOCKET_DIR_ENV}, else "
                             f"{paths.DEFAULT_SOCKET_DIR})")
    parser.add_argument("--address", default=None, help="gRPC HOST:PORT instead of the unix socket")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help=f"with --address: TLS, trusting the CA certificates in FILE (PEM; default "
                             f"${TLS_CA_ENV}); for a daemon with operator_tls_cert_file")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="with --tls-ca: the name the daemon's certificate must carry, when --address "
                             "gives an IP address or another name")


def _daemon_address(args: argparse.Namespace) -> str:
    return args.address or paths.grpc_address(args.socket_dir or paths.socket_dir_from_env())


def _daemon_tls(args: argparse.Namespace) -> OperatorChannelTls | None:
    """TLS for --address when a CA is given (--tls-ca or $ZEN_OPERATOR_TLS_CA_FILE); None for the unix
    socket or a daemon in clear. OSError naming the file if it cannot be read."""
    ca_file = args.tls_ca or os.environ.get(TLS_CA_ENV)
    if not args.address or not ca_file:
        return None
    return OperatorChannelTls.from_files(ca_file, args.tls_server_name)


def cmd_serve(args: argparse.Namespace) -> int:
    from zend.daemon.daemon import Daemon, Stopping
    from zend.daemon.logs import setup_logging
    from zend.daemon.operator_tls import OperatorTlsError
    from zend.daemon.secret import SecretError
    from zend.runtime.tuning import tune_process

    flags = {name: getattr(args, name) for name in FIELDS}
    try:
        settings = resolve(flags, config_file=args.config)
    except SettingsError as exc:
        print(f"zend serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_format, settings.log_level)
    tune_process(settings.threads)  # few threads, pages kept (benchmarks/daemon_overhead.py shows both matter)
    try:
        daemon = Daemon(settings)  # reads the cluster secret
    except (OSError, SecretError) as exc:
        print(f"zend serve: cluster secret: {exc}", file=sys.stderr)
        return 2
    except OperatorTlsError as exc:
        print(f"zend serve: {exc}", file=sys.stderr)
        return 2
    stop_requested = []

    def on_signal(signum: int, frame: object) -> None:
        stop_requested.append(signum)
        daemon.request_stop()  # also ends a join that waits to try the rendezvous again
        log.info("signal received, draining", extra={"event": "signal", "signal": signal.Signals(signum).name})

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon.start()
    except Stopping:
        daemon.stop()
        return 0
    except Exception as exc:  # a port that will not bind, a peer that never comes: stop now, say why
        log.error("start failed", extra={"event": "start_failed", "error": str(exc)})
        print(f"zend serve: {exc}", file=sys.stderr)
        daemon.stop()
        return 1
    while not stop_requested and not daemon.wait(0.2):
        pass
    daemon.drain(settings.drain_timeout_s, final=True)
    daemon.stop()
    return 0


def _operator_token(secret_file: str | None) -> str | None:
    """The operator token from the cluster secret, read as `zend serve` reads it; None when no secret is set.
    OSError or SecretError when one is named but cannot be used."""
    from zend.daemon.jobs import operator_token
    from zend.daemon.secret import load_secret, secret_given

    return operator_token(load_secret(secret_file)) if secret_given(secret_file) else None


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from zend.api.zen.v1 import zen_pb2 as pb
    from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
    from zend.daemon.secret import HOW_TO_SET, SecretError
    from zend.protocol.operator_channel import operator_channel

    address = _daemon_address(args)
    try:
        token = _operator_token(args.secret_file)
    except (OSError, SecretError) as exc:
        print(f"zend status: cluster secret: {exc}", file=sys.stderr)
        return 2
    try:
        tls = _daemon_tls(args)
    except OSError as exc:
        print(f"zend status: {exc.strerror}", file=sys.stderr)
        return 2
    if token is None and (args.drain is not None or args.undrain):
        print(f"zend status: --{'drain' if args.drain is not None else 'undrain'} needs the operator token, "
              f"derived from the cluster secret, and no secret is set: {HOW_TO_SET}", file=sys.stderr)
        return 2
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with operator_channel(address, tls) as channel:
        stub = pb_grpc.OperatorStub(channel)
        try:
            if args.drain is not None:
                reply = stub.Drain(pb.DrainRequest(timeout_seconds=args.drain), timeout=args.drain + 10,
                                   metadata=metadata)
            elif args.undrain:
                reply = stub.Undrain(pb.UndrainRequest(), timeout=10, metadata=metadata)
            else:
                reply = stub.Status(pb.StatusRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"zend status: daemon at {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.drain is None and not args.undrain and reply.redacted:
        print(f"zend status: no cluster secret set, so no operator token: showing the redacted view (no jobs, "
              f"tensors, sessions, pids or peer addresses); {HOW_TO_SET}, for all of it", file=sys.stderr)
    if args.json:
        print(json.dumps(message_dict(reply), indent=1))
    elif args.drain is not None:
        print(f"zend status: {address} drained: {reply.completed} steps completed, {reply.abandoned} abandoned")
    elif args.undrain:
        print(f"zend status: {address} undrained: " + ("serving" if reply.serving else f"not serving yet: "
                                                                                        f"{reply.reason}"))
    else:
        print(format_status(reply))
    return 0


def message_dict(message: Any) -> dict[str, Any]:
    """Every field of a proto message by its proto name, numbers as numbers and enums by name.

    Not json_format.MessageToDict: proto3's JSON mapping writes 64-bit integers as strings
    (generation "1", steps "3"), which scripts then have to convert back.
    """

    def value(field: Any, v: Any) -> Any:
        if field.type == field.TYPE_MESSAGE:
            return message_dict(v)
        if field.type == field.TYPE_ENUM:
            return _enum_name(field, v)
        return v

    return {f.name: [value(f, v) for v in getattr(message, f.name)] if is_repeated(f)
            else value(f, getattr(message, f.name)) for f in message.DESCRIPTOR.fields}


def _listed(shown: int, total: int) -> str:
    """'12', or '1000 of 20000 shown' where the daemon listed only the first rows."""
    return str(shown) if shown >= total else f"{shown} of {total} shown"


def format_status(reply: Any) -> str:
    """A StatusReply as a person reads it: the node, then a table each of peers, sessions, in-memory checkpoints
    and tensors."""
    state = "DRAINING" if reply.draining else (reply.state or "serving")
    if reply.state_reason:
        state += f" ({reply.state_reason})"
    ucx = f" ({', '.join(reply.ucx_transports)})" if reply.ucx_transports else ""
    engine = f" ({reply.data_plane_engine} engine)" if reply.data_plane_engine else ""
    lines = [f"node {reply.node_rank} of {reply.node_count}, generation {reply.generation}, cluster "
             f"{reply.cluster_id!r}, zend {reply.daemon_version}: {state}",
             f"membership {reply.membership}; transport {reply.transport}{ucx}"
             f"{engine}; {reply.steps_in_flight} steps in "
             f"flight; shared buffers {_mb(reply.buffer_pool_bytes)}"]
    if reply.last_membership_change:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(reply.last_membership_change_unix))
        lines.append(f"last membership change {when}: {reply.last_membership_change}")
    if reply.redacted:
        lines += ["", *_table(f"peers ({len(reply.peers)})", ["rank", "state"],
                              [[p.rank, "connected" if p.connected else "down"] for p in reply.peers])]
        lines += ["", f"sessions: {reply.session_count}; tensors: {reply.tensor_count} (redacted: no operator "
                      "token; jobs, tensors, pids and addresses need the cluster secret)"]
        return "\n".join(lines)
    lines += ["", *_table(f"peers ({len(reply.peers)})", ["rank", "address", "state"],
                          [[p.rank, p.address, "connected" if p.connected else f"down: {p.error or '?'}"]
                           for p in reply.peers])]
    lines += ["", *_table(f"sessions ({_listed(len(reply.sessions), reply.session_count)})",
                          ["session", "job", "local rank", "pid", "buffers"],
                          [[x.session_id, x.job_id, x.local_rank, x.pid, _mb(x.buffer_bytes)]
                           for x in reply.sessions])]
    lines += ["", *_table(f"checkpoints in memory ({len(reply.checkpoints)} jobs)",
                          ["job", "last complete", "steps held", "bytes"],
                          [[c.job_id, c.last_complete_step if c.last_complete_step >= 0 else "-",
                            ",".join(map(str, c.steps)) or "-", _mb(c.bytes)] for c in reply.checkpoints])]
    lines += ["", *_table(f"tensors ({_listed(len(reply.tensors), reply.tensor_count)})",
                          ["job", "tensor", "id", "shape", "dtype", "layout", "scheme", "steps", "last step",
                           "sync ms", "rows in", "rows out", "sent", "push/pull"],
                          [[t.job_id, t.name, t.tensor_id, "x".join(map(str, t.shape)),
                            _field_name(t, "dtype"), _field_name(t, "layout"), t.scheme, t.steps,
                            *([t.last_step, f"{t.last_sync_seconds * 1e3:.1f}", t.last_nnz_in, t.last_nnz_out,
                               _mb(t.last_bytes_sent), f"{t.last_push_imbalance:.2f}/{t.last_pull_imbalance:.2f}"]
                              if t.steps else ["-"] * 6)]  # "0" would claim a step 0 that never ran
                           for t in reply.tensors])]
    return "\n".join(lines)


# right-aligned in `zend status`'s tables: numbers, sizes and ratios; the rest is text, left-aligned
NUMERIC_COLUMNS = frozenset({"rank", "local rank", "pid", "buffers", "id", "shape", "steps", "last step", "sync ms",
                             "rows in", "rows out", "sent", "push/pull", "last complete", "bytes"})


def _table(title: str, header: list[str], rows: list[list[Any]]) -> list[str]:
    """Columns as wide as their widest cell, under a title line."""
    if not rows:
        return [f"{title}: none"]
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [f"{title}:", *("  ".join(c.rjust(w) if name in NUMERIC_COLUMNS else c.ljust(w)
                                     for c, w, name in zip(row, widths, header, strict=True)).rstrip()
                           for row in cells)]


def _enum_name(field: Any, number: int) -> str | int:
    """An enum field's value by name; the number itself when it is newer than these stubs."""
    known = field.enum_type.values_by_number.get(number)
    return known.name if known is not None else number


def _field_name(message: Any, field: str) -> str:
    return str(_enum_name(message.DESCRIPTOR.fields_by_name[field], getattr(message, field))).lower()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def cmd_health(args: argparse.Namespace) -> int:
    import grpc

    from zend.protocol.health import health_status

    address = _daemon_address(args)
    try:
        tls = _daemon_tls(args)
    except OSError as exc:
        print(f"zend health: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        status = health_status(address, args.timeout, tls)
    except grpc.RpcError as exc:
        print(f"zend health: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"zend health: {address}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_store(args: argparse.Namespace) -> int:
    import threading

    import torch.distributed  # noqa: F401  (before the cap: what the store's clients write is what it bounds)

    from zend.daemon.elastic import serve_store

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        print(f"zend store: --listen {args.listen!r} must be HOST:PORT", file=sys.stderr)
        return 2
    if args.max_memory_bytes <= 0:
        print(f"zend store: --max-memory-bytes {args.max_memory_bytes} must be positive", file=sys.stderr)
        return 2
    limit = cap_memory(args.max_memory_bytes)
    stop, full = threading.Event(), []
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def watch() -> None:
        """Past 90% of the cap: at the cap the store drops writers but keeps what it holds, so end it here,
        and the supervisor's restart frees the memory (the daemons write their round back)."""
        while not stop.wait(1.0):
            if data_bytes() > limit - 0.1 * args.max_memory_bytes:
                full.append(data_bytes() - (limit - args.max_memory_bytes))
                stop.set()

    threading.Thread(target=watch, name="memory", daemon=True).start()
    try:
        serve_store(host, int(port), stop, ready=lambda: print(f"zend store: serving on {args.listen}", flush=True))
    except Exception as exc:
        print(f"zend store: cannot serve on {args.listen}: {exc}", file=sys.stderr)
        return 1
    if full:
        print(f"zend store: what clients wrote takes {full[0]} bytes, over 90% of --max-memory-bytes "
              f"{args.max_memory_bytes}: exiting so that a restart frees it", file=sys.stderr)
        return 3
    return 0


def data_bytes() -> int:
    """This process's data segment (heap and private mappings), from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmData:")) * 1024


def cap_memory(extra_bytes: int) -> int:
    """Let this process's data grow by `extra_bytes` at most (RLIMIT_DATA): a store's memory is whatever its
    clients write, and a stranger who reaches it can write without end. Returns the limit."""
    import resource

    limit = data_bytes() + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def cmd_secret(args: argparse.Namespace) -> int:
    from zend.daemon.secret import new_secret

    text = new_secret()
    if args.out is None:
        print(text)
        return 0
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        print(f"zend secret: cannot create {args.out}: {exc}", file=sys.stderr)
        return 2
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from zend.daemon.jobs import job_token, operator_token
    from zend.daemon.secret import SecretError, load_secret

    try:
        secret = load_secret(args.secret_file)
        print(operator_token(secret) if args.operator else job_token(secret, args.job))
    except (OSError, SecretError) as exc:
        print(f"zend token: {exc}", file=sys.stderr)
        return 2  # as `zend serve` without a usable secret: a setting to fix, not a failure to retry
    return 0
