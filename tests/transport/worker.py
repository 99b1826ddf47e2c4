"""One rank in its own process, driven by the test over stdin/stdout (one transport per process).

Every rank of a transport test lives in a process of its own, as each daemon does: UCX keeps
one context per process, and several ucxx transports in one process are not a shape we ship.
The worker prints `PORT <port>`, then reads commands, one JSON object per line, and answers
each with one JSON line carrying the same "id". Every command runs on a thread of its own, so
a blocked send (backpressure) does not stop a later receive. Commands ("op"):

  connect   {peers: {rank: [host, port]}, timeout_s}
  send      {dst, tag, seeds: [...], size}    one message per seed, in order, on one tag
  flood     {dst, tag, size}                  send size-byte messages tagged tag/0, tag/1, ...
  recv      {src, tag, seeds: [...], size, timeout_s}   receive len(seeds) messages on tag and
            check each against the payload its seed makes -> {intact: [...], numel: [...]}
  echo      {peer, count}                      receive ping/i from peer, send it back as pong/i
  buffered  {src}                              bytes from src received and not yet claimed
  holds     {src, prefix}                      whether a message from src under prefix waits (none taken)
  pool      {}                                 the receive-buffer pool's counters
  accepting {}                                 why the listener cannot accept now (null: it can)
  redial    {peer, host, port, timeout_s}      a restarted peer's new address; wait until linked
  schemes   {names}                            every scheme on seeded inputs, checked here
  transports {}                                what the transport really uses (UCX)
  exit      {}                                 close the transport and exit 0
`--engine native` puts the native engine on a tcp:// rank's links (engine_choice.py).

An error answers {"id", "error", "type"}; the worker keeps serving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import torch

from zend.core import Channel, SparseGrad, make_scheme
from zend.daemon.secret import load_secret
from zend.transport import create

_out = threading.Lock()


def reply(message: dict[str, Any]) -> None:
    with _out:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def payload(size: int, seed: int) -> torch.Tensor:
    """The bytes a message with this seed carries: both ends can make them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def seeded_grads(world_size: int, seed: int) -> list[SparseGrad]:
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(world_size):
        idx = (torch.rand(3000, generator=gen) ** 3 * 20_000).long()  # skewed, with duplicates
        grads.append(SparseGrad(idx, torch.randn(3000, 16, generator=gen), 20_000, "emb"))
    return grads


class Worker:
    def __init__(self, transport: Any):
        self.t = transport

    def connect(self, peers: dict[str, list], timeout_s: float = 20.0) -> dict:
        self.t.connect({int(k): (v[0], int(v[1])) for k, v in peers.items()}, timeout_s=timeout_s)
        return {}

    def send(self, dst: int, tag: str, seeds: list[int], size: int) -> dict:
        for seed in seeds:
            self.t.send(dst, tag, payload(size, seed))
        return {}

    def flood(self, dst: int, tag: str, size: int) -> dict:
        big = torch.ones(size, dtype=torch.uint8)
        step = 0
        while True:
            self.t.send(dst, f"{tag}/{step}", big)
            step += 1

    def recv(self, src: int, tag: str, seeds: list[int], size: int, timeout_s: float | None = None) -> dict:
        intact, numel = [], []
        for seed in seeds:
            got = self.t.recv(src, tag, timeout_s=timeout_s)
            numel.append(got.numel())
            intact.append(got.dtype == torch.uint8 and torch.equal(got, payload(size, seed)))
        return {"intact": intact, "numel": numel}

    def echo(self, peer: int, count: int) -> dict:
        for i in range(count):
            self.t.send(peer, f"pong/{i}", self.t.recv(peer, f"ping/{i}"))
        return {}

    def buffered(self, src: int) -> dict:
        return {"bytes": self.t.buffered_from(src)}

    def holds(self, src: int, prefix: str) -> dict:
        return {"holds": self.t.holds(src, prefix)}

    def links(self) -> dict:
        return {"up": {str(j): p.link is not None for j, p in self.t.peers.items()},
                "connects": {str(j): p.connects for j, p in self.t.peers.items()}}

    def abort(self, prefix: str, reason: str) -> dict:
        self.t.abort(prefix, reason)
        return {}

    def mailbox(self) -> dict:
        return {"bytes": self.t.mailbox_bytes(), "dropped": self.t.dropped_messages}

    def pool(self) -> dict:
        return {"stats": vars(self.t.pool_stats())}

    def accepting(self) -> dict:
        return {"accept_error": self.t.accept_error}

    def redial(self, peer: int, host: str, port: int, timeout_s: float) -> dict:
        self.t.peers[peer].address = (host, port)
        self.t.wait_connected(peer, timeout_s=timeout_s)
        return {}

    def schemes(self, names: list[str]) -> dict:
        grads = seeded_grads(self.t.world_size, seed=1)
        expected = sum(g.to_dense() for g in grads)
        report = {}
        for step, name in enumerate(names):
            result = make_scheme(name, seed=5).sync(Channel(self.t, f"job/emb/{step}"), grads[self.t.rank])
            report[name] = {"max_error": float((result.to_dense() - expected).abs().max()),
                            "bytes_sent": result.traffic.bytes_sent, "bytes_recv": result.traffic.bytes_recv,
                            "ran": result.scheme}
        return {"report": report}

    def transports(self) -> dict:
        if self.t.scheme != "ucx":
            return {"transports": [self.t.scheme]}
        from zend.transport.ucx import active_transports

        return {"transports": active_transports()}


def serve(worker: Worker, command: dict[str, Any]) -> None:
    ident = command.pop("id")
    op = command.pop("op")
    started = time.monotonic()
    try:
        result = getattr(worker, op)(**command)
        reply({"id": ident, **result, "elapsed_s": time.monotonic() - started})
    except Exception as exc:  # reported to the test, which decides
        reply({"id": ident, "error": str(exc), "type": type(exc).__name__, "elapsed_s": time.monotonic() - started})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--cluster-id", default="test")
    parser.add_argument("--generation", type=int, default=0)
    parser.add_argument("--protocol-version", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--max-buffered-bytes", type=int, default=1 << 30)
    parser.add_argument("--security", default="aead")
    parser.add_argument("--engine", default="python", choices=["python", "native"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    options: dict[str, Any] = {"cluster_id": args.cluster_id, "generation": args.generation,
                               "timeout_s": args.timeout_s, "max_buffered_bytes": args.max_buffered_bytes,
                               "security": args.security}
    if args.protocol_version is not None:
        options["protocol_version"] = args.protocol_version
    transport = create(args.uri, args.rank, args.world_size, engine=args.engine, secret=load_secret(), **options)
    print(f"PORT {transport.address[1]}", flush=True)
    worker = Worker(transport)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            transport.close()
            reply({"id": command["id"], "exited": True})
            break
        threading.Thread(target=serve, args=(worker, command), daemon=True).start()
    sys.stdout.flush()
    # Threads still blocked in a flood or a receive must not hold the exit back.
    os._exit(0)


if __name__ == "__main__":
    main()
