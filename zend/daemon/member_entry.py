"""What a daemon publishes about itself in a rendezvous round, and the exact schema a reader holds it to.

Every node reads every other node's entry from the rendezvous store, so an entry is parsed as
strictly as a data-plane handshake: bounded size, JSON without NaN or Infinity, exact fields and
types, ranks within the world, a data-plane URI that parses, job ids and steps within the daemon's
own bounds. Entries are sealed in the store (store_seal.py), so a stranger cannot write one; the
schema is what keeps a bug, or a node of another version, from feeding a daemon numbers it cannot use.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from zend.daemon.jobs import MAX_JOB_ID
from zend.transport import parse_uri

MAX_ENTRY_BYTES = 1 << 20
MAX_JOBS = 4096
MAX_STEP = 1 << 62  # what a trainer's step may reach (the daemon refuses steps from 2^62 on)
FIELDS = frozenset({"rank", "uri", "agreed", "job_steps", "generation", "nonce"})


class EntryError(ValueError):
    """An entry that does not parse; the message names the field and the value."""


@dataclass(frozen=True)
class MemberEntry:
    rank: int  # the daemon's --rank
    uri: str  # its data-plane address
    agreed: dict[str, Any]  # the settings every node must share
    job_steps: dict[str, int] = field(default_factory=dict)  # job -> the step it is at here (elastic)
    generation: int = 0  # the highest membership generation this daemon has been in (0: none)
    nonce: str = ""  # what binds the entry to one round (one-shot: rank 0's random nonce)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=False).encode()


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a value an entry carries")


def _whole(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise EntryError(f"{name}={value!r:.40} is not an integer in [{low}, {high})")
    return value


def parse(raw: bytes, world_size: int) -> MemberEntry:
    """The entry in `raw`, checked against the schema and a world of `world_size` ranks; EntryError otherwise."""
    if len(raw) > MAX_ENTRY_BYTES:
        raise EntryError(f"entry of {len(raw)} bytes exceeds {MAX_ENTRY_BYTES}")
    try:
        fields = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise EntryError(f"entry is not JSON: {exc}") from None
    except RecursionError:
        raise EntryError("entry is nested too deep") from None
    if not isinstance(fields, dict) or set(fields) != FIELDS:
        got = sorted(map(str, fields))[:8] if isinstance(fields, dict) else type(fields).__name__
        raise EntryError(f"entry fields {got} are not {sorted(FIELDS)}")
    rank = _whole("rank", fields["rank"], 0, world_size)
    uri = fields["uri"]
    if not isinstance(uri, str):
        raise EntryError(f"uri={uri!r:.60} is not a string")
    try:
        _, _, port = parse_uri(uri)
    except ValueError as exc:
        raise EntryError(str(exc)) from None
    if port == 0:
        raise EntryError(f"uri {uri!r:.80} has port 0")
    agreed = fields["agreed"]
    if not isinstance(agreed, dict):
        raise EntryError(f"agreed={agreed!r:.60} is not an object")
    steps = fields["job_steps"]
    if not isinstance(steps, dict) or len(steps) > MAX_JOBS:
        raise EntryError(f"job_steps is not an object of at most {MAX_JOBS} jobs")
    for job, step in steps.items():
        if not 0 < len(job) <= MAX_JOB_ID or not job.isprintable():
            raise EntryError(f"job_steps names job {job[:40]!r}: not 1 to {MAX_JOB_ID} printable characters")
        _whole(f"job_steps[{job[:40]!r}]", step, 0, MAX_STEP)
    nonce = fields["nonce"]
    if not isinstance(nonce, str) or len(nonce) > 64:
        raise EntryError(f"nonce={nonce!r:.40} is not a string of at most 64 characters")
    return MemberEntry(rank, uri, agreed, dict(steps), _whole("generation", fields["generation"], 0, MAX_STEP),
                       nonce)
