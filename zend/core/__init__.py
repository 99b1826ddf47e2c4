"""The ZEN algorithm and its baselines: pure tensor code, no network, gRPC or metrics."""

from zend.core.comm import Channel, CommError, Communicator, Traffic
from zend.core.schemes import SCHEMES, Scheme, SyncResult, make_scheme
from zend.core.sparse import SparseGrad, SparseGradError, from_dense, from_torch_sparse
from zend.core.topk import TopKCompressor

__all__ = [
    "SCHEMES", "Channel", "CommError", "Communicator", "Scheme", "SparseGrad", "SparseGradError",
    "SyncResult", "TopKCompressor", "Traffic", "from_dense", "from_torch_sparse", "make_scheme",
]
