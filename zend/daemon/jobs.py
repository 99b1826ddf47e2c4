"""Jobs, their trainer sessions and their registered tensors, and who may touch what.

A job's token is HMAC(cluster secret, job id): every daemon of the cluster can check it
without shared state, and the operator hands it to the job's trainers (`zend token`). A
trainer can only open sessions in the job its token names, and only reach that job's tensors.
The operator token (`zend token --operator`: Status in full, Drain, Undrain) is an HMAC of the
same secret under another label, so it is never any job's token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zend.daemon.errors import (
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    StepError,
)

if TYPE_CHECKING:
    from zend.daemon.node_steps import StepOutcome
    from zend.protocol.layout import TensorSpec  # imports torch, which `zend token` (job_token) need not load

MAX_JOB_ID = 128


def job_token(secret: bytes, job: str) -> str:
    return hmac.new(secret, b"zen-job-token\0" + job.encode(), hashlib.sha256).hexdigest()


def bearer_of(authorization: object) -> str | None:
    """The token of an `authorization: Bearer <token>` value (gRPC metadata, an HTTP header); None for
    anything else."""
    if isinstance(authorization, str) and authorization.startswith("Bearer "):
        return authorization[len("Bearer "):]
    return None


def operator_token(secret: bytes) -> str:
    """What the Operator service asks for; its own label, so no job id gives it (job tokens hash
    "zen-job-token\\0" + job)."""
    return hmac.new(secret, b"zen-operator-token\0", hashlib.sha256).hexdigest()


def tensor_id(job: str, name: str) -> int:
    """The same on every node whatever the order of registration (tags on the wire use it)."""
    return int.from_bytes(hashlib.blake2b(f"{job}\0{name}".encode(), digest_size=4).digest(), "little")


def job_key(job: str) -> str:
    return hashlib.blake2b(job.encode(), digest_size=6).hexdigest()


@dataclass
class Session:
    session_id: str
    job: str
    local_rank: int
    local_world_size: int
    pid: int
    claimed: bool = False  # its buffer connection is up
    opened_at: float = field(default_factory=time.monotonic)


@dataclass
class TensorStats:
    """What this node's last completed step of a tensor did (for `zend status`)."""

    scheme: str = ""  # the scheme that ran ("" before the first step)
    steps: int = 0
    last_step: int = 0
    last_sync_seconds: float = 0.0
    last_nnz_in: int = 0
    last_nnz_out: int = 0
    last_bytes_sent: int = 0
    last_push_imbalance: float = 0.0
    last_pull_imbalance: float = 0.0

    def record(self, step: int, outcome: StepOutcome) -> None:
        self.scheme, self.steps, self.last_step, self.last_sync_seconds = (outcome.scheme, self.steps + 1, step,
                                                                           outcome.seconds)
        self.last_nnz_in, self.last_nnz_out, self.last_bytes_sent = (outcome.nnz_in, outcome.grad.nnz,
                                                                     outcome.bytes_sent)
        self.last_push_imbalance, self.last_pull_imbalance = outcome.push_load_imbalance, outcome.pull_imbalance


@dataclass
class TensorState:
    spec: TensorSpec
    tensor_id: int
    local_world_size: int
    scheme: Any  # the scheme object (auto keeps state across steps)
    agreed: bool = False  # the nodes have checked they describe it alike
    stats: TensorStats = field(default_factory=TensorStats)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one sync of a tensor at a time, in step order


MAX_LOCAL_WORLD_SIZE = 1024  # trainers of one job on one node: far above any machine's GPUs or cores


class JobRegistry:
    def __init__(self, secret: bytes, max_tensors_per_job: int = 4096, max_tensor_bytes: int = 16 << 30,
                 max_sessions_per_job: int = MAX_LOCAL_WORLD_SIZE):
        self._secret = secret
        self.max_tensors_per_job, self.max_tensor_bytes = max_tensors_per_job, max_tensor_bytes
        self.max_sessions_per_job = max_sessions_per_job
        self._lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.tensors: dict[tuple[str, int], TensorState] = {}
        self._by_job_key: dict[tuple[str, int], TensorState] = {}  # (job_key, tensor id): how tags name them
        # told (job_key, tensor id, last step) at every registration and completed step: a native engine
        # judges frames from its own copy of last_step (no Python call per frame)
        self._last_step_watcher: Callable[[str, int, int], None] | None = None

    def check_token(self, job: str, token: str) -> None:
        if not job or len(job) > MAX_JOB_ID or not job.isprintable():
            raise StepError(INVALID_ARGUMENT, f"job_id {job[:40]!r} must be 1 to {MAX_JOB_ID} printable characters")
        if not hmac.compare_digest(job_token(self._secret, job), token):
            raise StepError(UNAUTHENTICATED, f"the token given is not job {job!r}'s token")

    def open_session(self, job: str, local_rank: int, local_world_size: int, pid: int) -> Session:
        if not 1 <= local_world_size <= MAX_LOCAL_WORLD_SIZE:
            raise StepError(INVALID_ARGUMENT, f"local_world_size {local_world_size} outside "
                                              f"[1, {MAX_LOCAL_WORLD_SIZE}]")
        if not 0 <= local_rank < local_world_size:
            raise StepError(INVALID_ARGUMENT, f"local_rank {local_rank} outside local_world_size {local_world_size}")
        # a job's sessions hold distinct local ranks below its local_world_size: bounding it bounds them
        if local_world_size > self.max_sessions_per_job:
            raise StepError(RESOURCE_EXHAUSTED, f"job {job!r} asks for local_world_size {local_world_size} trainers "
                                                f"on this node, over its quota of {self.max_sessions_per_job} "
                                                "sessions (max_sessions_per_job)")
        with self._lock:
            for s in list(self.sessions.values()):
                if s.job != job:
                    continue
                if s.local_world_size != local_world_size:
                    raise StepError(FAILED_PRECONDITION, f"job {job!r} runs {s.local_world_size} trainers on this node,"
                                                         f" not {local_world_size}")
                if s.local_rank == local_rank and not s.claimed and s.pid == pid:
                    # the same trainer asks again before it claimed the first: that reply never reached it
                    # (its deadline passed as the answer went out), so the first session is nobody's
                    del self.sessions[s.session_id]
                elif s.local_rank == local_rank:
                    raise StepError(FAILED_PRECONDITION, f"local rank {local_rank} of job {job!r} is already taken "
                                                         f"by pid {s.pid}")
            session = Session(secrets.token_hex(16), job, local_rank, local_world_size, pid)
            self.sessions[session.session_id] = session
            return session

    def session(self, session_id: str) -> Session:
        """An open session (its caller then checks the token against the session's job)."""
        s = self.sessions.get(session_id)
        if s is None:
            from zend.protocol.step import SESSION_UNKNOWN  # here: `zend token` imports this module, not protobuf

            raise StepError(NOT_FOUND, f"session {session_id[:12]!r} {SESSION_UNKNOWN}")
        return s

    def session_list(self) -> list[Session]:
        with self._lock:
            return list(self.sessions.values())

    def connected_trainers(self) -> int:
        """Sessions whose trainer holds its buffer connection."""
        with self._lock:
            return sum(1 for s in self.sessions.values() if s.claimed)

    def tensor_list(self) -> list[TensorState]:
        with self._lock:
            return list(self.tensors.values())

    def job_steps(self) -> dict[str, int]:
        """job -> the step it is at here: the lowest next step over its tensors that ran (a job whose
        step was aborted half-way is at that step: every trainer redoes all of it)."""
        steps: dict[str, int] = {}
        for state in self.tensor_list():
            if state.stats.steps:
                job, next_step = state.spec.job, state.stats.last_step + 1
                steps[job] = min(steps.get(job, next_step), next_step)
        return steps

    def new_generation(self, new_scheme: Callable[[], Any]) -> None:
        """Every tensor as if first registered: the nodes of a new generation agree on it again, and a
        fresh scheme (auto's plan) on every node, since a node that joined has nothing else."""
        for state in self.tensor_list():
            with state.lock:  # after the tensor's step in flight, if any
                state.agreed = False
                state.scheme = new_scheme()

    def close_session(self, session_id: str) -> Session | None:
        with self._lock:
            return self.sessions.pop(session_id, None)

    def claim(self, session_id: str, token: str) -> Session | None:
        """Mark a session's buffer connection up; None if it is unknown or already claimed.

        `token` must be the session's job token: the id alone (which another job's process may have
        learnt) claims nothing. A wrong one raises UNAUTHENTICATED and leaves the session unclaimed,
        so that its own trainer can still claim it.
        """
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:
                return None
            if not hmac.compare_digest(job_token(self._secret, s.job).encode(), token.encode()):
                raise StepError(UNAUTHENTICATED, "the token given is not the token of the session's job")
            if s.claimed:
                return None
            s.claimed = True
            return s

    def expire_unclaimed(self, older_than_s: float) -> list[Session]:
        """Drop sessions whose trainer never connected its buffer socket: each holds a local rank."""
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            gone = [s for s in self.sessions.values() if not s.claimed and s.opened_at < cutoff]
            for s in gone:
                del self.sessions[s.session_id]
        return gone

    def register(self, session: Session, spec: TensorSpec, make_scheme: Any) -> TensorState:
        tid = tensor_id(spec.job, spec.name)
        if spec.max_bytes > self.max_tensor_bytes:  # its result buffer could never be allocated
            raise StepError(INVALID_ARGUMENT, f"tensor {spec.name!r} of shape {list(spec.shape)} {spec.dtype_name} "
                                              f"needs {spec.max_bytes} bytes of result buffer, over this daemon's "
                                              f"max_session_bytes {self.max_tensor_bytes}")
        with self._lock:
            state = self.tensors.get((spec.job, tid))
            if state is None:
                count = sum(1 for job, _ in self.tensors if job == spec.job)
                if count >= self.max_tensors_per_job:
                    raise StepError(RESOURCE_EXHAUSTED, f"job {spec.job!r} has registered {count} tensors on this "
                                                        f"node, its limit (max_tensors_per_job); tensor {spec.name!r} "
                                                        "is refused (fuse small tensors: Client.allreduce_many)")
                state = TensorState(spec, tid, session.local_world_size, make_scheme())
                self.tensors[(spec.job, tid)] = state
                self._by_job_key[(job_key(spec.job), tid)] = state
                if self._last_step_watcher is not None:
                    self._last_step_watcher(job_key(spec.job), tid, -1)
                return state
        if state.spec.name != spec.name:
            raise StepError(FAILED_PRECONDITION, f"tensor {spec.name!r} collides with {state.spec.name!r} "
                                                 f"(id {tid}); rename one")
        if state.spec != spec:
            raise StepError(INVALID_ARGUMENT, f"tensor {spec.name!r} of job {spec.job!r} is already registered as "
                                              f"{state.spec.describe()}, not {spec.describe()}")
        return state

    def watch_last_steps(self, watcher: Callable[[str, int, int], None] | None) -> None:
        """Tell `watcher` every tensor's last step now, and each registration and completed step from now on
        (None: stop telling). One watcher: the data plane of the current generation."""
        with self._lock:
            self._last_step_watcher = watcher
            if watcher is not None:
                for (key, tid), state in self._by_job_key.items():
                    watcher(key, tid, state.stats.last_step if state.stats.steps else -1)

    def step_completed(self, state: TensorState, step: int, outcome: Any) -> None:
        """Record a completed step of `state` (its stats) and tell the watcher."""
        state.stats.record(step, outcome)
        watcher = self._last_step_watcher
        if watcher is not None:
            watcher(job_key(state.spec.job), state.tensor_id, step)

    def last_step(self, key: str, tid: int) -> int | None:
        """The last step this node completed of tensor `tid` of the job whose job_key is `key` (-1: none
        yet); None if no trainer here registered it. Asked for every data frame (admission.py): one
        dict read, no lock (a registration racing with it reads as not registered yet)."""
        state = self._by_job_key.get((key, tid))
        if state is None:
            return None
        return state.stats.last_step if state.stats.steps else -1

    def tensor(self, job: str, tid: int) -> TensorState:
        state = self.tensors.get((job, tid))
        if state is None:
            raise StepError(NOT_FOUND, f"tensor id {tid} is not registered in job {job!r}")
        return state


def where_the_job_is(agreed: int, reached: Iterable[tuple[int, int]]) -> int:
    """The step a job is at: `agreed` (its generation's), or the lowest over its tensors of the highest step
    each is known to have reached (`reached`: (tensor id, step) pairs), whichever is higher. The lowest: a
    job whose step was aborted half-way is at that step, and one tensor ahead of another is no reason to
    tell a trainer it is behind."""
    known: dict[int, int] = {}
    for tid, step in reached:
        known[tid] = max(known.get(tid, step), step)
    return max(agreed, min(known.values(), default=0))
