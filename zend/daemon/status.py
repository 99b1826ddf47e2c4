"""What `zend status` shows, as one typed snapshot of the node: built by the daemon, sent by the Operator service."""

from __future__ import annotations

from dataclasses import dataclass

from zend.daemon.jobs import TensorStats


@dataclass(frozen=True)
class PeerStatus:
    rank: int
    address: str  # its data-plane URI
    connected: bool
    error: str  # why the link is down ("" while it is up)


@dataclass(frozen=True)
class SessionStatus:
    session_id: str  # the first 8 characters: enough to tell sessions apart, too few to act as one
    job: str
    local_rank: int
    pid: int
    buffer_bytes: int


@dataclass(frozen=True)
class CheckpointStatus:
    job: str
    last_complete_step: int  # -1: none yet
    steps: tuple[int, ...]  # held here, complete or not
    nbytes: int


@dataclass(frozen=True)
class TensorStatus:
    job: str
    name: str
    tensor_id: int
    shape: tuple[int, ...]
    dtype_name: str
    layout: str
    scheme: str  # the scheme its last step ran, or the configured one before its first
    stats: TensorStats  # a copy, taken with the snapshot


@dataclass(frozen=True)
class NodeStatus:
    node_rank: int
    node_count: int
    generation: int
    cluster_id: str
    membership: str  # "static", "rendezvous tcpstore://host:port" or "elastic tcpstore://..."
    transport: str  # "tcp", "ucx", or "none" for a one-node cluster
    ucx_transports: tuple[str, ...]
    steps_in_flight: int
    draining: bool
    daemon_version: str
    buffer_pool_bytes: int
    peers: tuple[PeerStatus, ...]
    sessions: tuple[SessionStatus, ...]
    tensors: tuple[TensorStatus, ...]
    last_membership_change: str = ""  # what made the last generation (elastic membership), "" before any
    last_membership_change_unix: float = 0.0
    data_plane_engine: str = "python"  # what moves tcp:// frames (engine_choice.py)
    state: str = "serving"  # node_state.py: joining, serving, changing, draining, stopping
    state_reason: str = ""  # why not serving ("" when serving)
    checkpoints: tuple[CheckpointStatus, ...] = ()  # in-memory checkpoints, by job
