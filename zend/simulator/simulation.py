"""The simulator: every scheme on the same traced gradients, n ranks in one process.

For each world size and scheme it reports the bottleneck traffic (max over ranks of bytes
received, and of bytes sent), its ratio to dense ring allreduce and to the lower bound
(perfectly balanced parallelism with the cheaper pull encoding, see zend.core.costmodel), and
ZEN's imbalance ratios. Byte counts are exact: they are the sizes of the messages the schemes
really exchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from zend.core import costmodel
from zend.core.comm import Channel, Communicator
from zend.core.schemes import make_scheme
from zend.core.sparse import SparseGrad
from zend.simulator.traces import TokenTrace
from zend.transport.inproc import InProcessCluster

DEFAULT_WORLD_SIZES = (4, 8, 16, 32, 64, 128)
DEFAULT_SCHEMES = ("zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense", "auto")


@dataclass
class RankReport:
    bytes_sent: int
    bytes_recv: int
    push_imbalance: float
    push_load_imbalance: float
    pull_imbalance: float
    scheme: str
    digest: str  # of the result, to check that every rank got the same bits


@dataclass
class SimRow:
    world_size: int
    scheme: str
    ran: str
    max_recv_bytes: float
    max_sent_bytes: float
    vs_dense: float
    vs_lower_bound: float
    push_imbalance: float
    push_load_imbalance: float
    pull_imbalance: float
    lower_bound_bytes: float
    mean_rows: float
    union_rows: float
    identical_on_all_ranks: bool

    @property
    def bottleneck(self) -> float:
        return max(self.max_recv_bytes, self.max_sent_bytes)


def _digest(grad: SparseGrad) -> str:
    h = hashlib.sha1(grad.indices.to(torch.int64).numpy().tobytes())
    h.update(grad.values.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_scheme_steps(name: str, grads_per_step: Sequence[Sequence[SparseGrad]], seed: int,
                     deterministic: bool = True) -> list[list[RankReport]]:
    """Run one scheme object per rank over several steps; reports[step][rank]."""
    n = len(grads_per_step[0])
    schemes = [make_scheme(name, seed=seed) for _ in range(n)]
    reports: list[list[RankReport]] = []
    for step, grads in enumerate(grads_per_step):
        def body(rank: int, comm: Communicator, step: int = step, grads: Sequence[SparseGrad] = grads) -> RankReport:
            r = schemes[rank].sync(Channel(comm, f"s{step}"), grads[rank], deterministic=deterministic)
            return RankReport(r.traffic.bytes_sent, r.traffic.bytes_recv, r.push_imbalance,
                              r.push_load_imbalance, r.pull_imbalance, r.scheme, _digest(r.grad))
        reports.append(InProcessCluster(n, serialize=True).run(body))
    return reports


def simulate(trace: TokenTrace, world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
             schemes: Sequence[str] = DEFAULT_SCHEMES, dim: int = 64, dtype: torch.dtype = torch.float32,
             steps: int = 2, seed: int = 0) -> list[SimRow]:
    torch.set_num_threads(1)  # n rank threads already share the cores
    rows: list[SimRow] = []
    row_bytes = dim * torch.finfo(dtype).bits // 8
    for n in world_sizes:
        grads = [[trace.embedding_grad(w, s, dim, dtype) for w in range(n)] for s in range(steps)]
        mean_rows = sum(g.nnz for step in grads for g in step) / (n * steps)
        union_rows = sum(len(torch.unique(torch.cat([g.indices for g in step]))) for step in grads) / steps
        profile = costmodel.Profile(n, trace.vocab, row_bytes, mean_rows, union_rows)
        bound = costmodel.bytes_balanced_parallel(profile)
        results = {name: run_scheme_steps(name, grads, seed) for name in schemes}
        dense_bytes = costmodel.bytes_dense(profile)
        for name, reports in results.items():
            recv = sum(max(r.bytes_recv for r in step) for step in reports) / steps
            sent = sum(max(r.bytes_sent for r in step) for step in reports) / steps
            bottleneck = max(recv, sent)
            rows.append(SimRow(
                world_size=n, scheme=name, ran=reports[-1][0].scheme,
                max_recv_bytes=recv, max_sent_bytes=sent,
                vs_dense=bottleneck / dense_bytes if dense_bytes else 0.0,
                vs_lower_bound=bottleneck / bound if bound else 0.0,
                push_imbalance=max(r.push_imbalance for step in reports for r in step),
                push_load_imbalance=max(r.push_load_imbalance for step in reports for r in step),
                pull_imbalance=max(r.pull_imbalance for step in reports for r in step),
                lower_bound_bytes=bound, mean_rows=mean_rows, union_rows=union_rows,
                identical_on_all_ranks=all(len({r.digest for r in step}) == 1 for step in reports),
            ))
    return rows


def format_table(rows: Sequence[SimRow]) -> str:
    head = (f"{'n':>4} {'scheme':<11} {'ran':<10} {'recv MB':>9} {'sent MB':>9} {'/dense':>7} {'/bound':>7} "
            f"{'push':>5} {'load':>5} {'pull':>5} {'same':>4}")
    lines = [head, "-" * len(head)]
    last_n = None
    for r in rows:
        if last_n is not None and r.world_size != last_n:
            lines.append("")
        last_n = r.world_size
        parallel = r.ran.split(":")[-1] in ("zen", "sparse_ps", "omnireduce")
        imb = (f"{r.push_imbalance:5.2f} {r.push_load_imbalance:5.2f} {r.pull_imbalance:5.2f}" if parallel
               else f"{'-':>5} {'-':>5} {'-':>5}")
        lines.append(
            f"{r.world_size:>4} {r.scheme:<11} {r.ran:<10} {r.max_recv_bytes / 1e6:9.3f} {r.max_sent_bytes / 1e6:9.3f} "
            f"{r.vs_dense:7.3f} {r.vs_lower_bound:7.3f} {imb} {'yes' if r.identical_on_all_ranks else 'NO':>4}")
    return "\n".join(lines)


def as_json_rows(rows: Sequence[SimRow]) -> list[dict[str, object]]:
    return [asdict(r) | {"bottleneck_bytes": r.bottleneck} for r in rows]
