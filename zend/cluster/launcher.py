"""A local training job: NODES x TRAINERS ranks of a script on this machine, one torchrun per node,
and a zen cluster beside them when the job uses zen (the examples' --launch); `rank_env` gives the
same variables to ranks a test starts itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from zend.cluster.local import LocalCluster, free_port
from zend.protocol import paths


def rank_env(node: int, local: int, nodes: int, trainers: int, master_port: int, cluster: LocalCluster | None,
             job: str) -> dict[str, str]:
    """torchrun's variables for one rank, and its node's sidecar variables (node_env)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "RANK": str(node * trainers + local),
            "WORLD_SIZE": str(nodes * trainers), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(trainers),
            **node_env(node, cluster, job)}


def wait_for_ranks(procs: Sequence[subprocess.Popen[str]], timeout_s: float, what: str = "a rank") -> list[str]:
    """Every rank's stdout, in order; RuntimeError with the failed rank's stderr tail. A failed rank
    leaves the others waiting for it in their process group: they are killed, never left behind."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"{what} failed:\n{err[-3000:]}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def node_env(node: int, cluster: LocalCluster | None, job: str) -> dict[str, str]:
    """What a node's trainers get from its sidecar: where the daemon is, the job and its token."""
    env = {"OMP_NUM_THREADS": "1"}
    if cluster is not None:
        env.update({paths.SOCKET_DIR_ENV: cluster.socket_dir(node), "ZEN_JOB": job,
                    "ZEN_JOB_TOKEN": cluster.token(job)})
    return env


# torchrun's environment when it restarts trainers: by default its agent's store outlives every life of
# the job, and the process groups of a new life read the dead one's addresses from it (on torch 2.13
# every restart here failed in gloo's connectFullMesh, "Connection refused", with or without zen).
# This switch of torch's c10d rendezvous has rank 0 of each life host a store of its own instead.
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(script: Sequence[str], node: int, nodes: int, trainers: int, master_port: int,
                     master_addr: str = "127.0.0.1", rendezvous_id: str = "zen", max_restarts: int = 0) -> list[str]:
    """torchrun for node `node` of a static multi-node job (node ranks as given, so the trainers of
    node n are ranks n*K .. n*K+K-1, beside daemon n); on this host by default. Node -1: torchrun's
    c10d rendezvous at master_addr:master_port assigns the node ranks (not necessarily the daemon's rank: zen
    needs no relation, a trainer finds its daemon by its socket folder). `max_restarts`: how often torchrun
    restarts the job's trainers after one fails (their loop resumes from the newest in-memory checkpoint)."""
    where = [f"--node-rank={node}", f"--master-addr={master_addr}", f"--master-port={master_port}"] if node >= 0 \
        else ["--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{master_port}", f"--rdzv-id={rendezvous_id}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={trainers}",
            *where, f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *script]


def run_local_job(argv: Sequence[str], nodes: int, trainers: int, job: str, with_zen: bool,
                  restart_daemon_at: int | None = None, run_parent: str | None = None, max_restarts: int = 0) -> int:
    """`argv` (a Python script and its arguments) as NODES x TRAINERS ranks on this machine: one
    torchrun per node, as on a real cluster, each with its node's sidecar variables, beside a zend
    cluster if `with_zen`. torchrun's static rendezvous runs multi-node on one host as well.

    Returns the worst exit code; when a node's torchrun fails, the others (whose ranks would wait
    for it in their process group) are stopped at once. With `restart_daemon_at` the cluster is
    elastic and node 1's daemon is killed (-9) and started again when rank 0 asks (examples/common.py).
    With `max_restarts`, torchrun restarts every trainer of the job after one fails, up to that many times;
    the node ranks then come from its c10d rendezvous, the one that restarts a multi-node job together (with
    static node ranks each node's torchrun restarts alone, and the new ranks never form their group).
    The run's folder (sockets, logs, the cluster's secret) is made under `run_parent` (default: the
    temp folder) and removed at the end; when the job fails the daemons' logs are kept elsewhere
    first, and where is printed.
    """
    outcome = {"failed": True}
    with signals_end_the_job(), tempfile.TemporaryDirectory(prefix=f"zen-{job[:16]}-", dir=run_parent) as tmp, \
            contextlib.ExitStack() as stack:
        stack.callback(lambda: keep_logs(Path(tmp), job) if outcome["failed"] else None)  # after the cluster stops
        faults = restart_daemon_at is not None and with_zen and nodes > 1
        extra = ["--log-format", "text", *(["--peer-timeout-s", "2"] if faults else [])]
        cluster = stack.enter_context(LocalCluster(nodes, Path(tmp), extra=extra, elastic=faults)) \
            if with_zen else None
        port = free_port()
        # the run's folder, for the examples' faults: a daemon restart asked for, a trainer killed once
        fault_env = {"ZEN_EXAMPLE_FAULT_DIR": tmp} if faults or max_restarts else {}
        agents = [subprocess.Popen(torchrun_command(argv, -1 if max_restarts else n, nodes, trainers, port,
                                                    rendezvous_id=job, max_restarts=max_restarts),
                                   env={**os.environ, **node_env(n, cluster, job), **fault_env,
                                        **(RESTART_ENV if max_restarts else {})},
                                   start_new_session=True)  # its own group: stopping it stops its ranks
                  for n in range(nodes)]
        try:
            while any(p.poll() is None for p in agents):
                if any(p.returncode not in (None, 0) for p in agents):
                    break
                if cluster is not None and faults and os.path.exists(os.path.join(tmp, "request")):
                    os.unlink(os.path.join(tmp, "request"))
                    cluster.kill(1)
                    cluster.start_node(1)
                    open(os.path.join(tmp, "done"), "w").close()
                time.sleep(0.2)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, SIGHUP: a stop, not a failure: nothing kept
            outcome["failed"] = False
            raise
        finally:
            for p in agents:
                stop_group(p)
        code = max(abs(p.returncode) for p in agents)
        outcome["failed"] = code != 0
    return code


def keep_logs(run_dir: Path, job: str) -> None:
    """The daemons' logs of a failed job, out of the run folder (which goes) into one of their own."""
    logs = sorted(run_dir.glob("*.log"))
    if not logs:
        return
    kept = Path(tempfile.mkdtemp(prefix=f"zen-logs-{job[:16]}-"))
    for log in logs:
        with contextlib.suppress(OSError):
            shutil.copy2(log, kept / log.name)
    print(f"zen: the job failed; the daemons' logs are in {kept}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def signals_end_the_job() -> Iterator[None]:
    """SIGTERM / SIGHUP (a `timeout`, a cancelled CI job, a closed terminal) unwind like Ctrl-C, so
    that the agents, which run in sessions of their own, are stopped too, not left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, end) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_group(agent: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the agent's process group (torchrun passes it to its ranks), SIGKILL after 10 s."""
    if agent.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)  # ranks left behind by an agent that died first
    agent.wait()
