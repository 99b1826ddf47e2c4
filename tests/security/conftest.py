"""A two-node cluster that the abuse suite attacks, an honest job that must keep getting exact sums,
and the tally of what every attack got back (written to build/abuse_report.json at the end).

A case counts as a *clear error* when the daemon refused it with a status and a message (or closed
the connection it came on), a *crash* when the daemon answered with an error it did not mean
(INTERNAL or UNKNOWN from our handlers) or died, a *hang* when it neither answered nor closed in time.
Wrong sums are counted by the honest job's checks after each surface. The last three must be 0.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import run_all
from zend.cluster.local import LocalCluster
from zend.core.sparse import SparseGrad
from zend.protocol import paths
from zend.protocol.health import health_status
from zend.protocol.session import TrainerSession
from zend.protocol.step import StepFailed

ROOT = Path(__file__).resolve().parents[2]
OUTCOMES = ("clear", "crash", "hang", "wrong_sum")


class Tally:
    """Cases per surface and what each got."""

    def __init__(self) -> None:
        self.rows: dict[str, Counter[str]] = {}
        self.lock = threading.Lock()

    def count(self, surface: str, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        with self.lock:
            self.rows.setdefault(surface, Counter())[outcome] += 1

    def write(self, path: Path) -> None:
        path.parent.mkdir(exist_ok=True)
        rows = [{"surface": s, "cases": sum(c.values()), **{o: c[o] for o in OUTCOMES}} for s, c in self.rows.items()]
        path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


@pytest.fixture(scope="session")
def tally() -> Iterator[Tally]:
    t = Tally()
    yield t
    if t.rows:
        t.write(ROOT / "build" / "abuse_report.json")


class Target:
    """The attacked cluster and its honest job."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self._steps = itertools.count()

    def healthy(self) -> bool:
        return all(health_status(paths.grpc_address(self.cluster.socket_dir(n)), 5.0) == "SERVING"
                   for n in range(self.cluster.nodes))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.cluster.procs.values())

    def next_step(self) -> int:
        return next(self._steps)

    def honest_step(self, tally: Tally, surface: str, tries: int = 6, step: int | None = None) -> list[str]:
        """One step of an honest job on every node: the same outcome everywhere, and in the end the
        exact sum (a step the attack made fail may be retried, as a training loop would). Returns the
        errors of the failed attempts, as "node N: CODE: details"."""
        step = next(self._steps) if step is None else step
        errors: list[str] = []
        rows, dim = 300, 4

        def grad(node: int) -> SparseGrad:
            g = torch.Generator().manual_seed(1000 * step + node)
            idx = torch.randint(0, rows, (50,), generator=g)
            return SparseGrad(idx, torch.randn(50, dim, generator=g), rows)

        def trainer(node: int) -> torch.Tensor:
            c = self.cluster
            with TrainerSession(c.socket_dir(node), "honest", c.token("honest"), 0, 1, timeout_s=30) as link:
                h = link.register("emb", (rows, dim))
                for attempt in range(tries):
                    try:
                        return link.allreduce(h, grad(node), step).to_dense()
                    except StepFailed as exc:
                        errors.append(f"node {node} attempt {attempt}: {exc.code}: {exc.message}")
                        if attempt == tries - 1:
                            raise
                        link.ready(30)
                raise AssertionError("unreachable")

        results = run_all([lambda n=n: trainer(n) for n in range(self.cluster.nodes)])
        expected = sum(grad(n).to_dense() for n in range(self.cluster.nodes))
        for got in results:
            if isinstance(got, BaseException) or not torch.allclose(got, expected, atol=1e-5):
                tally.count(surface, "wrong_sum")
                raise AssertionError(f"the honest job after the {surface} attacks got {got!r}")
        return sorted(errors)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    with LocalCluster(2, tmp_path_factory.mktemp("attacked"), extra=[
            "--step-timeout-s", "20", "--peer-timeout-s", "5", "--claim-timeout-s", "2", "--log-format", "json",
            "--scheme", "zen"]) as c:
        t = Target(c)
        t.honest_step(Tally(), "setup")
        yield t
