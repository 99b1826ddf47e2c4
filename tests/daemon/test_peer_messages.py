"""A peer's bad message, at the node level (issue 14, item 3): three nodes of two trainers, each wired
as the daemon wires it (test_node_steps' Node); node 2's communicator rewrites one message it sends.
Every trainer of every node, node 2's included, gets the same INVALID_ARGUMENT naming node 2, and
nothing is delivered or left behind."""

from __future__ import annotations

import threading

import pytest

from tests.core.test_peer_messages import (
    HOSTILE,
    Rewrite,
    Rewrites,
    as_float16,
    key_past_the_rows,
    only_key,
    truncated,
    with_nan,
)
from tests.daemon.test_node_steps import JOB, Node, grad_of
from zend.core.sparse import SparseGrad
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.protocol.layout import TensorSpec
from zend.transport.inproc import InProcessCluster

pytestmark = pytest.mark.inprocess

NODES, TRAINERS, ROWS, DIM = 3, 2, 100, 4
NODE_SEED = 3  # Node's make_scheme(..., seed=3)


def run_step(scheme: str, phase: str, rewrite: Rewrite, only_to: int | None) -> tuple[list[object], Rewrites, int]:
    cluster = InProcessCluster(NODES)
    comms = [cluster.communicator(r) for r in range(NODES)]
    hostile = Rewrites(comms[HOSTILE], phase, rewrite, only_to)
    nodes = [Node(hostile if r == HOSTILE else comms[r], scheme, timeout_s=10.0) for r in range(NODES)]
    spec = TensorSpec(JOB, "emb", (ROWS, DIM), "float32", "sparse_rows", False)
    sessions = [[n.trainer(t, TRAINERS) for t in range(TRAINERS)] for n in nodes]
    outcomes: list[object] = [None] * (NODES * TRAINERS)

    def trainer(r: int, t: int) -> None:
        try:
            outcomes[r * TRAINERS + t] = nodes[r].submit(sessions[r][t], spec, grad_of(r * TRAINERS + t, 0, ROWS, DIM),
                                                         0)
        except StepError as exc:
            outcomes[r * TRAINERS + t] = exc

    threads = [threading.Thread(target=trainer, args=(r, t)) for r in range(NODES) for t in range(TRAINERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a trainer still waits"
    for n in nodes:
        assert n.trainer_steps.in_flight() == 0
    return outcomes, hostile, cluster.mailbox_messages()


def partial_block_push() -> tuple[Rewrite, int]:
    """A push to a partition whose last-block key decodes past the rows: that key alone."""
    target = next(j for j in range(NODES) if j != HOSTILE and key_past_the_rows(j, DIM, NODE_SEED) is not None)
    key = key_past_the_rows(target, DIM, NODE_SEED)
    assert key is not None
    return only_key(key), target


CASES = {  # name -> (scheme, phase, rewrite, only_to, what the error says)
    "key past the rows": ("zen", "push", *partial_block_push(), "outside partition"),
    "truncated": ("zen", "push", truncated, 0, "header promises"),
    "wrong dtype": ("dense", "reduce_scatter", as_float16, None, "piece of"),
    "nan (hc)": ("hc", "fold", with_nan, None, "non-finite value nan"),
    "nan (sparse_ps)": ("sparse_ps", "push", with_nan, 1, "non-finite value nan"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_peer_message_fails_the_step_for_every_trainer_of_every_node_alike(case: str) -> None:
    scheme, phase, rewrite, only_to, says = CASES[case]
    outcomes, hostile, left = run_step(scheme, phase, rewrite, only_to)
    assert hostile.rewritten > 0
    for got in outcomes:
        assert not isinstance(got, SparseGrad), f"{case}: a trainer got a result"
        assert isinstance(got, StepError) and got.code == codes.INVALID_ARGUMENT, got
        assert f"rank {HOSTILE} sent rank " in got.message and says in got.message, got.message
        assert "step 0 of tensor 'emb'" in got.message, got.message
    messages = {got.message for got in outcomes if isinstance(got, StepError)}
    assert len(messages) == 1, messages  # one receiver saw it: every trainer reads its words
    assert left == 0  # the abort voided every message of the step
