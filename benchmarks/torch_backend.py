"""Sparse `dist.all_reduce` on the "zen" backend against the gloo backend, on the emulated cluster.

n ranks, one per network namespace behind a rate-limited link (zend/cluster/netns.py), a zend daemon
in each. Every rank joins the "zen" process group and a gloo group of the same ranks, and reduces
the same row-sparse tensors on both, alternating, in the same run: each rank holds a quarter of
the rows of a table, drawn at random (so ranks overlap as embedding gradients do), 256 floats a
row; SIZE MB is one rank's rows. gloo's sparse all_reduce is an allgather of indices and values;
zen's is the ZEN scheme through the daemons (scheme `auto`). Needs root and iproute2.

    .venv/bin/python benchmarks/torch_backend.py [--nodes 2,4] [--rate-mbit 1000] [--sizes-mb 1,16,64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 256


def worker(sizes_mb: list[float], repeats: int) -> None:
    """One rank: every size on both backends; rank 0 prints one JSON line per size."""
    import torch
    import torch.distributed as dist
    import zen  # noqa: F401  (registers the backend)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("zen", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    for size in sizes_mb:
        rows_per_rank = max(1, int(size * 2**20) // (4 * WIDTH))
        num_rows = 4 * rows_per_rank
        g = torch.Generator().manual_seed(1000 * rank + int(size))
        rows = torch.randperm(num_rows, generator=g)[:rows_per_rank]
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(rows_per_rank, WIDTH, generator=g),
                                       (num_rows, WIDTH)).coalesce()
        times: dict[str, list[float]] = {"zen": [], "gloo": []}
        for attempt in range(repeats + 1):  # the first of each: registration, warm-up
            for label, group in (("zen", None), ("gloo", gloo)):
                t = grad.clone()
                dist.barrier(group=gloo)
                started = time.perf_counter()
                dist.all_reduce(t, group=group)
                if attempt:
                    times[label].append(time.perf_counter() - started)
        if rank == 0:
            print(json.dumps({"size_mb": size, "zen_ms": median(times["zen"]) * 1e3,
                              "gloo_ms": median(times["gloo"]) * 1e3, "repeats": repeats}), flush=True)
    dist.destroy_process_group()


def run(nodes: int, rate_mbit: float | None, sizes_mb: list[float], repeats: int, workdir: Path) -> list[dict]:
    from zend.cluster.launcher import wait_for_ranks
    from zend.cluster.local import LocalCluster, free_port
    from zend.cluster.netns import EmulatedCluster

    with EmulatedCluster(nodes, rate_mbit=rate_mbit) as emulated, \
            LocalCluster(nodes, workdir / f"n{nodes}", emulated=emulated, metrics=False,
                         extra=["--log-format", "text"]) as cluster:
        port = free_port()
        procs = []
        for rank in range(nodes):
            env = {**os.environ, "MASTER_ADDR": emulated.address(0), "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(nodes), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}", "GLOO_SOCKET_IFNAME": "eth0",
                   "ZEN_SOCKET_DIR": cluster.socket_dir(rank), "ZEN_JOB": "bench",
                   "ZEN_JOB_TOKEN": cluster.token("bench")}
            argv = ["ip", "netns", "exec", emulated.namespace(rank), sys.executable, __file__, "--worker",
                    "--sizes-mb", ",".join(str(s) for s in sizes_mb), "--repeats", str(repeats)]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = wait_for_ranks(procs, 1800)
    return [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,4")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="0: unshaped")
    p.add_argument("--sizes-mb", default="1,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    if args.worker:
        worker(sizes, args.repeats)
        return 0
    from zend.cluster.netns import available

    reason = available()
    if reason:
        print(f"torch_backend: {reason}", file=sys.stderr)
        return 2
    rate = args.rate_mbit or None
    table = []
    with tempfile.TemporaryDirectory(prefix="zen-backend-") as tmp:
        for n in [int(x) for x in args.nodes.split(",")]:
            for row in run(n, rate, sizes, args.repeats, Path(tmp)):
                table.append({"nodes": n, **row, "gloo_over_zen": row["gloo_ms"] / row["zen_ms"]})
                print(f"  n={n} {row['size_mb']:g} MB: zen {row['zen_ms']:.1f} ms, gloo {row['gloo_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rate_mbit": args.rate_mbit, "width": WIDTH, "repeats": args.repeats, "rows": table}))
        return 0
    link = f"at {args.rate_mbit:g} Mbit/s" if rate else "on unshaped links"
    print(f"sparse dist.all_reduce, zen backend vs gloo backend, ranks in network namespaces {link}, "
          f"rows of {WIDTH} fp32, median of {args.repeats}")
    print(f"{'n':>3} {'MB/rank':>8} {'zen ms':>9} {'gloo ms':>9} {'gloo/zen':>9}")
    for r in table:
        print(f"{r['nodes']:>3} {r['size_mb']:>8g} {r['zen_ms']:>9.1f} {r['gloo_ms']:>9.1f} "
              f"{r['gloo_over_zen']:>8.2f}x")
    return 0


if __name__ == "__main__":
    from zend.cluster.launcher import signals_end_the_job

    with signals_end_the_job():  # SIGTERM unwinds like Ctrl-C: its namespaces and processes go too
        sys.exit(main())
