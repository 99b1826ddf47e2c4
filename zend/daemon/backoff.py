"""How long to wait before trying a rendezvous again: exponential, capped, with jitter (pure).

Daemons that lost a round together retry together; without jitter they would meet the store at the
same instant each time. `Backoff.next()` gives the next wait: the n-th is drawn uniformly from the
upper half of min(cap_s, first_s * 2**n), so waits never shrink to nothing and never sync up.
`reset()` after a success. The random source is injectable, for tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    first_s: float = 1.0
    cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0  # failures so far (since the last reset)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s:
            raise ValueError(f"backoff first_s={self.first_s} must be positive and at most cap_s={self.cap_s}")

    def next(self) -> float:
        """The wait before the next try (and one more failure counted)."""
        ceiling = min(self.cap_s, self.first_s * 2.0 ** min(self.attempts, 62))
        self.attempts += 1
        return self.rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempts = 0
