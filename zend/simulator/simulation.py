"""The simulator: every scheme on the same traced gradients, n ranks in one process.

For each world size and scheme it reports the bottleneck traffic (max over ranks of bytes
received, and of bytes sent), its ratio to dense ring allreduce and to the lower bound
(perfectly balanced parallelism with the cheaper pull encoding, see zend.core.costmodel), and
ZEN's imbalance ratios. Up to 128 ranks byte counts are those of the messages the schemes
really exchanged; above, running every rank in one process is too slow (O(n^2) messages), and
`traffic_model` counts every message's size from the same partitioners and encoding rule
instead (equal to the exchanged figures byte for byte, checked in the tests).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from zend.core import costmodel
from zend.core.comm import Channel, Communicator
from zend.core.schemes import SCHEMES, make_scheme
from zend.core.schemes.parallel import ParallelScheme
from zend.core.sparse import SparseGrad
from zend.simulator import traffic_model
from zend.simulator.traces import TokenTrace
from zend.transport.inproc import InProcessCluster

DEFAULT_WORLD_SIZES = (4, 8, 16, 32, 64, 128)
EXACT_UP_TO = 128  # above this many ranks, method="auto" counts the traffic (traffic_model) instead
DEFAULT_SCHEMES = tuple(SCHEMES)  # every registered scheme, in the registry's order


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
    identical_on_all_ranks: bool | None  # None where the traffic was counted, not exchanged
    method: str = "exact"  # exact: the ranks exchanged real messages; model: traffic_model counted them

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


def model_scheme_steps(name: str, rows_per_step: Sequence[Sequence[np.ndarray]], num_rows: int, dim: int,
                       dtype: torch.dtype, seed: int) -> list[list[RankReport]]:
    """The same reports as run_scheme_steps, from traffic_model's counts (no digests: nothing ran)."""
    choice = traffic_model.auto_choice(rows_per_step[0], num_rows, dim, dtype) if name == "auto" else None
    reports = []
    for step, row_sets in enumerate(rows_per_step):  # auto profiles with zen at step 0, then keeps its choice
        t = traffic_model.step_traffic(name, row_sets, num_rows, dim, dtype, seed, choice if step else None)
        reports.append([RankReport(int(t.sent[r]), int(t.recv[r]), t.push_imbalance, t.push_load_imbalance,
                                   t.pull_imbalance, t.scheme, "") for r in range(len(row_sets))])
    return reports


def simulate(trace: TokenTrace, world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
             schemes: Sequence[str] = DEFAULT_SCHEMES, dim: int = 64, dtype: torch.dtype = torch.float32,
             steps: int = 2, seed: int = 0, method: str = "auto") -> list[SimRow]:
    """`method`: exact (every rank exchanges real messages), model (traffic_model counts them, any
    n), or auto (exact up to EXACT_UP_TO ranks, model above)."""
    if method not in ("exact", "model", "auto"):
        raise ValueError(f"method {method!r} is not exact, model or auto")
    torch.set_num_threads(1)  # n rank threads already share the cores
    rows: list[SimRow] = []
    row_bytes = dim * torch.finfo(dtype).bits // 8
    for n in world_sizes:
        how = method if method != "auto" else ("exact" if n <= EXACT_UP_TO else "model")
        row_sets = [[trace.rows(w, s) for w in range(n)] for s in range(steps)]
        mean_rows = sum(len(r) for step in row_sets for r in step) / (n * steps)
        union_rows = sum(len(np.unique(np.concatenate(step))) for step in row_sets) / steps
        profile = costmodel.Profile(n, trace.vocab, row_bytes, mean_rows, union_rows)
        bound = costmodel.bytes_balanced_parallel(profile)
        if how == "exact":
            grads = [[trace.embedding_grad(w, s, dim, dtype) for w in range(n)] for s in range(steps)]
            results = {name: run_scheme_steps(name, grads, seed) for name in schemes}
        else:
            results = {name: model_scheme_steps(name, row_sets, trace.vocab, dim, dtype, seed) for name in schemes}
        dense_bytes = costmodel.dense_ring_bytes(n, trace.vocab * row_bytes)  # a plain dense allreduce's
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
                identical_on_all_ranks=(all(len({r.digest for r in step}) == 1 for step in reports)
                                        if how == "exact" else None),
                method=how,
            ))
    return rows


def format_table(rows: Sequence[SimRow]) -> str:
    head = (f"{'n':>4} {'scheme':<11} {'ran':<10} {'recv MB':>9} {'sent MB':>9} {'/dense':>7} {'/bound':>7} "
            f"{'push':>5} {'load':>5} {'pull':>5} {'same':>4} how")
    lines = [head, "-" * len(head)]
    last_n = None
    for r in rows:
        if last_n is not None and r.world_size != last_n:
            lines.append("")
        last_n = r.world_size
        imb = (f"{r.push_imbalance:5.2f} {r.push_load_imbalance:5.2f} {r.pull_imbalance:5.2f}" if _partitions(r.ran)
               else f"{'-':>5} {'-':>5} {'-':>5}")
        lines.append(
            f"{r.world_size:>4} {r.scheme:<11} {r.ran:<10} {r.max_recv_bytes / 1e6:9.3f} {r.max_sent_bytes / 1e6:9.3f} "
            f"{r.vs_dense:7.3f} {r.vs_lower_bound:7.3f} {imb} {_same(r.identical_on_all_ranks):>4} {r.method}")
    return "\n".join(lines)


def _partitions(ran: str) -> bool:
    """Whether the scheme that ran ("auto:zen" for auto) partitions the tensor: only those have imbalances."""
    scheme = SCHEMES.get(ran.split(":")[-1])
    return scheme is not None and issubclass(scheme, ParallelScheme)


def _same(identical: bool | None) -> str:
    return "-" if identical is None else "yes" if identical else "NO"


def as_json_rows(rows: Sequence[SimRow]) -> list[dict[str, object]]:
    return [asdict(r) | {"bottleneck_bytes": r.bottleneck} for r in rows]
