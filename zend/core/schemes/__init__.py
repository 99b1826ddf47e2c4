"""Every synchronisation scheme, by name."""

from __future__ import annotations

from typing import Any

from zend.core.schemes.auto import AutoScheme
from zend.core.schemes.base import Scheme, SyncResult
from zend.core.schemes.centralized import AGSparseScheme, HCScheme
from zend.core.schemes.dense import DenseScheme
from zend.core.schemes.parallel import OmniReduceScheme, SparsePSScheme, ZenScheme

SCHEMES: dict[str, type[Scheme]] = {
    "zen": ZenScheme,
    "hc": HCScheme,
    "agsparse": AGSparseScheme,
    "omnireduce": OmniReduceScheme,
    "sparse_ps": SparsePSScheme,
    "dense": DenseScheme,
    "auto": AutoScheme,
}


def make_scheme(name: str, **options: Any) -> Scheme:
    """A new scheme object; `seed` and `min_slice_width` go to the schemes that take them."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
    cls = SCHEMES[name]
    accepted = {"zen": {"seed", "min_slice_width"}, "auto": {"seed", "min_slice_width", "reprofile_every"},
                "omnireduce": {"block"}}.get(name, set())
    return cls(**{k: v for k, v in options.items() if k in accepted})


__all__ = ["SCHEMES", "Scheme", "SyncResult", "make_scheme"]
