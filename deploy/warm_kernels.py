"""Compile zend's numba kernels into $NUMBA_CACHE_DIR: run by deploy/Dockerfile's build stage, so that
the image ships them compiled (/opt/zen/numba-cache) and a daemon loads them instead of compiling
them at every start (deploy/entrypoint.sh copies them into the writable cache folder).

A kernel is compiled once per signature (its arrays' dtypes, dimensions and layouts), so the
warm-up runs what the daemon runs: every scheme's sync, n ranks in this process, for every value
type the daemon takes, on gradients that take each path (sliced wide rows, whole narrow rows,
element-sparse, COO and bitmap messages, the dense ring). tests/deploy/test_image_numba_cache.py
checks that real daemons then compile nothing. Prints what it compiled, as JSON.

    NUMBA_CACHE_DIR=DIR [NUMBA_CPU_NAME=x86-64-v3 NUMBA_CPU_FEATURES=] python deploy/warm_kernels.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

from zend.core import dtypes, kernels
from zend.core.comm import Channel, Communicator
from zend.core.schemes import SCHEMES, make_scheme
from zend.core.sparse import SparseGrad
from zend.transport.inproc import InProcessCluster

WORLD_SIZES = (2, 4)  # world sizes only pick paths (S, merge): signatures do not depend on n (up to 16)
# (rows of the tensor, values per row, rows each rank touches): row_len 64 is cut into S = n slices;
# 4 and 1 are whole-row units (S = 1: the two-pass push, the merged assembly); the third number makes
# messages sparse (COO keys) or dense enough for a bitmap
SHAPES = ((50_257, 64, 300), (1_000, 4, 3), (1_000, 4, 400), (4_096, 1, 2_000), (512, 16, 500))


def gradient(rank: int, num_rows: int, row_len: int, touched: int, dtype: torch.dtype) -> SparseGrad:
    g = torch.Generator().manual_seed(rank)
    rows = torch.randperm(num_rows, generator=g)[:touched].sort().values
    values = torch.randn(touched, row_len, generator=g).to(dtype)
    return SparseGrad(rows, values if row_len > 1 else values.reshape(-1), num_rows, coalesced=True)


def sync(name: str, grads: list[SparseGrad], deterministic: bool, rank: int, comm: Communicator) -> None:
    make_scheme(name, seed=1).sync(Channel(comm, "warm"), grads[rank], deterministic=deterministic)


def warm() -> None:
    for value_type in dtypes.VALUE_TYPES:
        for n in WORLD_SIZES:
            for shape in SHAPES:
                grads = [gradient(rank, *shape, value_type.torch) for rank in range(n)]
                for name in SCHEMES:
                    for deterministic in (False, True):
                        InProcessCluster(n, serialize=True).run(partial(sync, name, grads, deterministic))


def main() -> int:
    cache = os.environ.get("NUMBA_CACHE_DIR")
    if not kernels.available() or not cache:
        print("warm_kernels: needs numba and NUMBA_CACHE_DIR", file=sys.stderr)
        return 2
    started = time.monotonic()
    warm()
    files = sorted(p.name for p in Path(cache).rglob("*.nbc"))
    print(json.dumps({"seconds": round(time.monotonic() - started, 1), "signatures_in_cache": len(files),
                      "cpu": os.environ.get("NUMBA_CPU_NAME", "host"), "cache": cache}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
