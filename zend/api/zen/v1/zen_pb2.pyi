from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    SPARSE_ROWS: _ClassVar[Layout]
    DENSE: _ClassVar[Layout]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
LAYOUT_UNSPECIFIED: Layout
SPARSE_ROWS: Layout
DENSE: Layout

class BufferRef(_message.Message):
    __slots__ = ("buffer_id", "offset")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    offset: int
    def __init__(self, buffer_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("job_id", "local_rank", "local_world_size", "pid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    local_rank: int
    local_world_size: int
    pid: int
    def __init__(self, job_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., local_world_size: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session_id", "buffer_socket", "node_rank", "node_count", "generation", "daemon_version", "job_step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SOCKET_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    buffer_socket: str
    node_rank: int
    node_count: int
    generation: int
    daemon_version: str
    job_step: int
    def __init__(self, session_id: _Optional[str] = ..., buffer_socket: _Optional[str] = ..., node_rank: _Optional[int] = ..., node_count: _Optional[int] = ..., generation: _Optional[int] = ..., daemon_version: _Optional[str] = ..., job_step: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterTensorRequest(_message.Message):
    __slots__ = ("session_id", "name", "shape", "dtype", "layout", "average")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    layout: Layout
    average: bool
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., layout: _Optional[_Union[Layout, str]] = ..., average: bool = ...) -> None: ...

class RegisterTensorReply(_message.Message):
    __slots__ = ("tensor_id", "scheme", "max_result_bytes", "next_step")
    TENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    MAX_RESULT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    tensor_id: int
    scheme: str
    max_result_bytes: int
    next_step: int
    def __init__(self, tensor_id: _Optional[int] = ..., scheme: _Optional[str] = ..., max_result_bytes: _Optional[int] = ..., next_step: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("session_id", "tensor_id", "step", "input", "nnz", "result")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tensor_id: int
    step: int
    input: BufferRef
    nnz: int
    result: BufferRef
    def __init__(self, session_id: _Optional[str] = ..., tensor_id: _Optional[int] = ..., step: _Optional[int] = ..., input: _Optional[_Union[BufferRef, _Mapping]] = ..., nnz: _Optional[int] = ..., result: _Optional[_Union[BufferRef, _Mapping]] = ...) -> None: ...

class PhaseSeconds(_message.Message):
    __slots__ = ("phase", "seconds")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    seconds: float
    def __init__(self, phase: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("nnz", "scheme", "bytes_sent", "bytes_received", "dense_bytes", "phases", "generation", "node_count")
    NNZ_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DENSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    nnz: int
    scheme: str
    bytes_sent: int
    bytes_received: int
    dense_bytes: int
    phases: _containers.RepeatedCompositeFieldContainer[PhaseSeconds]
    generation: int
    node_count: int
    def __init__(self, nnz: _Optional[int] = ..., scheme: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., dense_bytes: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[PhaseSeconds, _Mapping]]] = ..., generation: _Optional[int] = ..., node_count: _Optional[int] = ...) -> None: ...

class CheckpointObject(_message.Message):
    __slots__ = ("key", "offset", "length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    length: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PutCheckpointRequest(_message.Message):
    __slots__ = ("session_id", "step", "buffer_id", "objects", "rank", "world_size", "coordinator", "done")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    buffer_id: str
    objects: _containers.RepeatedCompositeFieldContainer[CheckpointObject]
    rank: int
    world_size: int
    coordinator: bool
    done: bool
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., buffer_id: _Optional[str] = ..., objects: _Optional[_Iterable[_Union[CheckpointObject, _Mapping]]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., coordinator: bool = ..., done: bool = ...) -> None: ...

class PutCheckpointReply(_message.Message):
    __slots__ = ("job_bytes",)
    JOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_bytes: int
    def __init__(self, job_bytes: _Optional[int] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("step", "state", "bytes", "metadata_length", "reason", "holders")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    METADATA_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    step: int
    state: str
    bytes: int
    metadata_length: int
    reason: str
    holders: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., state: _Optional[str] = ..., bytes: _Optional[int] = ..., metadata_length: _Optional[int] = ..., reason: _Optional[str] = ..., holders: _Optional[_Iterable[int]] = ...) -> None: ...

class ListCheckpointsReply(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class ReadCheckpointRequest(_message.Message):
    __slots__ = ("session_id", "step", "buffer_id", "objects", "locate")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    LOCATE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    buffer_id: str
    objects: _containers.RepeatedCompositeFieldContainer[CheckpointObject]
    locate: bool
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., buffer_id: _Optional[str] = ..., objects: _Optional[_Iterable[_Union[CheckpointObject, _Mapping]]] = ..., locate: bool = ...) -> None: ...

class CheckpointPlace(_message.Message):
    __slots__ = ("key", "segment", "offset", "length", "segment_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    segment: str
    offset: int
    length: int
    segment_bytes: int
    def __init__(self, key: _Optional[str] = ..., segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., segment_bytes: _Optional[int] = ...) -> None: ...

class ReadCheckpointReply(_message.Message):
    __slots__ = ("places",)
    PLACES_FIELD_NUMBER: _ClassVar[int]
    places: _containers.RepeatedCompositeFieldContainer[CheckpointPlace]
    def __init__(self, places: _Optional[_Iterable[_Union[CheckpointPlace, _Mapping]]] = ...) -> None: ...

class ReadyRequest(_message.Message):
    __slots__ = ("session_id", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ReadyReply(_message.Message):
    __slots__ = ("ready", "generation", "node_count", "reason", "job_step")
    READY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    JOB_STEP_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    generation: int
    node_count: int
    reason: str
    job_step: int
    def __init__(self, ready: bool = ..., generation: _Optional[int] = ..., node_count: _Optional[int] = ..., reason: _Optional[str] = ..., job_step: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("rank", "address", "connected", "error")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    connected: bool
    error: str
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., connected: bool = ..., error: _Optional[str] = ...) -> None: ...

class TensorStatus(_message.Message):
    __slots__ = ("job_id", "name", "tensor_id", "shape", "dtype", "layout", "scheme", "last_step", "steps", "last_sync_seconds", "last_nnz_in", "last_nnz_out", "last_bytes_sent", "last_push_imbalance", "last_pull_imbalance")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_NNZ_IN_FIELD_NUMBER: _ClassVar[int]
    LAST_NNZ_OUT_FIELD_NUMBER: _ClassVar[int]
    LAST_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    LAST_PULL_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    tensor_id: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    layout: Layout
    scheme: str
    last_step: int
    steps: int
    last_sync_seconds: float
    last_nnz_in: int
    last_nnz_out: int
    last_bytes_sent: int
    last_push_imbalance: float
    last_pull_imbalance: float
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., tensor_id: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., layout: _Optional[_Union[Layout, str]] = ..., scheme: _Optional[str] = ..., last_step: _Optional[int] = ..., steps: _Optional[int] = ..., last_sync_seconds: _Optional[float] = ..., last_nnz_in: _Optional[int] = ..., last_nnz_out: _Optional[int] = ..., last_bytes_sent: _Optional[int] = ..., last_push_imbalance: _Optional[float] = ..., last_pull_imbalance: _Optional[float] = ...) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "job_id", "local_rank", "pid", "buffer_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_id: str
    local_rank: int
    pid: int
    buffer_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., job_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., buffer_bytes: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node_rank", "node_count", "generation", "cluster_id", "membership", "transport", "ucx_transports", "peers", "sessions", "tensors", "steps_in_flight", "draining", "daemon_version", "buffer_pool_bytes", "last_membership_change", "last_membership_change_unix", "redacted", "session_count", "tensor_count", "data_plane_engine", "state", "state_reason", "checkpoints")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    UCX_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_MEMBERSHIP_CHANGE_FIELD_NUMBER: _ClassVar[int]
    LAST_MEMBERSHIP_CHANGE_UNIX_FIELD_NUMBER: _ClassVar[int]
    REDACTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    node_count: int
    generation: int
    cluster_id: str
    membership: str
    transport: str
    ucx_transports: _containers.RepeatedScalarFieldContainer[str]
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorStatus]
    steps_in_flight: int
    draining: bool
    daemon_version: str
    buffer_pool_bytes: int
    last_membership_change: str
    last_membership_change_unix: float
    redacted: bool
    session_count: int
    tensor_count: int
    data_plane_engine: str
    state: str
    state_reason: str
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointStatus]
    def __init__(self, node_rank: _Optional[int] = ..., node_count: _Optional[int] = ..., generation: _Optional[int] = ..., cluster_id: _Optional[str] = ..., membership: _Optional[str] = ..., transport: _Optional[str] = ..., ucx_transports: _Optional[_Iterable[str]] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[TensorStatus, _Mapping]]] = ..., steps_in_flight: _Optional[int] = ..., draining: bool = ..., daemon_version: _Optional[str] = ..., buffer_pool_bytes: _Optional[int] = ..., last_membership_change: _Optional[str] = ..., last_membership_change_unix: _Optional[float] = ..., redacted: bool = ..., session_count: _Optional[int] = ..., tensor_count: _Optional[int] = ..., data_plane_engine: _Optional[str] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointStatus, _Mapping]]] = ...) -> None: ...

class CheckpointStatus(_message.Message):
    __slots__ = ("job_id", "last_complete_step", "steps", "bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    last_complete_step: int
    steps: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    def __init__(self, job_id: _Optional[str] = ..., last_complete_step: _Optional[int] = ..., steps: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("completed", "abandoned")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    completed: int
    abandoned: int
    def __init__(self, completed: _Optional[int] = ..., abandoned: _Optional[int] = ...) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UndrainReply(_message.Message):
    __slots__ = ("serving", "reason")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    reason: str
    def __init__(self, serving: bool = ..., reason: _Optional[str] = ...) -> None: ...
