"""Every collected test is in exactly one tier (tests/conftest.py), and the tiers are registered."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.conftest import COLLECTED_TIERS, TIERS

pytestmark = pytest.mark.inprocess
ROOT = Path(__file__).resolve().parents[1]


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    collected = request.config.stash[COLLECTED_TIERS]  # this run's, before `-m` deselected any
    assert request.node.nodeid in collected
    wrong = {node: tiers for node, tiers in collected.items() if len(tiers) != 1}
    assert not wrong, f"{len(wrong)} tests without exactly one tier of {TIERS}: " + "\n".join(
        f"{node}: {tiers or 'none'}" for node, tiers in sorted(wrong.items())[:50])


def test_the_tiers_and_slow_are_registered_markers() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0] for line in options["markers"]}
    assert {*TIERS, "slow"} <= registered, registered
