"""A rank in its own process, for multi-process transport tests.

Protocol with the parent test: print `PORT <port>`, read one JSON line with the peer table
({rank: [host, port]}), connect, then act by --mode, printing one JSON line of results.
Modes: `schemes` (every scheme on seeded inputs, checked against the reference here),
`flood` (send 64 MiB messages to rank 0 until killed), `pong` (answer every ping from the other rank of two).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from zend.core import Channel, SparseGrad, make_scheme
from zend.transport import create
from zend.transport.handshake import load_secret


def seeded_grads(world_size: int, seed: int) -> list[SparseGrad]:
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(world_size):
        idx = (torch.rand(3000, generator=gen) ** 3 * 20_000).long()  # skewed, with duplicates
        grads.append(SparseGrad(idx, torch.randn(3000, 16, generator=gen), 20_000, "emb"))
    return grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--mode", choices=["schemes", "flood", "pong"], required=True)
    parser.add_argument("--schemes", default="zen,hc,agsparse,omnireduce,sparse_ps,dense,auto")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    transport = create(args.uri, args.rank, args.world_size, cluster_id="test", secret=load_secret(),
                       timeout_s=args.timeout_s)
    print(f"PORT {transport.address[1]}", flush=True)
    peers = {int(k): (v[0], int(v[1])) for k, v in json.loads(sys.stdin.readline()).items()}
    transport.connect(peers)
    if args.mode == "schemes":
        grads = seeded_grads(args.world_size, seed=1)
        expected = sum(g.to_dense() for g in grads)
        report = {}
        for step, name in enumerate(args.schemes.split(",")):
            result = make_scheme(name, seed=5).sync(Channel(transport, f"job/emb/{step}"), grads[args.rank])
            err = float((result.to_dense() - expected).abs().max())
            report[name] = {"max_error": err, "bytes_sent": result.traffic.bytes_sent,
                            "bytes_recv": result.traffic.bytes_recv, "ran": result.scheme}
        print(json.dumps(report), flush=True)
    elif args.mode == "flood":
        big = torch.ones(64 << 20, dtype=torch.uint8)
        step = 0
        while True:
            transport.send(0, f"flood/{step}", big)
            step += 1
    else:
        partner = 1 if args.rank == 0 else 0
        step = 0
        while True:
            ping = transport.recv(partner, f"ping/{step}", timeout_s=600)
            transport.send(partner, f"pong/{step}", ping)
            step += 1
    transport.close()


if __name__ == "__main__":
    main()
