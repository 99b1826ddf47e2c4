"""Which nodes hold a copy of each node's checkpoint objects: GEMINI's group placement.

The n nodes (by their rank in the generation) form groups of m = replicas + 1 consecutive ranks; every
member of a group holds every member's objects, so losing nodes loses a checkpoint only when a whole
group is lost. When m does not divide n, the last group takes the remainder (m to 2m - 1 nodes) and
places within itself as a ring: each node's objects go to the next `replicas` nodes of that group
(GEMINI's mixed placement). Pure functions.
"""

from __future__ import annotations


def groups(n: int, replicas: int) -> list[list[int]]:
    """The placement groups of ranks 0..n-1."""
    if n < 1 or replicas < 0:
        raise ValueError(f"placement needs n >= 1 and replicas >= 0, got n={n}, replicas={replicas}")
    m = min(replicas + 1, n)
    count = n // m
    out = [list(range(g * m, (g + 1) * m)) for g in range(count - 1)]
    out.append(list(range((count - 1) * m, n)))
    return out


def replica_peers(rank: int, n: int, replicas: int) -> tuple[int, ...]:
    """The ranks that hold a copy of `rank`'s objects, besides `rank` itself."""
    for group in groups(n, replicas):
        if rank in group:
            m = min(replicas + 1, n)
            if len(group) == m:
                return tuple(r for r in group if r != rank)
            i = group.index(rank)  # the remainder group: a ring within it
            return tuple(group[(i + k) % len(group)] for k in range(1, m))
    raise ValueError(f"rank {rank} is not in [0, {n})")


def held_by(rank: int, n: int, replicas: int) -> tuple[int, ...]:
    """The ranks whose objects `rank` holds a copy of (the inverse of replica_peers)."""
    return tuple(j for j in range(n) if rank in replica_peers(j, n, replicas))
