"""PeerLinks' waits end when the transport closes, whatever state its links were left in."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from zend.core.comm import CommError
from zend.transport.peer_links import PeerLinks

pytestmark = pytest.mark.inprocess


def links_with_peer_up() -> PeerLinks:
    """Rank 0 of 2 with rank 1's link object in place (nothing in the waits touches the io or the path)."""
    none: Any = None
    links = PeerLinks(0, 2, none, b"s" * 32, 5.0, threading.Condition(), none, none, lambda *a, **k: None)
    links.peers[1].link = object()
    return links


def test_waiting_for_a_peer_ends_at_once_once_closed_even_with_its_link_object_still_there() -> None:
    """The fault drill's stall: a commit holding on a peer (`NodeSteps._hold`) asks `wait_relinked`, and the
    generation's end had closed the transport without marking that link down (the native engine's links
    go with the engine). The wait said "linked", every send and receive then failed on the closed
    transport, and the hold went round until the step timeout (300 s), holding up the next generation."""
    links = links_with_peer_up()
    links.wait_connected(1, 0.1)  # open: the link is up
    links.closed = True
    start = time.monotonic()
    with pytest.raises(CommError, match=r"rank 1 not connected: this transport is closed"):
        links.wait_connected(1, 30.0)
    assert time.monotonic() - start < 0.5
