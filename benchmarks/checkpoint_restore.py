"""How fast a training state comes back: zen's in-memory checkpoints against DCP's file reader and a remote store.

In one run, for a state of --size-mib (one float32 tensor, replicated: data-parallel weights), every figure
from the same machine:
  local memory     1 node, 1 trainer: dcp.save into zend (MemoryWriter), then a new trainer process loads it
                   (dcp.load with MemoryReader): a trainer restarted on a live node
  peer memory      2 nodes in network namespaces behind --peer-rate-mbit links (default 10 Gbit/s), elastic,
                   1 trainer each: both save; node 1's daemon is killed and restarted (its memory gone); the
                   new generation's census brings node 1's objects back from node 0 (the daemon's own timing,
                   zen_checkpoint_recovery_seconds), then node 1's trainer loads from local memory. Reported
                   beside the wire time of the bytes at the link rate.
  local disk       DCP's FileSystemWriter/Reader on this machine's disk (page cache warm: a best case)
  remote store     the DCP files behind a --store-rate-mbit link (default 1 Gbit/s): fetched over HTTP from
                   another namespace, then DCP's file reader
Trainer CPU seconds are reported beside wall seconds. Needs root and iproute2 for the two emulated rows
(`--skip-emulated` runs the others).

    .venv/bin/python benchmarks/checkpoint_restore.py [--size-mib 1024] [--peer-rate-mbit 10000]
        [--store-rate-mbit 1000] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------------- the trainer
def state(size_mib: int, fill: float) -> dict[str, Any]:
    import torch

    n = size_mib * (1 << 20) // 4
    big = torch.arange(n, dtype=torch.float32) if fill else torch.zeros(n, dtype=torch.float32)
    return {"weights": big, "step": torch.tensor(7 if fill else 0)}


def worker(mode: str, size_mib: int, folder: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import zen.checkpoint

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    started, cpu0 = time.perf_counter(), time.process_time()
    out: dict[str, Any] = {}
    if mode == "save":
        zen.checkpoint.Checkpointer().save(state(size_mib, 1.0), 1)
    elif mode == "load":
        sd = state(size_mib, 0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        step = zen.checkpoint.Checkpointer().load_latest(sd)
        out.update(load_s=time.perf_counter() - t0, load_cpu_s=time.process_time() - c0, step=step)
        expected = state(size_mib, 1.0)
        out["exact"] = bool(torch.equal(sd["weights"], expected["weights"]) and int(sd["step"]) == 7)
    elif mode == "file-save":
        dcp.save(state(size_mib, 1.0), storage_writer=dcp.FileSystemWriter(folder), no_dist=world == 1)
    elif mode == "file-load":
        sd = state(size_mib, 0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=world == 1)
        out.update(load_s=time.perf_counter() - t0, load_cpu_s=time.process_time() - c0)
        out["exact"] = bool(torch.equal(sd["weights"], state(size_mib, 1.0)["weights"]))
    out.update(wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu0)
    if world > 1:
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------- the runs
def run_workers(argvs: list[list[str]], envs: list[dict[str, str]], timeout_s: float = 900) -> list[dict[str, Any]]:
    from zend.cluster.launcher import wait_for_ranks

    procs = [subprocess.Popen(a, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **e},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a, e in zip(argvs, envs, strict=True)]
    return [json.loads(out.strip().splitlines()[-1]) for out in wait_for_ranks(procs, timeout_s, "a worker")]


def me(mode: str, args: argparse.Namespace, folder: str = "") -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--size-mib", str(args.size_mib),
            "--folder", folder]


def local_memory(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from zend.cluster.local import LocalCluster

    with LocalCluster(1, work / "local", extra=["--log-format", "text", "--checkpoint-memory-bytes",
                                                str(4 * args.size_mib << 20)]) as c:
        env = {"ZEN_SOCKET_DIR": c.socket_dir(0), "ZEN_JOB": "bench", "ZEN_JOB_TOKEN": c.token("bench")}
        saved = run_workers([me("save", args)], [env])[0]
        loaded = run_workers([me("load", args)], [env])[0]
    return {"restore_s": loaded["load_s"], "restore_cpu_s": loaded["load_cpu_s"], "save_s": saved["wall_s"],
            "exact": loaded["exact"]}


def local_disk(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    folder = str(work / "dcp-files")
    run_workers([me("file-save", args, folder)], [{}])
    loaded = run_workers([me("file-load", args, folder)], [{}])[0]
    return {"restore_s": loaded["load_s"], "restore_cpu_s": loaded["load_cpu_s"], "exact": loaded["exact"]}


def census_seconds(log: Path) -> tuple[float, int]:
    """The (seconds, bytes) of node 1's last recovery, from its daemon's log."""
    for line in reversed(log.read_text().splitlines()):
        m = re.search(r"checkpoint recovered from a peer.*", line)
        if m:
            seconds = float(re.search(r"seconds[=\": ]+([0-9.]+)", line).group(1))  # type: ignore[union-attr]
            nbytes = int(re.search(r"bytes[=\": ]+([0-9]+)", line).group(1))  # type: ignore[union-attr]
            return seconds, nbytes
    raise RuntimeError(f"no recovery in {log}")


def peer_memory(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tests.helpers import node_status, poll_for  # the same polling the tests use
    from zend.cluster.launcher import node_env
    from zend.cluster.local import LocalCluster, free_port
    from zend.cluster.netns import EmulatedCluster

    with EmulatedCluster(2, rate_mbit=args.peer_rate_mbit) as net, LocalCluster(
            2, work / "peer", emulated=net, elastic=True, metrics=False,
            extra=["--log-format", "json", "--checkpoint-memory-bytes", str(4 * args.size_mib << 20),
                   "--step-timeout-s", "600", "--connect-timeout-s", "120"]) as c:
        port = free_port()

        def envs() -> list[dict[str, str]]:
            return [{"MASTER_ADDR": net.address(0), "MASTER_PORT": str(port), "RANK": str(n), "WORLD_SIZE": "2",
                     "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": "eth0",
                     **node_env(n, c, "bench")} for n in range(2)]

        def in_ns(n: int, argv: list[str]) -> list[str]:
            return ["ip", "netns", "exec", net.namespace(n), *argv]

        run_workers([in_ns(n, me("save", args)) for n in range(2)], envs())
        poll_for(lambda: [x for x in node_status(c, 1, operator=True).checkpoints if x.last_complete_step == 1],
                 300, "the checkpoint complete on node 1")
        c.kill(1)
        c.start_node(1)
        c.wait_ready(1, 300)
        poll_for(lambda: [x for x in node_status(c, 1, operator=True).checkpoints if x.last_complete_step == 1],
                 600, "the checkpoint recovered on node 1")
        seconds, nbytes = census_seconds(c.log_path(1))
        port = free_port()
        loaded = run_workers([in_ns(n, me("load", args)) for n in range(2)], envs())
    wire_s = nbytes * 8 / (args.peer_rate_mbit * 1e6)
    return {"recovery_s": seconds, "recovered_bytes": nbytes, "wire_s": wire_s, "ratio_to_wire": seconds / wire_s,
            "restore_s": loaded[1]["load_s"], "restore_cpu_s": loaded[1]["load_cpu_s"],
            "exact": all(x["exact"] for x in loaded)}


def remote_store(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from zend.cluster.netns import EmulatedCluster

    folder = work / "store"
    run_workers([me("file-save", args, str(folder))], [{}])
    with EmulatedCluster(2, rate_mbit=args.store_rate_mbit) as net:
        server = subprocess.Popen(["ip", "netns", "exec", net.namespace(0), sys.executable, "-m", "http.server",
                                   "8000", "--bind", net.address(0), "--directory", str(folder)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            local = work / "fetched"
            local.mkdir()
            files = sorted(p.name for p in folder.iterdir())
            t0 = time.perf_counter()
            for name in files:
                subprocess.run(["ip", "netns", "exec", net.namespace(1), "curl", "-sf", "-o", str(local / name),
                                f"http://{net.address(0)}:8000/{name}"], check=True)
            fetch_s = time.perf_counter() - t0
        finally:
            server.kill()
            server.wait()
    loaded = run_workers([me("file-load", args, str(local))], [{}])[0]
    return {"restore_s": fetch_s + loaded["load_s"], "fetch_s": fetch_s, "restore_cpu_s": loaded["load_cpu_s"],
            "exact": loaded["exact"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--peer-rate-mbit", type=float, default=10000.0)
    p.add_argument("--store-rate-mbit", type=float, default=1000.0)
    p.add_argument("--skip-emulated", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.size_mib, args.folder)
        return 0
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
    gib = args.size_mib / 1024
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="zen-ckpt-bench-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        rows["local memory"] = local_memory(args, work)
        rows["local disk (DCP files)"] = local_disk(args, work)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(work / "dcp-files")
        if not args.skip_emulated:
            rows[f"peer memory ({args.peer_rate_mbit / 1000:g} Gbit/s)"] = peer_memory(args, work)
            rows[f"remote store ({args.store_rate_mbit / 1000:g} Gbit/s)"] = remote_store(args, work)
    for row in rows.values():
        row["gb_per_s"] = args.size_mib * (1 << 20) / 1e9 / row["restore_s"]
    store = next((r for k, r in rows.items() if k.startswith("remote store")), None)
    local = rows["local memory"]
    if store is not None:
        local["times_faster_than_store"] = store["restore_s"] / local["restore_s"]
        peer = next(r for k, r in rows.items() if k.startswith("peer memory"))
        peer["times_faster_than_store"] = store["restore_s"] / (peer["recovery_s"] + peer["restore_s"])
    if args.json:
        print(json.dumps({"size_mib": args.size_mib, "rows": rows}, indent=1))
        return 0
    print(f"restoring a {gib:g} GiB state (one process per trainer; CPU = the loading trainer's)")
    print(f"{'source':32} {'restore s':>10} {'GB/s':>7} {'CPU s':>7} {'exact':>6}  notes")
    for name, r in rows.items():
        notes = ""
        if "recovery_s" in r:
            notes = (f"census {r['recovery_s']:.2f} s for {r['recovered_bytes'] / 2**30:.2f} GiB = "
                     f"{r['ratio_to_wire']:.2f}x its wire time ({r['wire_s']:.2f} s), then the local read")
        if "times_faster_than_store" in r:
            notes += f"{'; ' if notes else ''}{r['times_faster_than_store']:.1f}x faster than the remote store"
        print(f"{name:32} {r['restore_s']:10.3f} {r['gb_per_s']:7.2f} {r['restore_cpu_s']:7.2f} "
              f"{r['exact']!s:>6}  {notes}")
    return 0


if __name__ == "__main__":
    from zend.cluster.launcher import signals_end_the_job

    with signals_end_the_job():  # SIGTERM unwinds like Ctrl-C: its namespaces and processes go too
        sys.exit(main())
