"""`auto`: the fastest scheme for this tensor on this cluster, measured, kept up to date.

Bytes alone pick the wrong scheme at datacenter link rates, where CPU time per unit and per
message decides (zen sends the fewest bytes and can still lose to hc or agsparse). So `auto`
times the candidates on the real tensor, links and hosts, and keeps the fastest:

1. Profile: the first sync of a tensor, and every `reprofile_every`-th after it, runs zen,
   whose pull tells every rank the same cluster-wide figures (mean non-zero rows per rank,
   rows after summing).
2. Prune: the byte model (each candidate's `bytes_per_rank`, zend.core.costmodel) drops every
   candidate that would move more than `prune_ratio` x the fewest bytes: a scheme that far
   behind on the wire cannot win.
3. Trial: the next syncs run each remaining candidate (`trials` times at the first profile,
   once at later ones), each rank timing its own syncs.
4. Agree: after the last trial every rank sends its median time per candidate to every other
   (one tiny message per peer); each takes the maximum over ranks (the collective lasts as
   long as its slowest rank) and picks the smallest. Every rank computes the same choice from
   the same numbers. The median, not the best: on a busy host a scheme's times scatter, and
   the best of a few picks whichever got lucky (at 50 Mbit/s, n = 8, it picked hc at 350 ms
   over zen at 242). The tensor's very first sync (zen's, cold: first allocations, caches) is
   left out where zen has a later trial.

Every sync, trial or not, is an exact sum: trials cost time, never correctness. With
`deterministic=True` auto skips the timing and picks by bytes (zen, hc or dense), so that two
runs on the same inputs run the same schemes and give the same bits.
One AutoScheme object per tensor.

The candidates are the registered schemes (zend.core.schemes.SCHEMES) whose class sets
`auto_candidate`, in the registry's order, which breaks ties: zen, hc, agsparse, sparse_ps,
dense; those picked by bytes set `deterministic_candidate`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from zend.core import costmodel
from zend.core.comm import Channel
from zend.core.schemes.base import ResultPlace, Scheme, SyncResult, from_peer
from zend.core.sparse import SparseGrad

PROFILER = "zen"  # its pull tells every rank the cluster-wide figures the others are judged by


def candidates() -> tuple[str, ...]:
    """auto's candidates, in the registry's order."""
    return tuple(name for name, cls in _registry().items() if cls.auto_candidate)


def choose_by_bytes(profile: costmodel.Profile) -> str:
    """What auto picks under deterministic=True: the fewest bytes among the schemes that set
    `deterministic_candidate` (ties go to the earlier in the registry)."""
    volume = {name: candidate_bytes(cls, profile) for name, cls in _registry().items() if cls.deterministic_candidate}
    return min(volume, key=lambda name: volume[name])


def candidate_bytes(scheme: type[Scheme] | Scheme, profile: costmodel.Profile) -> float:
    """A candidate's byte model (every candidate has one: tests/core/test_registry.py)."""
    volume = scheme.bytes_per_rank(profile)
    if volume is None:
        raise ValueError(f"scheme {scheme.name!r} is one of auto's candidates but has no byte model")
    return volume


def _registry() -> dict[str, type[Scheme]]:
    from zend.core.schemes import SCHEMES  # the registry imports this module: read it once both are loaded

    return SCHEMES


class AutoScheme(Scheme):
    """Not a scheme of its own: it picks one of its candidates per sync, which does the work."""

    name = "auto"

    def __init__(self, seed: int = 0, reprofile_every: int = 100, min_slice_width: int = 8, trials: int = 3,
                 prune_ratio: float = 4.0):
        if reprofile_every < 1:
            raise ValueError(f"reprofile_every {reprofile_every} must be at least 1")
        if trials < 1:
            raise ValueError(f"trials {trials} must be at least 1")
        self.reprofile_every = reprofile_every
        self.trials = trials
        self.prune_ratio = prune_ratio
        from zend.core.schemes import make_scheme  # the registry's module imports this one: at run time

        self.schemes: dict[str, Scheme] = {name: make_scheme(name, seed=seed, min_slice_width=min_slice_width)
                                           for name in candidates()}
        self.syncs = 0
        self.profiles = 0
        self.choice = PROFILER
        self.plan: list[str] = []  # trials still to run in this profile, in order
        self.best: dict[str, tuple[float, ...]] = {}  # this rank's times per candidate in this profile
        self.agreed: dict[str, float] = {}  # the cluster's time per candidate (max over ranks), last profile

    def timed(self, name: str, run: Callable[[], SyncResult]) -> tuple[SyncResult, float]:
        """Run one sync and measure it (a method, so that tests can substitute the clock)."""
        start = time.perf_counter()
        result = run()
        return result, time.perf_counter() - start

    def sync(self, ch: Channel, grad: SparseGrad, *, average: bool = False,
             deterministic: bool = False, place: ResultPlace | None = None) -> SyncResult:
        profiling = self.syncs % self.reprofile_every == 0
        self.syncs += 1
        trial = profiling or bool(self.plan)
        name = PROFILER if profiling else self.plan.pop(0) if self.plan else self.choice
        if profiling:
            self.plan, self.best = [], {}
        scheme = self.schemes[name]
        result, seconds = self.timed(name, lambda: scheme.sync(ch, grad, average=average,
                                                               deterministic=deterministic, place=place))
        if trial:
            self.best[name] = (*self.best.get(name, ()), seconds)
        if profiling:
            self._plan_trials(ch, grad, result, deterministic)
        elif trial and not self.plan:
            self._agree(ch)
        result.details.update({"auto_ran": name, "auto_next": self.plan[0] if self.plan else self.choice,
                               "auto_profiled": profiling, "auto_trial": trial})
        result.scheme = f"auto:{name}"
        return result

    def _plan_trials(self, ch: Channel, grad: SparseGrad, result: SyncResult, deterministic: bool) -> None:
        """After the profiling sync: prune by bytes, then queue the trials (or pick by bytes)."""
        self.profiles += 1
        if result.mean_input_rows is None or ch.world_size == 1:
            self.choice, self.best = PROFILER, {}
            return
        profile = costmodel.Profile(
            world_size=ch.world_size, num_rows=grad.num_rows, row_bytes=grad.row_len * grad.values.element_size(),
            mean_rows=result.mean_input_rows, union_rows=float(result.grad.nnz),
        )
        if deterministic:  # reproducible: the same inputs choose the same scheme on every run
            self.choice = choose_by_bytes(profile)
            self.best = {}
            return
        volume = {name: candidate_bytes(scheme, profile) for name, scheme in self.schemes.items()}
        fewest = min(volume.values())
        contenders = [name for name in volume if volume[name] <= self.prune_ratio * max(fewest, 1.0)]
        if self.agreed and self.profiles > 1:  # later profiles: only the contenders of the last one
            best = min(self.agreed.values())
            contenders = [c for c in contenders if c == PROFILER or self.agreed.get(c, best) <= 2 * best]
        rounds = self.trials if self.profiles == 1 else 1
        self.plan = [c for r in range(rounds) for c in contenders if not (r == 0 and c == PROFILER)]
        self.best = {c: self.best.get(c, ()) for c in contenders}
        if not self.plan:  # the profiler was the only contender
            self.choice, self.best = PROFILER, {}

    def _agree(self, ch: Channel) -> None:
        """Every rank's median time per candidate to every other; the max over ranks decides."""
        names = list(self.best)
        mine = torch.tensor([self._typical(n) for n in names], dtype=torch.float64)
        for j in range(ch.world_size):
            if j != ch.rank:
                ch.send(j, "auto_times", mine.view(torch.uint8))
        slowest = mine.clone()
        for j in range(ch.world_size):
            if j != ch.rank:
                theirs = ch.recv(j, "auto_times")
                with from_peer(ch, j, "auto_times"):
                    if theirs.dtype != torch.uint8 or theirs.dim() != 1 or theirs.numel() != mine.numel() * 8:
                        raise ValueError(f"auto: rank {j} timed {theirs.numel() // 8} candidates, this rank "
                                         f"{len(names)}")
                    times = theirs.view(torch.float64)
                    if not bool((times >= 0).all()):  # NaN (False here) or negative: no timing
                        raise ValueError(f"auto: times {times.tolist()} are not all non-negative numbers")
                slowest = torch.maximum(slowest, times)
        self.agreed = dict(zip(names, slowest.tolist(), strict=True))
        self.choice = min(names, key=lambda n: (self.agreed[n], names.index(n)))
        self.best = {}

    def _typical(self, name: str) -> float:
        """This rank's median time of a candidate in this profile (inf if it never ran)."""
        times = self.best[name]
        if name == PROFILER and self.profiles == 1 and len(times) > 1:
            times = times[1:]  # the tensor's first sync: cold
        return statistics.median(times) if times else float("inf")
