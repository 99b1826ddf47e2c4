"""Agreement: every rank (node) describes the same thing alike, or all of them refuse it.

Ranks that disagree on a setting (a hash seed, a scheme, the protocol version) or on a tensor
(its shape, dtype, layout) would exchange gradients that silently do not line up. One
comparison serves both: membership checks the settings at rendezvous with it, and `agree`
checks a tensor's description on its first step. Each rank compares the same n descriptions
the same way, so every rank raises the same error, naming the field, the rank and both values.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import torch

from zend.core.comm import Channel
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.protocol.layout import TensorSpec

MAX_LISTED = 10  # mismatches listed in one error before "... and N more"


def show_value(value: object) -> str:
    """A value as every rank prints it (JSON, keys sorted)."""
    return json.dumps(value, sort_keys=True)


def _differences(reference: Mapping[str, object], rank: int, other: Mapping[str, object], noun: str) -> list[str]:
    """How `noun` `rank`'s values differ from those of `noun` 0, one phrase per field."""
    found = []
    for key in sorted(set(reference) | set(other)):
        theirs = f"{key}={show_value(other[key])}" if key in other else f"no {key}"
        first = f"{key}={show_value(reference[key])}" if key in reference else f"no {key}"
        if theirs != first:
            found.append(f"{noun} {rank} has {theirs} but {noun} 0 has {first}")
    return found


def disagreements(values_by_rank: Mapping[int, Mapping[str, object]], noun: str = "rank") -> str | None:
    """Every field where a rank differs from rank 0 (which must be present), as one sentence; None if all
    agree. Used for the settings at rendezvous and, with noun "node", for a tensor's description."""
    reference = values_by_rank[0]
    found = [phrase for rank in sorted(values_by_rank) if rank != 0
             for phrase in _differences(reference, rank, values_by_rank[rank], noun)]
    if not found:
        return None
    more = f"; ... and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
    return "; ".join(found[:MAX_LISTED]) + more


def agree(ch: Channel, spec: TensorSpec, local_world_size: int,
          await_peer: Callable[[int], torch.Tensor] | None = None) -> None:
    """Every node sends every other its description of the tensor; any difference fails on every node.

    Each node compares the same n descriptions the same way, so all raise the same error.
    `await_peer(j)` receives node j's (default: `ch.recv(j, "agree")`).
    """
    ours = {**spec.describe(), "local_world_size": local_world_size}
    blob = torch.frombuffer(bytearray(json.dumps(ours, sort_keys=True).encode()), dtype=torch.uint8)
    for j in range(ch.world_size):
        if j != ch.rank:
            ch.send(j, "agree", blob)
    everyone: dict[int, dict[str, object]] = {ch.rank: ours}
    for j in range(ch.world_size):
        if j != ch.rank:
            raw = ch.recv(j, "agree") if await_peer is None else await_peer(j)
            try:
                described = json.loads(bytes(raw.numpy()))
            except ValueError:
                raise StepError(codes.INVALID_ARGUMENT, f"node {j} sent an unreadable tensor description") from None
            if not isinstance(described, dict):
                raise StepError(codes.INVALID_ARGUMENT, f"node {j} sent a tensor description that is no object")
            everyone[j] = described
    problem = disagreements(everyone, noun="node")
    if problem:
        raise StepError(codes.INVALID_ARGUMENT, f"tensor {spec.name!r} of job {spec.job!r}: {problem}")
