"""What the zend daemon path costs against the same scheme over the same transport, called directly.

Two modes in one run, on this machine, with the same n, scheme and tcp:// on loopback, taking
turns size by size so that both see the same load:

  direct  n worker processes, each with its own tcp:// transport, call `scheme.sync` on their
          gradient (a tiny all-to-all on the same transport lines the ranks up before each step);
  daemon  `LocalCluster(n)` with one trainer process per node timing `TrainerSession.allreduce`:
          the copy into the shared buffer, the gRPC Submit, the daemon's work, reading the result
          (a 1-row allreduce through the daemons lines the trainers up before each step).

Gradients are row-sparse, rows of 256 fp32 (1 KiB), SIZE MiB per node (SIZE x 1024 rows, sorted
unique, seeded per node) out of --table-factor times as many rows, built before any timing. A
step's time is the slowest rank's; the table shows medians over --steps after one warm-up, the
daemon's phases (from the Submit reply; deliver from its Prometheus histogram), the trainer-side
parts, and each daemon-path operation replayed alone on the same buffers. The last row is the
control-plane latency: a 1-row gradient, i.e. the fixed cost of one step.

    .venv/bin/python benchmarks/daemon_overhead.py [--nodes 2] [--scheme zen] [--sizes 1,4,16,64,256]
        [--steps 5] [--copy] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import secrets
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ROW = 256  # fp32 values per row: 1 KiB rows
PREFIX = "@@ "  # protocol lines between this script and its workers; anything else on stdout is ignored


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def make_grad(node: int, nnz: int, rows: int, label: str) -> Any:
    """Sorted unique row indices and N(0, 1) values, the same in both modes for a given node."""
    from zend.core.sparse import SparseGrad

    g = torch.Generator().manual_seed(1_000_003 * (node + 1) + sum(map(ord, label)))
    indices = torch.randperm(rows, generator=g)[:nnz].sort().values
    return SparseGrad(indices, torch.randn(nnz, ROW, generator=g), rows, label, True)


def checksum(grad: Any) -> list[float]:
    return [grad.nnz, float(grad.values.double().sum())]


def send_line(obj: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_command() -> Any:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else {"op": "quit"}


# ---------------------------------------------------------------------------- direct worker
def direct_worker(args: argparse.Namespace) -> None:
    """Commands: prepare (build the gradient), step (line up, time one sync), finish (drop it)."""
    from zend.core import Channel, make_scheme
    from zend.core.comm import barrier
    from zend.daemon.secret import load_secret
    from zend.daemon.settings import Settings
    from zend.runtime.tuning import tune_process
    from zend.transport import create

    tune_process(args.threads)  # the same process tuning as `zend serve --threads N`
    transport = create("tcp://127.0.0.1:0", args.rank, args.world_size, cluster_id="overhead",
                       secret=load_secret(), timeout_s=120)
    try:
        send_line({"port": transport.address[1]})
        peers = {int(k): (v[0], int(v[1])) for k, v in json.loads(sys.stdin.readline()).items()}
        transport.connect(peers)
        d = Settings()  # the scheme exactly as `zend serve` makes it (its default min_slice_width is not zen's)
        scheme = make_scheme(args.scheme, seed=d.hash_seed, min_slice_width=d.min_slice_width,
                             reprofile_every=d.reprofile_every)

        grad: Any = None
        label = ""
        while (cmd := read_command())["op"] != "quit":
            if cmd["op"] == "prepare":
                label, grad = cmd["label"], make_grad(args.rank, cmd["nnz"], cmd["rows"], cmd["label"])
                send_line({})
            elif cmd["op"] == "step":
                barrier(transport, f"b/{label}/{cmd['step']}", 120)
                t0 = time.perf_counter()
                result = scheme.sync(Channel(transport, f"{label}/{cmd['step']}", 120), grad)
                seconds = time.perf_counter() - t0
                send_line({"seconds": seconds, "check": checksum(result.grad)})
                del result
            else:  # finish
                grad = None
                send_line({})
        barrier(transport, "end", 120)
    finally:
        transport.close()


# ---------------------------------------------------------------------------- trainer (daemon mode)
class Clock:
    """Trainer-side instrumentation: seconds per part of the last allreduce."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def timed(self, name: str, fn: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0


def timed_spec(spec: Any, clock: Clock) -> Any:
    """The same TensorSpec, whose write (trainer -> input buffer) and read (result buffer -> trainer) are timed."""
    from zend.protocol.layout import TensorSpec

    class TimedSpec(TensorSpec):
        def write(self, grad: Any, view: Any, offset: int) -> None:
            clock.timed("write", super().write, grad, view, offset)

        def read(self, view: Any, offset: int, nnz: int, check: bool = True) -> Any:
            return clock.timed("read", super().read, view, offset, nnz, check)

    return TimedSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})


def timed_submit(link: Any, clock: Clock) -> None:
    """The session's step submission (the round trip, on the socket or by gRPC, and all the daemon's work) timed."""
    submit = link.submit
    link.submit = lambda *a, **kw: clock.timed("submit", submit, *a, **kw)


def deliver_total(port: int) -> float:
    """Seconds the daemon has spent delivering results so far (its Prometheus histogram, all schemes).
    The endpoint renders its page at most once a second and serves ~10 scrapes a second: wait out the
    cache, and ask only around a case, never per step."""
    if not port:
        return float("nan")
    time.sleep(1.1)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(v) for v in re.findall(
        r'^zen_sync_duration_seconds_sum\{[^}]*phase="deliver"[^}]*\} (\S+)$', text, re.M))


def replay(spec: Any, handle: Any, nnz: int, result_nnz: int, reps: int) -> dict[str, float]:
    """Each operation of the daemon path alone, on the same shared buffers (the daemons are idle now)."""
    from zend.daemon.node_steps import local_sum
    from zend.protocol.layout import TensorSpec

    base = TensorSpec  # its plain methods: `spec` times its own
    view_in, view_out = handle.input.view, handle.result.view
    part = base.read(spec, view_in, 0, nnz)
    result = base.read(spec, view_out, 0, result_nnz, False)
    owned = result.values.clone()

    ops = {
        "daemon read (spec.read, checked)": lambda: base.read(spec, view_in, 0, nnz),
        "  of which NaN/Inf check (sum first)": lambda: bool(torch.isfinite(part.values.sum())),
        "  exact scan (only if the sum is not finite)": lambda: bool((~torch.isfinite(part.values)).any()),
        "daemon local_sum (1 part)": lambda: local_sum(spec, [part]),
        "daemon result write (deliver)": lambda: base.write(spec, result.with_values(owned), view_out, 0),
        "trainer read (spec.read, unchecked)": lambda: base.read(spec, view_out, 0, result_nnz, False),
        "trainer clone of values": lambda: result.values.clone(),
    }
    out = {}
    for name, fn in ops.items():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = median(times)
    return out


def grpc_roundtrip(channel: Any, calls: int = 50) -> float:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, times = health_pb2_grpc.HealthStub(channel), []
    for _ in range(calls):
        t0 = time.perf_counter()
        stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        times.append(time.perf_counter() - t0)
    return median(times)


def trainer_worker(args: argparse.Namespace) -> None:
    """Commands: prepare (register, build), step (line up, time one allreduce), finish (replay the parts)."""
    from zend.protocol.session import TrainerSession

    clock = Clock()
    with TrainerSession(args.socket_dir, "overhead", os.environ["ZEN_JOB_TOKEN"], timeout_s=300,
                        steps_on_socket=not args.grpc_submit) as link:
        timed_submit(link, clock)
        fence = link.register("barrier", (4, ROW))
        fence_grad = make_grad(args.rank, 1, 4, "barrier")
        fence_step = 0
        handle: Any = None
        grad: Any = None
        nnz_out = 0
        send_line({})
        while (cmd := read_command())["op"] != "quit":
            if cmd["op"] == "prepare":
                handle = link.register(cmd["label"], (cmd["rows"], ROW))
                handle.spec = timed_spec(handle.spec, clock)
                grad = make_grad(args.rank, cmd["nnz"], cmd["rows"], cmd["label"])
                delivered, timed_steps = deliver_total(args.metrics_port), 0
                send_line({})
            elif cmd["op"] == "step":
                link.allreduce(fence, fence_grad, fence_step, copy=False)  # line the nodes up
                fence_step += 1
                timed_steps += 1
                clock.parts = {}
                t0 = time.perf_counter()
                out = link.allreduce(handle, grad, cmd["step"], copy=cmd["copy"])
                seconds = time.perf_counter() - t0
                nnz_out = out.nnz
                phases = dict(handle.last_reply.phases)
                parts = {k: clock.parts.get(k, 0.0) for k in ("write", "submit", "read")}
                parts["rest"] = seconds - sum(parts.values())
                send_line({"seconds": seconds, "check": checksum(out), "phases": phases, "parts": parts})
                del out
            else:  # finish
                reps = 3 if grad.nnz >= 16384 else 15
                # the mean deliver per step (its fence's 1-row deliver included), from the daemon's histogram
                deliver_s = (deliver_total(args.metrics_port) - delivered) / max(1, timed_steps)
                reply: dict[str, Any] = {"ops": replay(handle.spec, handle, grad.nnz, nnz_out, reps),
                                         "deliver_s": deliver_s}
                if grad.nnz == 1:  # the floor of the control plane: a no-op gRPC call on the same channel
                    reply["grpc_s"] = grpc_roundtrip(link.channel)
                grad = handle = None
                send_line(reply)


# ---------------------------------------------------------------------------- the parent
class Worker:
    """A child process speaking PREFIX lines on stdout, JSON commands on stdin; stderr to a log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, name: str):
        self.name, self.log = name, log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                         start_new_session=True)
        self._buf = b""

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(PREFIX):
                    return json.loads(text[len(PREFIX):])
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name}: no answer within {timeout_s:.0f} s\n{self.tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.proc.wait(5)
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}\n{self.tail()}")
                self._buf += chunk

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # EOF: the worker says goodbye and exits
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


def run_all(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Both modes, size by size; within a size, step by step (alternating which mode goes first)."""
    from zend.cluster.local import LocalCluster

    n = args.nodes
    me = [sys.executable, str(Path(__file__).resolve())]
    # every process (daemons, direct workers, trainers) gets the same torch intra-op threads
    threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **threads}
    cases = [(f"{mb:g}MiB", int(mb * 1024), args.steps) for mb in args.sizes]
    cases.append(("1row", 1, args.tiny_steps))
    workers: list[Worker] = []
    results: dict[str, Any] = {"cases": []}
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(LocalCluster(n, workdir / "cluster", env=threads, extra=[
            "--scheme", args.scheme, "--threads", str(args.threads)]))
        stack.callback(lambda: [w.stop() for w in workers])  # first the workers, then the daemons
        secret_env = {**env, "ZEN_CLUSTER_SECRET": secrets.token_hex(24)}
        direct = [Worker([*me, "--worker", "direct", "--rank", str(r), "--world-size", str(n),
                          "--scheme", args.scheme, "--threads", str(args.threads)], secret_env,
                         workdir / f"direct{r}.log", f"direct rank {r}")
                  for r in range(n)]
        workers += direct
        ports = [w.recv(120)["port"] for w in direct]
        peers = {str(r): ["127.0.0.1", ports[r]] for r in range(n)}
        for w in direct:
            w.send(peers)
        token_env = {**env, "ZEN_JOB_TOKEN": cluster.token("overhead")}
        trainers = [Worker([*me, "--worker", "trainer", "--rank", str(r), "--socket-dir", cluster.socket_dir(r),
                            "--metrics-port", str(cluster.metrics_ports[r]),
                            *(["--grpc-submit"] if args.grpc_submit else [])], token_env,
                           workdir / f"trainer{r}.log", f"trainer of node {r}") for r in range(n)]
        workers += trainers
        for w in trainers:
            w.recv(120)
        groups = {"direct": direct, "daemon": trainers}

        def ask(group: list[Worker], cmd: dict[str, Any], timeout_s: float = 600) -> list[Any]:
            for w in group:
                w.send(cmd)
            return [w.recv(timeout_s) for w in group]

        for label, nnz, steps in cases:
            rows = max(4, args.table_factor * nnz)
            for group in groups.values():
                ask(group, {"op": "prepare", "label": label, "nnz": nnz, "rows": rows})
            got: dict[str, list[list[Any]]] = {"direct": [], "daemon": []}
            for step in range(steps + 1):  # step 0 warms up
                for mode in ("direct", "daemon") if step % 2 else ("daemon", "direct"):
                    got[mode].append(ask(groups[mode], {"op": "step", "step": step, "copy": args.copy}))
            finished = ask(trainers, {"op": "finish"})
            ops = [r["ops"] for r in finished]
            ask(direct, {"op": "finish"})
            case: dict[str, Any] = {"label": label, "nnz": nnz, "rows": rows, "mib": nnz / 1024, "steps": steps}
            if "grpc_s" in finished[0]:
                case["grpc_roundtrip_s"] = median([r["grpc_s"] for r in finished])
            for mode, per_step in got.items():
                seconds = [max(r["seconds"] for r in replies) for replies in per_step[1:]]  # slowest rank
                case[mode] = {"median_s": median(seconds), "per_step_s": seconds, "check": per_step[-1][0]["check"],
                              "ranks": [[{k: v for k, v in r.items() if k != "check"} for r in replies]
                                        for replies in per_step[1:]]}
            slowest = [max(replies, key=lambda r: r["seconds"]) for replies in got["daemon"][1:]]
            for kind, keys in (("phases", ("wait", "local_sum", "exchange", "deliver")),
                               ("parts", ("write", "submit", "read", "rest"))):  # the slowest node's, per step
                case["daemon"][kind] = {k: median([r[kind].get(k, 0.0) for r in slowest]) for k in keys}
            case["daemon"]["phases"]["deliver"] = max(r["deliver_s"] for r in finished)  # mean per step
            case["daemon"]["phases"]["agree"] = sum(r["phases"].get("agree", 0.0) for r in got["daemon"][0]) / n
            case["daemon"]["ops"] = {k: sum(o[k] for o in ops) / n for k in ops[0]}
            d, m = case["direct"]["median_s"], case["daemon"]["median_s"]
            case["overhead"] = (m - d) / d
            a, b = case["direct"]["check"], case["daemon"]["check"]
            case["same_result"] = a[0] == b[0] and math.isclose(a[1], b[1], rel_tol=1e-6, abs_tol=1e-3)
            results["cases"].append(case)
            print(f"  {label}: direct {d * 1e3:.2f} ms, daemon {m * 1e3:.2f} ms", file=sys.stderr, flush=True)
    return results


def format_report(args: argparse.Namespace, res: dict[str, Any], seconds: float) -> str:
    big = [c for c in res["cases"] if c["label"] != "1row"]
    tiny = next(c for c in res["cases"] if c["label"] == "1row")
    out = [f"zend daemon overhead: {args.nodes} nodes on loopback, scheme {args.scheme}, tcp://, rows of {ROW} fp32 "
           f"(1 KiB), table {args.table_factor}x nnz rows; median of {args.steps} steps after 1 warm-up (slowest "
           f"rank per step), modes alternating step by step; trainer result copy {'on' if args.copy else 'off'}; "
           f"torch threads per process: {args.threads or 'default'}",
           "",
           f"{'MiB/node':>8} {'nnz rows':>8} {'direct ms':>10} {'daemon ms':>10} {'overhead':>9} | slowest node ms: "
           f"{'wait':>6} {'local_sum':>9} {'agree*':>7} {'exchange':>9} {'deliver':>8} | {'same sum':>8}"]
    for c in big:
        ph = {k: v * 1e3 for k, v in c["daemon"]["phases"].items()}
        out.append(f"{c['mib']:>8g} {c['nnz']:>8} {c['direct']['median_s'] * 1e3:>10.2f} "
                   f"{c['daemon']['median_s'] * 1e3:>10.2f} {c['overhead']:>+9.1%} | {'':>17}{ph['wait']:>6.2f} "
                   f"{ph['local_sum']:>9.2f} {ph['agree']:>7.2f} {ph['exchange']:>9.2f} {ph['deliver']:>8.2f} "
                   f"| {'yes' if c['same_result'] else 'NO':>8}")
    d_us, m_us = tiny["direct"]["median_s"] * 1e6, tiny["daemon"]["median_s"] * 1e6
    ph = {k: v * 1e6 for k, v in tiny["daemon"]["phases"].items()}
    out += [f"{'1 row':>8} {1:>8} {'':>10} {'':>10} {'':>9} | control-plane latency, median of {tiny['steps']} "
            f"steps: direct {d_us:.0f} µs, daemon {m_us:.0f} µs, fixed cost {m_us - d_us:.0f} µs per step",
            f"{'':>49}| daemon phases µs: wait {ph['wait']:.0f}, local_sum {ph['local_sum']:.0f}, exchange "
            f"{ph['exchange']:.0f}, deliver {ph['deliver']:.0f}; a no-op gRPC call (Health.Check) "
            f"{tiny.get('grpc_roundtrip_s', float('nan')) * 1e6:.0f} µs",
            "* agree runs once per tensor, at its first (warm-up) step: shown from that step, not in the medians",
            "", "where the daemon time goes, ms (per step, the slowest node's trainer; median over steps):",
            f"{'MiB/node':>8} {'daemon':>8} = {'trainer write':>13} + {'Submit rpc':>10} + {'trainer read':>12} + "
            f"{'rest':>6} | Submit = {'phases':>7} + {'other':>6} | {'exchange - direct':>17}"]
    for c in [*big, tiny]:
        parts = {k: v * 1e3 for k, v in c["daemon"]["parts"].items()}
        phases = sum(c["daemon"]["phases"][p] for p in ("wait", "local_sum", "exchange", "deliver")) * 1e3
        gap = (c["daemon"]["phases"]["exchange"] - c["direct"]["median_s"]) * 1e3
        label = f"{c['mib']:g}" if c is not tiny else "1 row"
        out.append(f"{label:>8} {c['daemon']['median_s'] * 1e3:>8.2f} = {parts['write']:>13.2f} + "
                   f"{parts['submit']:>10.2f} + {parts['read']:>12.2f} + {parts['rest']:>6.2f} | "
                   f"         {phases:>7.2f} + {parts['submit'] - phases:>6.2f} | {gap:>+17.2f}")
    out += ["(other = gRPC round trip, the daemon's spec.read, step hand-off threads, metrics and log)",
            "", "each daemon-path operation alone on the same buffers, ms (median of reps, mean over nodes):",
            f"{'operation':<32}" + "".join(f"{c['mib']:>9g}M" for c in big)]
    for name in big[0]["daemon"]["ops"] if big else []:
        out.append(f"{name:<32}" + "".join(f"{c['daemon']['ops'][name] * 1e3:>10.2f}" for c in big))
    out += ["", f"total {seconds:.0f} s"]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--scheme", default="zen", choices=["zen", "dense"])
    p.add_argument("--sizes", default="1,4,16,64,256", help="MiB of gradient per node, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per size, after 1 warm-up")
    p.add_argument("--tiny-steps", type=int, default=30, help="timed steps of the 1-row control-plane case")
    p.add_argument("--table-factor", type=int, default=4, help="rows in the table per non-zero row")
    p.add_argument("--copy", action="store_true",
                   help="time TrainerSession.allreduce with its result copy (default off)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of every process, daemons included (OMP_NUM_THREADS; default 1: "
                        "n processes share this machine's cores; 0 leaves torch's default)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    p.add_argument("--grpc-submit", action="store_true",
                   help="trainers submit steps by gRPC, not on the buffer socket (the path before issue 12)")
    p.add_argument("--workdir", default=None, help="logs (default: a temporary folder, removed after)")
    # the worker processes (internal)
    p.add_argument("--worker", choices=["direct", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--socket-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "direct":
        direct_worker(args)
        return
    if args.worker == "trainer":
        trainer_worker(args)
        return
    args.sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
    if args.nodes < 2 or args.steps < 1 or args.tiny_steps < 1 or not args.sizes:
        p.error("--nodes must be >= 2, --steps and --tiny-steps >= 1, --sizes not empty")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zend-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        res = run_all(args, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({"nodes": args.nodes, "scheme": args.scheme, "steps": args.steps, "copy": args.copy,
                          "seconds": seconds, **res}, indent=1))
    else:
        print(format_report(args, res, seconds))


if __name__ == "__main__":
    main()
