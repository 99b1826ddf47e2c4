"""The node's state, in one home: where it is (joining, serving, changing generation, stopping), whether an
operator drained it, whether its data plane can accept; and the one reading of "why not serving".

Ready, health, `zend status` and step admission all read `NodeState.why_not_serving` (or `refusal`, its
status for a request); only `NodeStateHolder.apply` changes the state, and it sets health in the same
move, so health never says SERVING while admission refuses, nor the other way round.

| phase    | entered by                 | steps                       | health                                 |
|----------|----------------------------|-----------------------------|----------------------------------------|
| joining  | start                      | UNAVAILABLE (still joining) | NOT_SERVING                            |
| serving  | joined / changed           | admitted (unless drained)   | SERVING (unless drained, listener down)|
| changing | a generation change starts | ABORTED (redo after Ready)  | NOT_SERVING                            |
| stopping | stop                       | UNAVAILABLE                 | NOT_SERVING                            |
Orthogonal to the phase: `drained` (an operator's drain, or SIGTERM's, which is `final`: no undrain),
refusing steps and sessions with UNAVAILABLE; `accept_error` (the data plane's listener is failing).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from zend.daemon import errors as codes
from zend.daemon.errors import StepError


class Phase(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    CHANGING = "changing"
    STOPPING = "stopping"


@dataclass(frozen=True)
class NodeState:
    phase: Phase = Phase.JOINING
    reason: str = "the daemon is still joining its cluster"  # why it is in this phase (changing: the change)
    drained: bool = False
    final: bool = False  # the drain before stopping (SIGTERM): no undrain
    accept_error: str | None = None  # why peers cannot connect to us now

    def why_not_serving(self) -> str | None:
        """None when the node serves; else why not, in words (Ready, health, status)."""
        if self.phase is Phase.STOPPING:
            return "the daemon is stopping"
        if self.drained:
            return "the daemon is draining"
        if self.phase is Phase.CHANGING:
            return f"the membership is changing ({self.reason})"
        if self.phase is Phase.JOINING:
            return self.reason
        return self.accept_error

    @property
    def name(self) -> str:
        """The state in one word (the metric zen_node_state): the phase, or "draining" for a drained node
        that is not stopping."""
        if self.drained and self.phase is not Phase.STOPPING:
            return "draining"
        return self.phase.value

    @property
    def serving(self) -> bool:
        return self.why_not_serving() is None

    def refusal(self, what: str) -> StepError | None:
        """The status a new request for `what` ("steps" or "sessions") gets now, or None if admitted. A listener
        that fails refuses no local request: it only keeps peers out."""
        if self.phase is Phase.STOPPING or self.drained:
            return StepError(codes.UNAVAILABLE, f"the daemon is draining: no new {what}")
        if self.phase is Phase.CHANGING and what == "steps":
            return StepError(codes.ABORTED, f"no new steps while the membership changes ({self.reason}): wait "
                                            "until the daemon is ready (zen.Client.wait_ready) and submit the step "
                                            "again")
        if self.phase is Phase.JOINING:
            return StepError(codes.UNAVAILABLE, f"{self.reason}: no {what} yet")
        return None


# ---------------------------------------------------------------------------------------- the transitions (pure)
Event = Callable[[NodeState], NodeState]


class TransitionRefused(ValueError):
    """An event that the state does not allow (undrain after SIGTERM's drain; anything after stopping)."""


def joined(state: NodeState) -> NodeState:
    return _alive(state, replace(state, phase=Phase.SERVING, reason=""))


def still_joining(reason: str) -> Event:
    """Why the node is still joining, as it learns it (a rendezvous round that failed, and when it tries
    again); nothing changes once it has joined."""
    def event(state: NodeState) -> NodeState:
        return replace(state, reason=reason) if state.phase is Phase.JOINING else state
    return event


def changing(reason: str) -> Event:
    def event(state: NodeState) -> NodeState:
        return _alive(state, replace(state, phase=Phase.CHANGING, reason=reason))
    return event


def changed(state: NodeState) -> NodeState:
    return _alive(state, replace(state, phase=Phase.SERVING, reason=""))


def drain(final: bool = False) -> Event:
    def event(state: NodeState) -> NodeState:
        return replace(state, drained=True, final=state.final or final)
    return event


def undrain(state: NodeState) -> NodeState:
    if state.final or state.phase is Phase.STOPPING:
        raise TransitionRefused("the daemon is stopping (SIGTERM): it cannot be undrained")
    return replace(state, drained=False)


def accept_failed(error: str) -> Event:
    def event(state: NodeState) -> NodeState:
        return replace(state, accept_error=error)
    return event


def accept_recovered(state: NodeState) -> NodeState:
    return replace(state, accept_error=None)


def stopping(state: NodeState) -> NodeState:
    return replace(state, phase=Phase.STOPPING, reason="stopping", drained=True, final=True)


def _alive(state: NodeState, new: NodeState) -> NodeState:
    """A phase change, unless the node is stopping (stopping is for good)."""
    return state if state.phase is Phase.STOPPING else new


# ---------------------------------------------------------------------------------------- the one writer
class NodeStateHolder:
    """Holds the node's state; `apply` is the one way to change it, and it tells health in the same move
    (`set_health(serving)`, called under the holder's lock whenever serving turns on or off)."""

    def __init__(self, set_health: Callable[[bool], None] = lambda serving: None):
        self._state = NodeState()
        self._set_health = set_health
        self._lock = threading.Lock()

    @property
    def state(self) -> NodeState:
        return self._state

    def apply(self, event: Event) -> NodeState:
        """The state after `event` (TransitionRefused leaves it as it was)."""
        with self._lock:
            before, after = self._state, event(self._state)
            self._state = after
            if before.serving != after.serving:
                self._set_health(after.serving)
            return after

    def sync_health(self) -> None:
        """Tell health the current state (once its server is up)."""
        with self._lock:
            self._set_health(self._state.serving)
