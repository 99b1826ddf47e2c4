"""One list of schemes (issue 25): every list of schemes derives from the registry and the traits
and byte models its classes carry."""

from __future__ import annotations

import pytest

from zend.core import SCHEMES, costmodel
from zend.core.schemes import auto

pytestmark = pytest.mark.inprocess

PROFILES = [
    costmodel.Profile(world_size=8, num_rows=50_000, row_bytes=256, mean_rows=1_000.0, union_rows=5_000.0),
    costmodel.Profile(world_size=4, num_rows=1_000, row_bytes=32, mean_rows=900.0, union_rows=1_000.0),
    costmodel.Profile(world_size=16, num_rows=1_000_000, row_bytes=4, mean_rows=300.0, union_rows=4_000.0),
]
# the formulas the costmodel's tables held before each scheme carried its own
FORMULAS = {"zen": costmodel.bytes_balanced_parallel, "hc": costmodel.bytes_hierarchical,
            "agsparse": costmodel.bytes_allgather, "sparse_ps": costmodel.bytes_range_parallel,
            "dense": costmodel.bytes_dense}


def test_auto_candidates_are_the_schemes_whose_class_says_so_in_the_registry_order():
    assert auto.candidates() == ("zen", "hc", "agsparse", "sparse_ps", "dense")
    assert tuple(auto.AutoScheme().schemes) == auto.candidates()


def test_auto_picks_by_bytes_among_candidates_it_can_run():
    picked = tuple(name for name, cls in SCHEMES.items() if cls.deterministic_candidate)
    assert picked == ("zen", "hc", "dense")
    assert set(picked) <= set(auto.candidates())  # auto runs its pick from its candidates' objects


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_scheme_auto_may_run_has_its_byte_model(name):
    cls = SCHEMES[name]
    for profile in PROFILES:
        volume = cls.bytes_per_rank(profile)
        if name in FORMULAS:
            assert volume == FORMULAS[name](profile)
        else:
            assert volume is None
            assert not (cls.auto_candidate or cls.deterministic_candidate), f"{name} is a candidate without bytes"


def test_the_pick_by_bytes_is_the_fewest_bytes_among_zen_hc_and_dense():
    for profile in PROFILES:
        costs = {name: FORMULAS[name](profile) for name in ("zen", "hc", "dense")}
        assert auto.choose_by_bytes(profile) == min(costs, key=lambda k: costs[k])
    assert {auto.choose_by_bytes(p) for p in PROFILES} == {"zen", "dense"}


def test_a_registered_name_is_its_class_name():
    assert all(cls.name == name for name, cls in SCHEMES.items())
