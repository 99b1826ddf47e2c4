"""Wire encodings of one message: a set of units of one partition, or a dense chunk.

Every message is one contiguous uint8 tensor: a 40-byte header, then the payload.
- COO: the keys (int32, or int64 for domains of 2^31 units or more), then the values.
- BITMAP: one bit per unit of the partition's domain, padded to 8 bytes, then the values in
  key order. Total bitmap a worker receives in ZEN's pull is about one bit per row slice of
  the tensor, independent of the number of partitions.
- DENSE: values only.
`encode_units` takes whichever allowed encoding is smaller, from exact byte counts. Decoding
checks every length and range, so a malformed message raises CodecError, never corrupts.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import torch

from zend.core import dtypes, kernels
from zend.core.sparse import ascending

MAGIC = b"ZN"
VERSION = 1
_HEADER = struct.Struct("<2sBBBB2xI4xQQQ")  # magic, version, kind, dtype, index width, unit width, count, domain, aux
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 40


class CodecError(ValueError):
    """A message that does not decode: names the field and the value."""


class PeerMessageError(CodecError):
    """A message from rank `src` that does not decode or fails a check of what it carries (keys of
    the tensor, finite values): names the sender, the receiver and the phase."""

    def __init__(self, src: int, dst: int, phase: str, reason: str):
        super().__init__(f"rank {src} sent rank {dst} a bad {phase} message: {reason}")
        self.src, self.dst, self.phase, self.reason = src, dst, phase, reason

    def __reduce__(self) -> tuple[type, tuple[int, int, str, str]]:  # picklable, as exceptions are
        return type(self), (self.src, self.dst, self.phase, self.reason)


class Encoding(enum.IntEnum):
    COO = 0
    BITMAP = 1
    DENSE = 2


@dataclass(frozen=True)
class Header:
    kind: Encoding
    dtype: torch.dtype
    index_width: int
    unit_width: int
    count: int
    domain: int
    aux: int  # a small integer riding along (ZEN's pull carries the units its owner received)


def _index_width(domain: int) -> int:
    return 4 if domain <= 2**31 else 8


def bitmap_bytes(domain: int) -> int:
    return 8 * ((domain + 63) // 64)


def encoded_size(kind: Encoding, count: int, unit_width: int, domain: int, dtype: torch.dtype) -> int:
    value_bytes = count * unit_width * torch.finfo(dtype).bits // 8
    if kind is Encoding.COO:
        return HEADER_BYTES + count * _index_width(domain) + value_bytes
    if kind is Encoding.BITMAP:
        return HEADER_BYTES + bitmap_bytes(domain) + value_bytes
    return HEADER_BYTES + value_bytes


def cheapest(count: int, unit_width: int, domain: int, dtype: torch.dtype, allowed: tuple[Encoding, ...]) -> Encoding:
    return min(allowed, key=lambda k: (encoded_size(k, count, unit_width, domain, dtype), k.value))


@dataclass(frozen=True)
class UnitsMessage:
    """A units message allocated before its content is known: fill `index` and `values` in place.

    `index` is the COO key array (int32 or int64) or the bitmap (uint8, one bit per unit of the
    domain, LSB first); `values` is the (count, unit_width) matrix. Writing straight into these
    views is what saves the copy of a separate encode pass.
    """

    buf: torch.Tensor
    kind: Encoding
    index: torch.Tensor
    values: torch.Tensor


def _header_bytes(kind: Encoding, dtype: torch.dtype, index_width: int, unit_width: int, count: int, domain: int,
                  aux: int) -> torch.Tensor:
    code = dtypes.BY_TORCH[dtype].wire_code
    raw = _HEADER.pack(MAGIC, VERSION, kind, code, index_width, unit_width, count, domain, aux)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def allocate_units(kind: Encoding, count: int, unit_width: int, domain: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", aux: int = 0) -> UnitsMessage:
    """An uninitialised COO or BITMAP message with its header written; the caller fills the rest
    (a bitmap must be zeroed first or written whole)."""
    buf = torch.empty(encoded_size(kind, count, unit_width, domain, dtype), dtype=torch.uint8, device=device)
    return _units_in(buf, kind, count, unit_width, domain, dtype, aux)


def allocate_many(kinds: list[Encoding], counts: list[int], unit_width: int, domain: int, dtype: torch.dtype,
                  aux: int = 0) -> tuple[torch.Tensor, list[UnitsMessage]]:
    """Several CPU units messages over one domain laid out in one buffer, each starting 8-byte
    aligned, headers written: (the buffer, the messages). One allocation instead of n, for a
    kernel that fills every message in one pass over the gradient."""
    sizes = [encoded_size(k, c, unit_width, domain, dtype) for k, c in zip(kinds, counts, strict=True)]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // 8) * 8)
    buffer = torch.empty(offsets[-1], dtype=torch.uint8)
    messages = [_units_in(buffer[at : at + size], kind, count, unit_width, domain, dtype, aux)
                for at, size, kind, count in zip(offsets, sizes, kinds, counts, strict=False)]
    return buffer, messages


def _units_in(buf: torch.Tensor, kind: Encoding, count: int, unit_width: int, domain: int, dtype: torch.dtype,
              aux: int) -> UnitsMessage:
    if kind is Encoding.DENSE:
        raise ValueError("units messages are COO or BITMAP")
    index_width = _index_width(domain) if kind is Encoding.COO else 0
    buf[:HEADER_BYTES].copy_(_header_bytes(kind, dtype, index_width, unit_width, count, domain, aux))
    cut = HEADER_BYTES + (count * index_width if kind is Encoding.COO else bitmap_bytes(domain))
    index = buf[HEADER_BYTES:cut]
    if kind is Encoding.COO:
        index = index.view(torch.int32 if index_width == 4 else torch.int64)
    return UnitsMessage(buf, kind, index, buf[cut:].view(dtype).view(count, unit_width))


def write_bitmap(bitmap: torch.Tensor, keys: torch.Tensor, domain: int) -> None:
    """Set the bits of `keys` (unique, in [0, domain)) in the bitmap, clearing every other bit: in one
    compiled pass over the keys where the kernels serve the bitmap, else in torch."""
    bitmap.zero_()
    if kernels.serves(bitmap):
        kernels.set_bits(bitmap.numpy(), keys.numpy())
    else:
        _set_bits_torch(bitmap, keys)


def _set_bits_torch(bitmap: torch.Tensor, keys: torch.Tensor) -> None:
    # keys are unique, so adding the bits of a byte is OR-ing them
    bit_values = torch.bitwise_left_shift(torch.ones(keys.numel(), dtype=torch.uint8, device=keys.device),
                                          torch.bitwise_and(keys, 7).to(torch.uint8))
    bitmap.index_put_((torch.bitwise_right_shift(keys, 3).long(),), bit_values, accumulate=True)


def encode_gathered(keys: torch.Tensor, source: torch.Tensor, rows: torch.Tensor | None, domain: int,
                    allowed: tuple[Encoding, ...] = (Encoding.COO, Encoding.BITMAP), aux: int = 0,
                    keys_sorted: bool = False) -> torch.Tensor:
    """Encode units `keys` whose values are `source[rows]` (or all of `source`), gathered straight
    into the message: the values are copied once, from the gradient to the wire buffer."""
    count, width = keys.numel(), source.shape[1]
    kind = cheapest(count, width, domain, source.dtype, allowed)
    if kind is Encoding.BITMAP and not keys_sorted and not ascending(keys):
        order = torch.argsort(keys)
        keys = keys.index_select(0, order)
        rows = order if rows is None else rows.index_select(0, order)
    msg = allocate_units(kind, count, width, domain, source.dtype, source.device, aux)
    if kind is Encoding.COO:
        msg.index.copy_(keys)
    else:
        write_bitmap(msg.index, keys, domain)
    if rows is None:
        msg.values.copy_(source)
    else:
        torch.index_select(source, 0, rows, out=msg.values)
    return msg.buf


def encode_units(keys: torch.Tensor, values: torch.Tensor, domain: int,
                 allowed: tuple[Encoding, ...] = (Encoding.COO, Encoding.BITMAP), aux: int = 0,
                 keys_sorted: bool = False) -> torch.Tensor:
    """Encode units `keys` (integers, unique, in [0, domain)) with `values` (count, unit_width)."""
    return encode_gathered(keys, values, None, domain, allowed, aux, keys_sorted)


def encode_dense(values: torch.Tensor, aux: int = 0) -> torch.Tensor:
    flat = values.reshape(-1)
    buf = torch.empty(encoded_size(Encoding.DENSE, flat.numel(), 1, flat.numel(), flat.dtype), dtype=torch.uint8,
                      device=flat.device)
    buf[:HEADER_BYTES].copy_(_header_bytes(Encoding.DENSE, flat.dtype, 0, 1, flat.numel(), flat.numel(), aux))
    buf[HEADER_BYTES:].view(flat.dtype).copy_(flat)
    return buf


def read_header(buf: torch.Tensor) -> Header:
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise CodecError(f"message must be a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    if buf.numel() < HEADER_BYTES:
        raise CodecError(f"message of {buf.numel()} bytes is shorter than the {HEADER_BYTES}-byte header")
    raw = bytes(buf[:HEADER_BYTES].cpu().numpy())
    magic, version, kind, dtype_code, index_width, unit_width, count, domain, aux = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CodecError(f"codec version {version} not supported (this side speaks {VERSION})")
    if kind not in Encoding._value2member_map_:
        raise CodecError(f"unknown encoding {kind}")
    if dtype_code not in dtypes.BY_WIRE_CODE:
        raise CodecError(f"unknown dtype code {dtype_code}")
    header = Header(Encoding(kind), dtypes.BY_WIRE_CODE[dtype_code].torch, index_width, unit_width, count, domain, aux)
    expected = encoded_size(header.kind, count, unit_width, domain, header.dtype)
    if header.kind is Encoding.COO and index_width != _index_width(domain):
        raise CodecError(f"index width {index_width} does not match domain {domain}")
    if buf.numel() != expected:
        raise CodecError(f"message is {buf.numel()} bytes, header promises {expected}")
    if count > domain:
        raise CodecError(f"count {count} exceeds domain {domain}")
    return header


def _bitmap_keys(bitmap: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """Positions of the set bits, ascending (int64; at most `count` of them), and how many bits are set:
    word by word, compiled, where the kernels serve the bitmap, else in numpy or torch."""
    if kernels.serves(bitmap):
        keys = torch.empty(count, dtype=torch.int64)
        found = kernels.bitmap_keys(bitmap.numpy(), keys.numpy())
        return keys[: min(found, count)], found
    return _bitmap_keys_twin(bitmap)


def _bitmap_keys_twin(bitmap: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not bitmap.is_cuda:
        # flatnonzero over a bool view: 4x faster than over the uint8 bits
        keys = torch.from_numpy(np.flatnonzero(np.unpackbits(bitmap.numpy(), bitorder="little").view(np.bool_)))
        return keys, keys.numel()
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    keys = ((bitmap.unsqueeze(1) >> shifts) & 1).reshape(-1).nonzero().squeeze(1)
    return keys, keys.numel()


def decode_units(buf: torch.Tensor, unit_width: int, domain: int, dtype: torch.dtype,
                 keys_ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor, Header]:
    """Decode a COO or BITMAP message into (keys int64, values (count, unit_width), header).

    The caller states what it expects (unit width, domain, dtype); any difference raises.
    Bitmap keys come back sorted; `keys_ascending` also requires COO keys to ascend strictly
    (so that they are unique: what a sum's owner sends).
    """
    h = read_header(buf)
    if h.kind is Encoding.DENSE:
        raise CodecError("expected a sparse message, got a dense one")
    if (h.unit_width, h.domain, h.dtype) != (unit_width, domain, dtype):
        raise CodecError(
            f"message for units of width {h.unit_width}, domain {h.domain}, {h.dtype}; "
            f"expected width {unit_width}, domain {domain}, {dtype}"
        )
    body = buf[HEADER_BYTES:]
    if h.kind is Encoding.COO:
        index_dtype = torch.int32 if h.index_width == 4 else torch.int64
        cut = h.count * h.index_width
        keys = body[:cut].view(index_dtype).to(torch.int64)
        if h.count:
            lo, hi = int(keys.min()), int(keys.max())
            if lo < 0 or hi >= domain:
                raise CodecError(f"key {lo if lo < 0 else hi} outside domain {domain}")
            if keys_ascending and not ascending(keys):
                bad = int((keys[1:] <= keys[:-1]).nonzero()[0, 0]) + 1
                raise CodecError(f"key {int(keys[bad])} at position {bad} does not ascend")
    else:
        cut = bitmap_bytes(domain)
        keys, found = _bitmap_keys(body[:cut], h.count)
        if found != h.count or (h.count and int(keys[-1]) >= domain):
            raise CodecError(f"bitmap has {found} bits set in domain {domain}, header says {h.count}")
    values = body[cut:].view(h.dtype).reshape(h.count, h.unit_width)
    return keys, values, h


def decode_dense(buf: torch.Tensor, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Header]:
    h = read_header(buf)
    if h.kind is not Encoding.DENSE or h.count != numel or h.dtype != dtype:
        raise CodecError(f"expected a dense message of {numel} {dtype}, got {h.kind.name} of {h.count} {h.dtype}")
    return buf[HEADER_BYTES:].view(dtype), h
