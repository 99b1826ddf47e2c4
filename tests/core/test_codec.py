import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zend.core.codec import (
    HEADER_BYTES,
    CodecError,
    Encoding,
    decode_dense,
    decode_units,
    encode_dense,
    encode_units,
    encoded_size,
    read_header,
)

pytestmark = pytest.mark.inprocess

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def unit_sets(draw):
    domain = draw(st.integers(1, 3000))
    keys = draw(st.sets(st.integers(0, domain - 1), max_size=min(domain, 300)))
    width = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(DTYPES))
    keys_t = torch.tensor(sorted(keys), dtype=torch.int64)
    perm = torch.randperm(len(keys_t))
    values = torch.randn(len(keys_t), width).to(dtype)
    return keys_t[perm], values[perm], domain


@given(unit_sets(), st.sampled_from([(Encoding.COO,), (Encoding.BITMAP,), (Encoding.COO, Encoding.BITMAP)]))
def test_round_trip_and_cheaper_encoding(case, allowed):
    keys, values, domain = case
    msg = encode_units(keys, values, domain, allowed, aux=42)
    header = read_header(msg)
    sizes = {k: encoded_size(k, len(keys), values.shape[1], domain, values.dtype) for k in allowed}
    assert msg.numel() == sizes[header.kind] == min(sizes.values())  # exact size, and the smaller one
    assert header.aux == 42
    got_keys, got_values, _ = decode_units(msg, values.shape[1], domain, values.dtype)
    order = torch.argsort(keys)
    if header.kind is Encoding.COO:
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    else:  # the bitmap carries values in key order
        assert torch.equal(got_keys, keys[order]) and torch.equal(got_values, values[order])


def test_bitmap_wins_when_dense_enough_and_coo_when_sparse():
    values = torch.ones(100, 1)
    dense_keys = torch.arange(100)
    assert read_header(encode_units(dense_keys, values, 200)).kind is Encoding.BITMAP
    sparse_keys = torch.arange(0, 100_000, 1000)
    assert read_header(encode_units(sparse_keys, values, 100_000)).kind is Encoding.COO


def test_large_domain_uses_64_bit_keys():
    keys = torch.tensor([0, 2**33])
    msg = encode_units(keys, torch.ones(2, 1), 2**34, (Encoding.COO,))
    assert read_header(msg).index_width == 8
    got, _, _ = decode_units(msg, 1, 2**34, torch.float32)
    assert got.tolist() == [0, 2**33]


def test_dense_round_trip():
    values = torch.randn(37).to(torch.bfloat16)
    msg = encode_dense(values)
    assert msg.numel() == HEADER_BYTES + 74
    got, _ = decode_dense(msg, 37, torch.bfloat16)
    assert torch.equal(got, values)


def _valid():
    return encode_units(torch.tensor([1, 5, 9]), torch.ones(3, 2), 10, (Encoding.COO,))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:20], "shorter than the 40-byte header"),
        (lambda b: torch.cat([torch.tensor([0x58], dtype=torch.uint8), b[1:]]), "bad magic"),
        (lambda b: torch.cat([b[:2], torch.tensor([9], dtype=torch.uint8), b[3:]]), "version 9"),
        (lambda b: b[:-4], "header promises"),
        (lambda b: torch.cat([b, torch.zeros(4, dtype=torch.uint8)]), "header promises"),
        (lambda b: torch.cat([b[:HEADER_BYTES], torch.tensor([77, 0, 0, 0], dtype=torch.uint8), b[HEADER_BYTES + 4:]]),
         "key 77 outside domain 10"),
    ],
)
def test_garbage_is_refused_with_a_named_reason(mutate, match):
    with pytest.raises(CodecError, match=match):
        decode_units(mutate(_valid().clone()), 2, 10, torch.float32)


def test_decoder_checks_what_it_expects():
    with pytest.raises(CodecError, match="expected width 3"):
        decode_units(_valid(), 3, 10, torch.float32)
    with pytest.raises(CodecError, match="expected a sparse message"):
        decode_units(encode_dense(torch.ones(3)), 1, 3, torch.float32)


def test_bitmap_with_bits_past_the_domain_is_refused():
    msg = encode_units(torch.arange(8), torch.ones(8, 1), 10, (Encoding.BITMAP,)).clone()
    msg[HEADER_BYTES + 1] = 0xFF  # sets bits 8..15; the domain ends at 10
    with pytest.raises(CodecError, match="bits set"):
        decode_units(msg, 1, 10, torch.float32)


def test_empty_message_for_an_empty_domain():
    msg = encode_units(torch.empty(0, dtype=torch.int64), torch.empty(0, 3), 0)
    keys, values, _ = decode_units(msg, 3, 0, torch.float32)
    assert keys.numel() == 0 and values.shape == (0, 3)


@given(st.integers(1, 5000), st.data())
def test_compiled_bitmap_decoding_matches_numpy(domain, data):
    """kernels.bitmap_keys (word by word, a de Bruijn lookup per set bit) gives numpy's keys, counts
    every set bit even past `out`, and handles a bitmap that does not start on an 8-byte boundary."""
    import numpy as np

    from zend.core import kernels
    from zend.core.codec import bitmap_bytes

    keys = np.array(sorted(data.draw(st.sets(st.integers(0, domain - 1), max_size=domain))), dtype=np.int64)
    raw = np.zeros(bitmap_bytes(domain) + 1, dtype=np.uint8)
    bitmap = raw[1:] if data.draw(st.booleans()) else raw[:-1]  # misaligned, or aligned
    kernels.set_bits(bitmap, keys)
    expected = np.flatnonzero(np.unpackbits(bitmap, bitorder="little").view(np.bool_))
    room = data.draw(st.integers(0, keys.size))
    out = np.full(room, -1, dtype=np.int64)
    assert kernels.bitmap_keys(bitmap, out) == expected.size == keys.size
    assert (out == expected[:room]).all()
