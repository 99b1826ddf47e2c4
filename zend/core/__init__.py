"""The ZEN algorithm and its baselines: pure tensor code, no network, gRPC or metrics.

The names below load on first use: a trainer imports `zend.core.sparse` and `zend.core.topk`
without the schemes and their compiled kernels (numba), which only the daemon runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zend.core.comm import Channel, CommError, Communicator, Traffic
    from zend.core.schemes import SCHEMES, Scheme, SyncResult, make_scheme
    from zend.core.sparse import SparseGrad, SparseGradError, from_dense, from_torch_sparse
    from zend.core.topk import TopKCompressor

_HOMES = {
    "Channel": "comm", "CommError": "comm", "Communicator": "comm", "Traffic": "comm",
    "SCHEMES": "schemes", "Scheme": "schemes", "SyncResult": "schemes", "make_scheme": "schemes",
    "SparseGrad": "sparse", "SparseGradError": "sparse", "from_dense": "sparse", "from_torch_sparse": "sparse",
    "TopKCompressor": "topk",
}

__all__ = [
    "SCHEMES",
    "Channel",
    "CommError",
    "Communicator",
    "Scheme",
    "SparseGrad",
    "SparseGradError",
    "SyncResult",
    "TopKCompressor",
    "Traffic",
    "from_dense",
    "from_torch_sparse",
    "make_scheme",
]


def __getattr__(name: str) -> Any:  # PEP 562; its twin in zend.buffers stays: neither layer may import the other
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zend.core' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zend.core.{home}"), name)
