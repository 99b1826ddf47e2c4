"""The receive-buffer pool: blocks come back when every tensor on them is gone, never before."""

from __future__ import annotations

import pytest
import torch

from zend.transport.receive_pool import MIN_POOLED_BYTES, ReceivePool

pytestmark = pytest.mark.inprocess


def test_a_block_is_reused_once_its_tensor_is_gone():
    pool = ReceivePool(max_bytes=64 << 20)
    first = pool.take(1 << 20)
    address = first.data_ptr()
    del first
    again = pool.take(1 << 20)
    assert again.data_ptr() == address and again.numel() == 1 << 20
    assert (pool.stats.allocated, pool.stats.reused) == (1, 1)


def test_a_block_in_use_is_never_handed_out_twice():
    pool = ReceivePool(max_bytes=64 << 20)
    held = pool.take(1 << 20)
    other = pool.take(1 << 20)
    assert other.data_ptr() != held.data_ptr()
    held.fill_(7)
    other.fill_(9)
    assert bool((held == 7).all())


def test_views_and_slices_keep_their_block_busy():
    pool = ReceivePool(max_bytes=64 << 20)
    payload = pool.take(1 << 20)
    address = payload.data_ptr()
    floats = payload.view(torch.float32)[16:]  # what a scheme keeps of a received message
    del payload
    assert pool.take(1 << 20).data_ptr() != address
    del floats
    assert pool.take(1 << 20).data_ptr() == address


def test_sizes_share_a_power_of_two_class():
    pool = ReceivePool(max_bytes=64 << 20)
    address = pool.take(700_000).data_ptr()
    assert pool.take(1 << 20).data_ptr() == address  # both fit the 1 MiB class
    assert pool.stats.pooled_bytes == 1 << 20


def test_small_payloads_and_a_full_pool_get_fresh_memory():
    pool = ReceivePool(max_bytes=2 << 20)
    assert pool.take(MIN_POOLED_BYTES - 1).numel() == MIN_POOLED_BYTES - 1
    held = [pool.take(1 << 20), pool.take(1 << 20)]
    extra = pool.take(1 << 20)  # over max_bytes: served, not pooled
    assert extra.numel() == 1 << 20 and pool.stats.pooled_bytes == 2 << 20
    assert pool.stats.unpooled == 2 and len(held) == 2
