"""Every synchronisation scheme, by name."""

from __future__ import annotations

import inspect
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


def options_of(name: str) -> frozenset[str]:
    """The options scheme `name` takes: its constructor's parameters."""
    return frozenset(inspect.signature(SCHEMES[name]).parameters)


def make_scheme(name: str, **options: Any) -> Scheme:
    """A new scheme object, given the options it takes among `options` (the others are for other schemes:
    the daemon passes one set of settings whatever the scheme)."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
    accepted = options_of(name)
    return SCHEMES[name](**{k: v for k, v in options.items() if k in accepted})


__all__ = ["SCHEMES", "Scheme", "SyncResult", "make_scheme", "options_of"]
