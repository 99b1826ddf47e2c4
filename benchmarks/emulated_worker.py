"""One rank of benchmarks/emulated_cluster.py (run inside its network namespace)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from zend.core import SCHEMES, Channel, make_scheme
from zend.core.comm import barrier
from zend.core.schemes.auto import AutoScheme
from zend.core.sparse import SparseGrad
from zend.core.topk import TopKCompressor
from zend.daemon.secret import load_secret
from zend.runtime.tuning import tune_allocator
from zend.simulator.traces import TokenTrace
from zend.transport import create


def topk_grad(rank: int, step: int, elements: int, density: float = 0.01) -> SparseGrad:
    """Top-k (DGC style) of a dense gradient: a signal shared by the ranks plus each rank's own
    noise, so that the ranks' top 1% overlap partly, as compressed gradients of one model do."""
    shared = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    dense = torch.randn(elements, generator=shared).add_(torch.randn(elements, generator=own))
    return TopKCompressor(density).compress("topk", dense)


def time_commit(transport: Any, steps: int) -> dict[str, float]:
    """The two one-byte all-to-all rounds every daemon step ends with, as NodeSteps runs them."""
    from zend.daemon.node_steps import NodeSteps  # only here: the schemes' rows run without the daemon loaded

    node = NodeSteps(transport, 120.0)
    times, cpu = [], []
    for step in range(steps):
        barrier(transport, f"b/commit/{step}")
        start, cpu_start = time.perf_counter(), time.process_time()
        node.commit(Channel(transport, f"commit/{step}", timeout_s=120), time.monotonic())
        if step:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    return {"seconds": sorted(times)[len(times) // 2], "sent": 0, "recv": 0, "cpu": sorted(cpu)[len(cpu) // 2]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--uri", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", required=True, help="host:port for torch.distributed gloo")
    p.add_argument("--schemes", default=",".join([*SCHEMES, "commit"]))
    p.add_argument("--workload", default="rows", choices=["rows", "topk"])
    p.add_argument("--topk-elements", type=int, default=25_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--security", default="aead", choices=["aead", "none"], help="the data plane's frames")
    p.add_argument("--engine", default="python", choices=["python", "native"], help="the tcp:// data-plane engine")
    args = p.parse_args()
    torch.set_num_threads(1)
    tune_allocator()
    if args.workload == "rows":
        trace = TokenTrace.default(seqs=args.seqs, seq_len=args.seq_len)
        grads = [trace.embedding_grad(args.rank, s, args.dim) for s in range(args.steps + 1)]
    else:
        grads = [topk_grad(args.rank, s, args.topk_elements) for s in range(args.steps + 1)]
    transport = create(args.uri, args.rank, args.world_size, engine=args.engine, cluster_id="bench",
                       secret=load_secret(), timeout_s=120, security=args.security)
    print(f"PORT {transport.address[1]}", flush=True)
    peers = {int(k): (v[0], int(v[1])) for k, v in json.loads(sys.stdin.readline()).items()}
    transport.connect(peers)
    results: dict[str, dict[str, float]] = {}
    for name in args.schemes.split(","):
        if name == "commit":  # not a scheme: the daemon's step commit alone (NodeSteps.commit)
            results[name] = time_commit(transport, len(grads))
            continue
        scheme = make_scheme(name, seed=1)
        times, sent, recv = [], [], []
        if isinstance(scheme, AutoScheme):  # its profile and trials first: the table shows its choice
            for i in range(1 + scheme.trials * len(scheme.schemes)):
                barrier(transport, f"w/{name}/{i}")
                scheme.sync(Channel(transport, f"{name}/w{i}", timeout_s=120), grads[i % len(grads)])
        cpu = []
        for step, grad in enumerate(grads):  # step 0 warms up
            barrier(transport, f"b/{name}/{step}")
            start, cpu_start = time.perf_counter(), time.process_time()
            r = scheme.sync(Channel(transport, f"{name}/{step}", timeout_s=120), grad)
            if step:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)  # every thread, user + kernel
                sent.append(r.traffic.bytes_sent)
                recv.append(r.traffic.bytes_recv)
        results[name] = {"seconds": sorted(times)[len(times) // 2], "sent": max(sent), "recv": max(recv),
                         "cpu": sorted(cpu)[len(cpu) // 2]}
        if isinstance(scheme, AutoScheme):
            results[name]["choice"] = scheme.choice  # type: ignore[assignment]
    host, port = args.master.rsplit(":", 1)
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=args.rank,
                            world_size=args.world_size)
    for label in ("gloo_sparse", "gloo_dense"):
        times, cpu = [], []
        for grad in grads:
            t = grad.to_torch_sparse() if label == "gloo_sparse" else grad.to_dense()
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        results[label] = {"seconds": sorted(times[1:])[len(times[1:]) // 2], "sent": 0, "recv": 0,
                          "cpu": sorted(cpu[1:])[len(cpu[1:]) // 2]}
    dist.destroy_process_group()
    barrier(transport, "end")
    print(json.dumps(results), flush=True)
    transport.close()


if __name__ == "__main__":
    main()
