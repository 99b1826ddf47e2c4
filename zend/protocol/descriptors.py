"""Reading protobuf descriptors the same way on every protobuf zen supports (4.25 to 7.x)."""

from __future__ import annotations

from typing import Any


def is_repeated(field: Any) -> bool:
    """Whether a FieldDescriptor is a repeated field: `is_repeated` from protobuf 6.31 on, `label`
    (gone in 7) before."""
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else bool(field.label == field.LABEL_REPEATED)
