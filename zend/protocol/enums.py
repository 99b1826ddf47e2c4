"""The proto enums of zen.v1 and the names the rest of zen uses for them, both directions.

Derived from zend.core.dtypes (the one dtype table) and protocol.layout's layouts, so a new
dtype or layout needs one edit there and one in proto/zen/v1/zen.proto.
"""

from __future__ import annotations

from zend.api.zen.v1 import zen_pb2 as pb
from zend.core import dtypes
from zend.protocol.layout import LAYOUTS

DTYPE_TO_PROTO: dict[str, pb.DType] = {t.name: pb.DType.Value(t.proto_name) for t in dtypes.VALUE_TYPES}
DTYPE_FROM_PROTO: dict[int, str] = {v: k for k, v in DTYPE_TO_PROTO.items()}
LAYOUT_TO_PROTO: dict[str, pb.Layout] = {name: pb.Layout.Value(name.upper()) for name in LAYOUTS}
LAYOUT_FROM_PROTO: dict[int, str] = {v: k for k, v in LAYOUT_TO_PROTO.items()}
