"""The node's state machine (zend/daemon/node_state.py): its invariants over any sequence of events, and
each invariant's check shown to catch a bug planted in the machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zend.daemon import errors as codes
from zend.daemon import node_state as ns

pytestmark = pytest.mark.inprocess

EVENTS: dict[str, Callable[[], ns.Event]] = {
    "joined": lambda: ns.joined, "changing": lambda: ns.changing("a node waits to join"),
    "changed": lambda: ns.changed, "drain": lambda: ns.drain(), "final drain": lambda: ns.drain(final=True),
    "undrain": lambda: ns.undrain, "accept failed": lambda: ns.accept_failed("EMFILE"),
    "accept recovered": lambda: ns.accept_recovered, "stopping": lambda: ns.stopping,
}


def violations(events: list[str]) -> list[str]:
    """Apply `events` in order to a fresh holder; every broken invariant, named with the step it broke at."""
    told: list[bool] = []
    holder = ns.NodeStateHolder(told.append)
    found: list[str] = []
    for i, name in enumerate(events):
        before = holder.state
        try:
            after = holder.apply(EVENTS[name]())
        except ns.TransitionRefused:
            after = holder.state
            if after != before:
                found.append(f"{i} {name}: a refused event changed the state")
            if not (before.final or before.phase is ns.Phase.STOPPING):
                found.append(f"{i} {name}: refused although no final drain or stop came before")
            continue
        where = f"{i} {name}"
        serving = (after.phase is ns.Phase.SERVING and not after.drained and after.accept_error is None)
        if after.serving != serving:
            found.append(f"{where}: serving={after.serving} for {after}")
        if (after.why_not_serving() is None) != serving:
            found.append(f"{where}: why_not_serving {after.why_not_serving()!r} for {after}")
        if before.serving != after.serving and told[-1:] != [after.serving]:
            found.append(f"{where}: health not told serving={after.serving}")
        admitted = after.phase is ns.Phase.SERVING and not after.drained
        refused = after.refusal("steps")
        if (refused is None) != admitted:
            found.append(f"{where}: steps {'admitted' if refused is None else 'refused'} in {after}")
        changing = after.phase is ns.Phase.CHANGING and not after.drained
        if changing and (refused is None or refused.code != codes.ABORTED):
            found.append(f"{where}: a step while the membership changes must be ABORTED (redo after Ready)")
        if before.phase is ns.Phase.STOPPING and after.phase is not ns.Phase.STOPPING:
            found.append(f"{where}: left stopping")
        if before.final and not after.final:
            found.append(f"{where}: a final drain was undone")
    return found


@given(st.lists(st.sampled_from(sorted(EVENTS)), max_size=30))
def test_every_sequence_of_events_keeps_the_invariants(events: list[str]) -> None:
    assert violations(events) == []


def test_the_table_of_the_module_docstring() -> None:
    holder = ns.NodeStateHolder()
    assert holder.state.phase is ns.Phase.JOINING and holder.state.refusal("steps").code == codes.UNAVAILABLE
    assert holder.apply(ns.joined).serving
    changing = holder.apply(ns.changing("node 2 waits"))
    assert changing.refusal("steps").code == codes.ABORTED and changing.refusal("sessions") is None
    assert changing.why_not_serving() == "the membership is changing (node 2 waits)"
    drained = holder.apply(ns.changed) and holder.apply(ns.drain())
    assert drained.refusal("sessions").code == codes.UNAVAILABLE
    assert drained.why_not_serving() == "the daemon is draining"
    assert holder.apply(ns.undrain).serving
    listener_down = holder.apply(ns.accept_failed("EMFILE"))
    assert listener_down.why_not_serving() == "EMFILE" and listener_down.refusal("steps") is None
    holder.apply(ns.drain(final=True))
    with pytest.raises(ns.TransitionRefused, match="cannot be undrained"):
        holder.apply(ns.undrain)


# ---------------------------------------------------------------------------------------- planted bugs
@contextmanager
def planted(name: str) -> Iterator[None]:
    """The machine with one bug in it, for as long as the block runs."""
    mp = pytest.MonkeyPatch()
    try:
        BUGS[name](mp)
        yield
    finally:
        mp.undo()


def _serving_ignores_drain(mp: pytest.MonkeyPatch) -> None:
    original = ns.NodeState.why_not_serving
    mp.setattr(ns.NodeState, "why_not_serving",
               lambda self: original(dataclasses.replace(self, drained=False)))


def _steps_while_changing(mp: pytest.MonkeyPatch) -> None:
    original = ns.NodeState.refusal
    mp.setattr(ns.NodeState, "refusal", lambda self, what: None if self.phase is ns.Phase.CHANGING
               else original(self, what))


def _health_never_told(mp: pytest.MonkeyPatch) -> None:
    def apply(self: Any, event: ns.Event) -> ns.NodeState:
        self._state = event(self._state)
        return self._state
    mp.setattr(ns.NodeStateHolder, "apply", apply)


def _undrain_after_sigterm(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(ns, "undrain", lambda state: dataclasses.replace(state, drained=False, final=False))
    EVENTS["undrain"] = lambda: ns.undrain


def _joined_after_stop(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(ns, "joined", lambda state: dataclasses.replace(state, phase=ns.Phase.SERVING, reason=""))
    EVENTS["joined"] = lambda: ns.joined


BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "serving ignores a drain": _serving_ignores_drain,
    "steps admitted while the membership changes": _steps_while_changing,
    "health never told": _health_never_told,
    "undrain after SIGTERM": _undrain_after_sigterm,
    "joined after stopping": _joined_after_stop,
}
CATCHES = {  # a sequence of events that shows each bug
    "serving ignores a drain": ["joined", "drain"],
    "steps admitted while the membership changes": ["joined", "changing"],
    "health never told": ["joined"],
    "undrain after SIGTERM": ["joined", "final drain", "undrain"],
    "joined after stopping": ["joined", "stopping", "joined"],
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_invariant_catches_its_planted_bug(bug: str) -> None:
    saved = dict(EVENTS)
    try:
        assert violations(CATCHES[bug]) == []  # the real machine
        with planted(bug):
            assert violations(CATCHES[bug]), f"the invariants did not catch: {bug}"
    finally:
        EVENTS.clear()
        EVENTS.update(saved)
