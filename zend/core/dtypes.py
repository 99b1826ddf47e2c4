"""The gradient value types zen carries: the one table every layer derives its names and codes from.

`name` is torch's name (the daemon's tensor descriptions, the proto enum in upper case),
`short` the command-line spelling, `wire_code` the byte in a data-plane message header.
Codes and names are part of the wire formats: never renumber, only append.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ValueType:
    name: str
    short: str
    torch: torch.dtype
    wire_code: int

    @property
    def proto_name(self) -> str:
        """Its name in proto/zen/v1's DType enum."""
        return self.name.upper()


VALUE_TYPES = (
    ValueType("float32", "fp32", torch.float32, 1),
    ValueType("float16", "fp16", torch.float16, 2),
    ValueType("bfloat16", "bf16", torch.bfloat16, 3),
)
BY_NAME = {t.name: t for t in VALUE_TYPES}
BY_SHORT = {t.short: t for t in VALUE_TYPES}
BY_TORCH = {t.torch: t for t in VALUE_TYPES}
BY_WIRE_CODE = {t.wire_code: t for t in VALUE_TYPES}
TORCH_DTYPES = tuple(t.torch for t in VALUE_TYPES)
NAMES = tuple(t.name for t in VALUE_TYPES)
