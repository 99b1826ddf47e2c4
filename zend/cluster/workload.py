"""One trainer of `zend cluster`: real embedding gradients through the daemon, each sum checked.

Trainer t (= node x local_world_size + local_rank) takes batch t of the bundled text trace at
every step; since every trainer can rebuild every other's gradient from the trace, each one
checks the daemon's result against the sum it computes itself. One JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from zend.protocol.session import TrainerSession
from zend.simulator.traces import TokenTrace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("socket-dir", "job"):
        p.add_argument(f"--{name}", required=True)
    for name in ("local-rank", "local-world-size", "node", "nodes", "steps", "dim"):
        p.add_argument(f"--{name}", type=int, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    trace = TokenTrace.default()
    k = args.local_world_size
    me = args.node * k + args.local_rank
    everyone = range(args.nodes * k)
    ok_all = True
    with TrainerSession(args.socket_dir, args.job, os.environ["ZEN_JOB_TOKEN"], args.local_rank, k) as link:
        handle = link.register("wte", (trace.vocab, args.dim))
        for step in range(args.steps):
            grad = trace.embedding_grad(me, step, args.dim)
            t0 = time.perf_counter()
            result = link.allreduce(handle, grad, step)
            seconds = time.perf_counter() - t0
            reference = torch.zeros(trace.vocab, args.dim)
            for w in everyone:
                reference += trace.embedding_grad(w, step, args.dim).to_dense()
            ok = torch.allclose(result.to_dense(), reference, rtol=1e-5, atol=1e-5)
            ok_all &= ok
            r = handle.last_reply
            assert r is not None  # allreduce returned
            print(json.dumps({"node": args.node, "local_rank": args.local_rank, "step": step, "ok": ok,
                              "scheme": r.scheme, "nnz_in": grad.nnz, "nnz_out": r.nnz, "bytes_sent": r.bytes_sent,
                              "dense_bytes": r.dense_bytes, "seconds": seconds}), flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
