"""The rendezvous retry wait (zend/daemon/backoff.py): grows, is capped, is jittered, never zero."""

from __future__ import annotations

import random

import pytest

from zend.daemon.backoff import Backoff

pytestmark = pytest.mark.inprocess


def test_waits_double_up_to_the_cap_each_in_the_upper_half_of_its_ceiling() -> None:
    b = Backoff(first_s=1.0, cap_s=30.0, rng=random.Random(7))
    waits = [b.next() for _ in range(10)]
    ceilings = [1, 2, 4, 8, 16, 30, 30, 30, 30, 30]
    for wait, ceiling in zip(waits, ceilings, strict=True):
        assert ceiling / 2 <= wait <= ceiling, (wait, ceiling)
    assert b.attempts == 10
    b.reset()
    assert b.next() <= 1.0


def test_two_daemons_that_fail_together_do_not_retry_together() -> None:
    a, b = Backoff(rng=random.Random(1)), Backoff(rng=random.Random(2))
    gaps = [abs(a.next() - b.next()) for _ in range(6)]
    assert max(gaps) > 0.1


def test_many_failures_do_not_overflow() -> None:
    b = Backoff(first_s=0.5, cap_s=5.0)
    b.attempts = 10_000
    assert 2.5 <= b.next() <= 5.0


@pytest.mark.parametrize("first, cap", [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_bad_bounds_are_refused_naming_them(first: float, cap: float) -> None:
    with pytest.raises(ValueError, match=f"first_s={first}"):
        Backoff(first_s=first, cap_s=cap)
