"""A local training job: NODES x TRAINERS ranks of a script on this machine, with torchrun's
variables, and a zen cluster beside them when the job uses zen (the examples' --launch)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from zend.cluster.local import LocalCluster, free_port
from zend.protocol import paths


def rank_env(node: int, local: int, nodes: int, trainers: int, master_port: int, cluster: LocalCluster | None,
             job: str) -> dict[str, str]:
    """torchrun's variables for one rank, and the sidecar's ZEN_* ones when there is a cluster."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "RANK": str(node * trainers + local),
           "WORLD_SIZE": str(nodes * trainers), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(trainers),
           "OMP_NUM_THREADS": "1"}
    if cluster is not None:
        env.update({paths.SOCKET_DIR_ENV: cluster.socket_dir(node), "ZEN_JOB": job,
                    "ZEN_JOB_TOKEN": cluster.token(job)})
    return env


def run_local_job(argv: Sequence[str], nodes: int, trainers: int, job: str, with_zen: bool,
                  restart_daemon_at: int | None = None) -> int:
    """`argv` as NODES x TRAINERS ranks on this machine (with a zend cluster if `with_zen`).

    Returns the worst exit code; when a rank fails, the others (which would wait for it in
    their process group) are stopped at once. With `restart_daemon_at` the cluster is elastic
    and node 1's daemon is killed (-9) and started again when rank 0 asks (examples/common.py).
    """
    with tempfile.TemporaryDirectory(prefix=f"zen-{job}-") as tmp, contextlib.ExitStack() as stack:
        faults = restart_daemon_at is not None and with_zen and nodes > 1
        extra = ["--log-format", "text", *(["--peer-timeout-s", "2"] if faults else [])]
        cluster = stack.enter_context(LocalCluster(nodes, Path(tmp), extra=extra, elastic=faults)) \
            if with_zen else None
        port = free_port()
        fault_env = {"ZEN_EXAMPLE_FAULT_DIR": tmp} if faults else {}
        procs = [subprocess.Popen(list(argv), env={**os.environ, **rank_env(n, r, nodes, trainers, port, cluster, job),
                                                   **fault_env})
                 for n in range(nodes) for r in range(trainers)]
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    break
                if cluster is not None and faults and os.path.exists(os.path.join(tmp, "request")):
                    os.unlink(os.path.join(tmp, "request"))
                    cluster.kill(1)
                    cluster.start_node(1)
                    open(os.path.join(tmp, "done"), "w").close()
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    return max(abs(p.returncode) for p in procs)
