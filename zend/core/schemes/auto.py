"""`auto`: ZEN's choice among zen, hc and dense by the cost model, kept up to date.

The first sync of a tensor, and every `reprofile_every`-th after it, runs zen, whose pull tells
every rank the same cluster-wide figures (mean non-zero rows per rank, rows after summing).
The cost model then picks the scheme for the following syncs. Every rank feeds the model the
same numbers, so every rank picks the same scheme. One AutoScheme object per tensor.
"""

from __future__ import annotations

from zend.core import costmodel
from zend.core.comm import Channel
from zend.core.schemes.base import Scheme, SyncResult
from zend.core.schemes.centralized import HCScheme
from zend.core.schemes.dense import DenseScheme
from zend.core.schemes.parallel import ZenScheme
from zend.core.sparse import SparseGrad


class AutoScheme(Scheme):
    """Not a scheme of its own: it picks one of its three per sync, which does the work."""

    name = "auto"

    def __init__(self, seed: int = 0, reprofile_every: int = 100, min_slice_width: int = 8):
        if reprofile_every < 1:
            raise ValueError(f"reprofile_every {reprofile_every} must be at least 1")
        self.reprofile_every = reprofile_every
        self.schemes: dict[str, Scheme] = {
            "zen": ZenScheme(seed, min_slice_width), "hc": HCScheme(), "dense": DenseScheme(),
        }
        self.syncs = 0
        self.choice = "zen"

    def sync(self, ch: Channel, grad: SparseGrad, *, average: bool = False,
             deterministic: bool = False) -> SyncResult:
        profiling = self.syncs % self.reprofile_every == 0
        self.syncs += 1
        scheme = self.schemes["zen"] if profiling else self.schemes[self.choice]
        result = scheme.sync(ch, grad, average=average, deterministic=deterministic)
        if profiling and result.mean_input_rows is not None:
            profile = costmodel.Profile(
                world_size=ch.world_size, num_rows=grad.num_rows,
                row_bytes=grad.row_len * grad.values.element_size(),
                mean_rows=result.mean_input_rows, union_rows=float(result.grad.nnz),
            )
            self.choice, _ = costmodel.choose(profile)
        result.details.update({"auto_ran": scheme.name, "auto_next": self.choice, "auto_profiled": profiling})
        result.scheme = f"auto:{scheme.name}"
        return result
