"""CPU cost of each scheme on one core, with no network: where one rank's time goes, per stage.

Every rank of an n-rank sync runs once in-process (threads) to record the messages each rank
receives; then rank 0's sync is replayed alone, on one thread, against those recorded
messages (sends are dropped), so the time measured is rank 0's own CPU work and nothing else.
cProfile over the replay attributes that time to the stages of the scheme (partition,
encode, decode, keyed sum, finish, assemble, coalesce, dense ops).

    python benchmarks/scheme_cpu.py [--nodes 4,8] [--dim 64 --seqs 8] [--schemes zen,sparse_ps] [--json]
        [--duplicates [--coalesce sort]]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict

import torch

from zend.core import Channel, make_scheme, sparse
from zend.core.comm import Communicator
from zend.core.schemes.auto import candidates
from zend.core.sparse import SparseGrad
from zend.runtime.tuning import tune_allocator
from zend.simulator.traces import TokenTrace
from zend.transport.inproc import InProcessCluster

# function name (as cProfile reports it) -> stage; the first match on the stack wins, innermost first
STAGES = {
    "split": "partition", "rotation": "partition", "_group_by_part": "partition",
    "encode_units": "encode", "encode_dense": "encode", "encode_gathered": "encode", "allocate_units": "encode",
    "write_bitmap": "encode",
    "decode_units": "decode", "decode_dense": "decode", "read_header": "decode",
    "sum_keyed": "keyed sum", "sum_into": "keyed sum", "slot_keys": "keyed sum",
    "finish": "finish", "assemble": "assemble", "coalesce": "coalesce", "to_dense": "to dense",
}


class Replay(Communicator):
    """Rank 0 of a recorded run: receives what it received then, sends into the void."""

    def __init__(self, world_size: int, inbox: dict[tuple[int, str], torch.Tensor]):
        self.rank, self.world_size, self.inbox = 0, world_size, inbox

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        pass

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        return self.inbox[(src, tag)]


class Recorder(Communicator):
    def __init__(self, inner: Communicator, inbox: dict[tuple[int, str], torch.Tensor]):
        self.inner, self.inbox = inner, inbox
        self.rank, self.world_size = inner.rank, inner.world_size

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        msg = self.inner.recv(src, tag, timeout_s)
        if self.rank == 0:
            self.inbox[(src, tag)] = msg.clone()
        return msg


def record(name: str, grads: list[SparseGrad]) -> dict[tuple[int, str], torch.Tensor]:
    inbox: dict[tuple[int, str], torch.Tensor] = {}
    n = len(grads)

    def body(rank: int, comm: Communicator) -> None:
        make_scheme(name, seed=1).sync(Channel(Recorder(comm, inbox), "s"), grads[rank])

    InProcessCluster(n, serialize=True).run(body)
    return inbox


def stage_of(func: tuple[str, int, str], callers: dict, memo: dict) -> str:  # type: ignore[type-arg]
    return STAGES.get(func[2], "")


def profile(name: str, grads: list[SparseGrad], repeat: int) -> tuple[float, dict[str, float]]:
    inbox = record(name, grads)
    n = len(grads)
    scheme = make_scheme(name, seed=1)

    def once() -> None:
        scheme.sync(Channel(Replay(n, inbox), "s"), grads[0])

    once()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeat):
        once()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    # cumulative time of each stage's outermost function (stages do not nest in the schemes)
    stages: dict[str, float] = defaultdict(float)
    for func, (_cc, _nc, _tt, ct, callers) in stats.items():
        stage = STAGES.get(func[2])
        if not stage:
            continue
        if any(STAGES.get(c[2]) for c in callers):  # called from another stage: counted there
            continue
        stages[stage] += ct / repeat
    total_prof = sum(s[3] for f, s in stats.items() if f[2] == "once") / repeat
    stages["other"] = max(0.0, total_prof - sum(stages.values()))
    scale = best / total_prof if total_prof else 1.0  # profiler overhead out
    return best, {k: v * scale for k, v in stages.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="4,8")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--schemes", default=",".join(candidates()), help="default: auto's candidates")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--duplicates", action="store_true",
                   help="a row per token, duplicates included, as nn.Embedding(sparse=True) gives them")
    p.add_argument("--coalesce", choices=["auto", "sort"], default="auto",
                   help="how duplicates are summed: auto (a slot per row for small tables), or always a sort")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.coalesce == "sort":
        sparse.SLOT_COALESCE_ROWS_PER_INPUT = 0
    torch.set_num_threads(1)
    tune_allocator()
    trace = TokenTrace.default(seqs=args.seqs)
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        grads = [trace.embedding_grad(r, 1, args.dim, coalesced=not args.duplicates) for r in range(n)]
        for name in args.schemes.split(","):
            best, stages = profile(name, grads, args.repeat)
            rows.append({"n": n, "scheme": name, "ms": best * 1e3,
                         "stages_ms": {k: round(v * 1e3, 3) for k, v in sorted(stages.items())}})
    if args.json:
        print(json.dumps({"dim": args.dim, "seqs": args.seqs, "duplicates": args.duplicates,
                          "coalesce": args.coalesce, "rows": rows}))
        return
    print(f"one rank's CPU time on one core, GPT-2 trace {args.seqs}x512 tokens, rows of {args.dim} fp32, "
          f"best of {args.repeat}"
          + (f"; a row per token, duplicates summed by {args.coalesce}" if args.duplicates else ""))
    names = sorted({k for r in rows for k in r["stages_ms"]})
    print(f"{'n':>3} {'scheme':<10} {'ms':>7}  " + " ".join(f"{k:>10}" for k in names))
    for r in rows:
        print(f"{r['n']:>3} {r['scheme']:<10} {r['ms']:7.2f}  "
              + " ".join(f"{r['stages_ms'].get(k, 0.0):10.2f}" for k in names))


if __name__ == "__main__":
    main()
