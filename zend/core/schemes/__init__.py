"""Every synchronisation scheme, by name: SCHEMES, the registry, is the only list of them.

Everything else that goes through the schemes derives from it and from the traits each class
carries (zend.core.schemes.base.Scheme): auto's candidates and its pick by bytes (auto.py), the
byte models (`bytes_per_rank`), the simulator's default schemes and its traffic models. Adding a
scheme: its module here (a class with its name, traits and byte model), its class in the tuple
below, and its exact traffic model in zend/simulator/traffic_model.py; tests/core/test_registry.py
and tests/test_simulate_cli.py name what is missing. The order below is the order of every derived
list (auto breaks ties by it).
"""

from __future__ import annotations

import inspect
from typing import Any

from zend.core.schemes.auto import AutoScheme
from zend.core.schemes.base import Scheme, SyncResult
from zend.core.schemes.centralized import AGSparseScheme, HCScheme
from zend.core.schemes.dense import DenseScheme
from zend.core.schemes.parallel import OmniReduceScheme, SparsePSScheme, ZenScheme

SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls
    for cls in (ZenScheme, HCScheme, AGSparseScheme, OmniReduceScheme, SparsePSScheme, DenseScheme, AutoScheme)
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
