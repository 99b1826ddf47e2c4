"""`zend serve`, `zend status`, `zend health`, `zend token`: the daemon's commands, for zend.cli."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any

from zend.daemon.settings import FIELDS, SettingsError, resolve
from zend.protocol import paths

log = logging.getLogger("zend.daemon")
HELP = {
    "rank": "this node's rank", "world_size": "number of nodes",
    "peers": "comma-separated data-plane URIs of every node, in rank order (tcp://HOST:PORT or ucx://HOST:PORT)",
    "rendezvous": "HOST:PORT of torch's TCPStore (rank 0 hosts it), or 'env': the node's rank from GROUP_RANK "
                  "(torchrun), NODE_RANK, PET_NODE_RANK (Kubeflow) or JOB_COMPLETION_INDEX (Indexed Job / JobSet), "
                  "the node count from GROUP_WORLD_SIZE, NNODES or PET_NNODES, the host from MASTER_ADDR, the port "
                  "from ZEN_RENDEZVOUS_PORT (default 7001, not MASTER_PORT); ZEN_NODE_RANK, ZEN_NUM_NODES and "
                  "ZEN_RENDEZVOUS_ADDR override",
    "elastic": "1: membership by torch's elastic rendezvous over a store that outlives the daemons (`zend store`); "
               "a restarted daemon rejoins, every node moves to a new generation",
    "min_nodes": "with --elastic 1: when a node is lost for --peer-timeout-s, go on as soon as this many nodes "
                 "are left (a smaller generation; 0: wait for every node)",
    "listen": "this node's data-plane URI (default: its entry in --peers)",
    "transport": "tcp, ucx or auto", "secret_file": "file with the cluster secret (or $ZEN_CLUSTER_SECRET_FILE / "
                                                    "$ZEN_CLUSTER_SECRET; never on the command line)",
    "socket_dir": "folder of the trainer sockets zend.sock and buffers.sock",
    "grpc_listen": "extra HOST:PORT for the gRPC services (operators, probes)",
    "metrics_port": "Prometheus port (0: off)",
    "max_tensors_per_job": "tensors one job may register on this node (RESOURCE_EXHAUSTED beyond)",
}


def add_commands(sub: Any) -> None:
    """Add serve, status, health and token to the `zend` command's subparsers."""
    serve = sub.add_parser("serve", help="run the zend daemon of this node",
                           description="Run the zend daemon. Every flag also reads ZEND_<NAME> (e.g. ZEND_WORLD_SIZE) "
                                       "and the TOML file given by --config or $ZEND_CONFIG; flags win.")
    serve.add_argument("--config", default=None, help="TOML file of settings (names as the flags, with _)")
    for f in FIELDS.values():
        kind = {int: int, float: float}.get(type(f.default), str) if f.name != "peers" else str
        serve.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                           help=f"{HELP.get(f.name, f.name.replace('_', ' '))} (default {f.default!r})"
                           if f.name != "peers" else HELP["peers"])
    serve.set_defaults(run=cmd_serve)
    status = sub.add_parser("status", help="show a running daemon's members, peers, tensors and steps")
    _add_daemon_address(status)
    status.add_argument("--drain", type=float, default=None, metavar="SECONDS",
                        help="ask the daemon to drain (finish steps in flight, refuse new ones)")
    status.set_defaults(run=cmd_status)
    health = sub.add_parser("health", help="exit 0 if the daemon's grpc.health.v1 check says SERVING (probes)")
    _add_daemon_address(health)
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(run=cmd_health)
    store = sub.add_parser("store", help="host the rendezvous store of an elastic cluster (--elastic 1)",
                           description="Host torch's TCPStore that the rounds of an elastic zen cluster live in; "
                                       "it must outlive every daemon (run it beside the cluster, not in a node).")
    store.add_argument("--listen", required=True, metavar="HOST:PORT")
    store.set_defaults(run=cmd_store)
    token = sub.add_parser("token", help="print a job's token (what its trainers present to the daemon)")
    token.add_argument("--job", required=True)
    token.add_argument("--secret-file", default=None)
    token.set_defaults(run=cmd_token)


def _add_daemon_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket-dir", default=None,
                        help=f"the daemon's socket folder (default ${paths.SOCKET_DIR_ENV}, else "
                             f"{paths.DEFAULT_SOCKET_DIR})")
    parser.add_argument("--address", default=None, help="gRPC HOST:PORT instead of the unix socket")


def _daemon_address(args: argparse.Namespace) -> str:
    return args.address or paths.grpc_address(args.socket_dir or paths.socket_dir_from_env())


def cmd_serve(args: argparse.Namespace) -> int:
    from zend.daemon.daemon import Daemon
    from zend.daemon.logs import setup_logging
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
    stop_requested = []

    def on_signal(signum: int, frame: object) -> None:
        stop_requested.append(signum)
        log.info("signal received, draining", extra={"event": "signal", "signal": signal.Signals(signum).name})

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon.start()
    except Exception as exc:  # a port that will not bind, a peer that never comes: stop now, say why
        log.error("start failed", extra={"event": "start_failed", "error": str(exc)})
        print(f"zend serve: {exc}", file=sys.stderr)
        daemon.stop()
        return 1
    while not stop_requested and not daemon.wait(0.2):
        pass
    daemon.drain(settings.drain_timeout_s)
    daemon.stop()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from zend.api.zen.v1 import zen_pb2 as pb
    from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc

    address = _daemon_address(args)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.OperatorStub(channel)
        try:
            if args.drain is not None:
                reply = stub.Drain(pb.DrainRequest(timeout_seconds=args.drain), timeout=args.drain + 10)
            else:
                reply = stub.Status(pb.StatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"zend status: daemon at {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True,
                                   always_print_fields_with_no_presence=True), indent=1))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    import grpc

    from zend.protocol.health import health_status

    address = _daemon_address(args)
    try:
        status = health_status(address, args.timeout)
    except grpc.RpcError as exc:
        print(f"zend health: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"zend health: {address}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_store(args: argparse.Namespace) -> int:
    import threading

    from zend.daemon.elastic import serve_store

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        print(f"zend store: --listen {args.listen!r} must be HOST:PORT", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        serve_store(host, int(port), stop, ready=lambda: print(f"zend store: serving on {args.listen}", flush=True))
    except Exception as exc:
        print(f"zend store: cannot serve on {args.listen}: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from zend.daemon.jobs import job_token
    from zend.daemon.secret import SecretError, load_secret

    try:
        print(job_token(load_secret(args.secret_file), args.job))
    except (OSError, SecretError) as exc:
        print(f"zend token: {exc}", file=sys.stderr)
        return 1
    return 0

