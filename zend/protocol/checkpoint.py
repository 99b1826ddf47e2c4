"""The in-memory checkpoint contract between a trainer and its daemon (both sides).

A checkpoint of a step is a set of objects by key (DCP's write items) and its metadata, the object with
key METADATA_KEY. Trainers put and read them through shared buffers (the Trainer service's PutCheckpoint
and ReadCheckpoint carry keys, offsets and lengths); a restore maps the daemon's read-only segments, each
asked for on buffers.sock with op SEGMENT_OP {"step", "segment"} and answered with its descriptor.
"""

from __future__ import annotations

METADATA_KEY = ""
SEGMENT_OP = "checkpoint_segment"
