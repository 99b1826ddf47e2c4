"""In-memory checkpoints (GEMINI) through torch.distributed.checkpoint: zen's StorageWriter and StorageReader.

    import torch.distributed.checkpoint as dcp
    import zen.checkpoint

    dcp.save(state, storage_writer=zen.checkpoint.MemoryWriter(), checkpoint_id=step,
             planner=zen.checkpoint.NodeLocalSavePlanner())
    dcp.load(state, storage_reader=zen.checkpoint.MemoryReader())   # the newest complete step

or the loop's helper, which saves every k steps and, at start, loads the newest step complete on every
trainer:

    ckpt = zen.checkpoint.Checkpointer(every=10)
    start = ckpt.load_latest(state)          # None: nothing to resume from
    ...
    ckpt.maybe_save(state, step)

A write item's bytes go into one shared buffer of the trainer's session, and the daemon copies them into
its checkpoint memory; the gRPC call carries keys, offsets and lengths only. The daemon replicates the
step to its peers and calls it complete once every trainer of the job wrote and the replicas are
acknowledged; only complete steps are read. Tensors are kept as their raw bytes (dtype and shape in
DCP's storage data); the metadata is read back with torch's weights-only unpickler (DCP's own classes
allowed, nothing else). Non-tensor items (DCP's BYTE_IO) are torch.save'd by DCP's planner and loaded by
it as with any storage.

`NodeLocalSavePlanner` keeps one copy of every replicated tensor on *each node* (DCP's default planner
keeps one in the whole job), so that every node can restore from its own memory; reading an object that
only another node holds is refused with the nodes that hold it (remote reads are not built yet).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import Metadata, StorageReader, StorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zen.client import Client
from zen.errors import ZenError, from_rpc_error
from zend.protocol.checkpoint import METADATA_KEY

ALIGN = 64


class CheckpointError(ZenError):
    """No checkpoint to load, or one that cannot be read here."""


@dataclass(frozen=True)
class ZenStorage:
    """Where a write item's bytes are: the daemon's object `key`; a tensor's dtype and shape beside them."""

    key: str
    length: int
    dtype: str = ""  # "float32" ... for a tensor; "" for bytes
    shape: tuple[int, ...] = ()


_SAFE: list[Any] = [Metadata, MetadataIndex, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
         TensorProperties, StorageMeta, ZenStorage, _MEM_FORMAT_ENCODING, torch.Size]


def encode_metadata(metadata: Metadata) -> bytes:
    out = io.BytesIO()
    torch.save(metadata, out)
    return out.getvalue()


def decode_metadata(data: bytes) -> Metadata:
    """DCP's Metadata, read by torch's weights-only unpickler: DCP's classes and ours, no other code."""
    with torch.serialization.safe_globals(_SAFE):
        metadata = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def object_key(index: MetadataIndex) -> str:
    """A write item's object key: its name and chunk offset (the same on every node that writes it)."""
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(map(str, index.offset))}"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"checkpoint object dtype {name!r} is not a torch dtype")
    return dtype


def _client(client: Client | None) -> Client:
    if client is not None:
        return client
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "zen":
        from zen.distributed import client_of

        return client_of()
    return Client()


def _call(client: Client, what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, client.address) from None


def _rank_and_world(kwargs: dict[str, Any]) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return int(kwargs.get("rank", dist.get_rank())), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _dcp_failures(what: str) -> Iterator[None]:
    """DCP's CheckpointException (a BaseException: `except Exception` in a training loop would not see it) as a
    CheckpointError naming each failed rank and what it raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        ranks = sorted(exc.failures)
        why = "; ".join(f"rank {r}: {type(exc.failures[r][0]).__name__}: {str(exc.failures[r][0])[:300]}"
                        for r in ranks[:4])
        raise CheckpointError(f"{what} failed on {len(ranks)} rank{'s' if len(ranks) > 1 else ''}: {why}") from exc


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class NodeLocalSavePlanner(DefaultSavePlanner):
    """DCP's default planner, except that a replicated item is written once per *node* rather than once
    per job: every node's daemon then holds the whole replicated state (data-parallel weights and
    optimizer state), and a trainer restores from its own node's memory. The metadata is DCP's own."""

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = super()._create_global_plan(all_plans)
        nodes = [p.storage_data.get("zen_node", i) if isinstance(p.storage_data, dict) else i
                 for i, p in enumerate(all_plans)]
        on_node: dict[Any, set[str]] = {}
        for plan, node in zip(global_plan, nodes, strict=True):
            on_node.setdefault(node, set()).update(object_key(item.index) for item in plan.items)
        out = []
        for plan, original, node in zip(global_plan, all_plans, nodes, strict=True):
            extra = [item for item in original.items if object_key(item.index) not in on_node[node]]
            on_node[node].update(object_key(item.index) for item in extra)
            out.append(dataclasses.replace(plan, items=[*plan.items, *extra]))
        self.global_plan = out
        return out, metadata


class _OnTheDaemon:
    """What the writer and the reader share: the step (DCP's `checkpoint_id`) and the client they go through
    (the zen process group's, else one from the environment, made on first use)."""

    def __init__(self, step: int | None, client: Client | None):
        self.step = step
        self._client = client

    @property
    def client(self) -> Client:
        self._client = _client(self._client)
        return self._client

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            _step_of(checkpoint_id)
        except CheckpointError:
            return False
        return True


class MemoryWriter(_OnTheDaemon, StorageWriter):
    """DCP's StorageWriter into the node's zend daemon. The step is DCP's `checkpoint_id` (or `step`)."""

    def __init__(self, step: int | None = None, client: Client | None = None):
        super().__init__(step, client)
        self.is_coordinator = False
        self.rank, self.world_size = 0, 1

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise CheckpointError("MemoryWriter needs the step: dcp.save(..., checkpoint_id=step) or "
                                  "MemoryWriter(step)")
        self.is_coordinator = is_coordinator
        self.rank, self.world_size = _rank_and_world(kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data={"zen_node": self.client.session.node_rank})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.step is not None
        pieces: list[tuple[Any, bytes | torch.Tensor, ZenStorage]] = []
        for item in plan.items:
            data: Any = planner.resolve_data(item)
            key = object_key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                raw = bytes(data.getbuffer())
                pieces.append((item, raw, ZenStorage(key, len(raw))))
            else:
                tensor = data.detach().contiguous().cpu()
                flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
                pieces.append((item, flat, ZenStorage(key, flat.numel(), str(tensor.dtype).removeprefix("torch."),
                                                      tuple(tensor.shape))))
        self._put([(p[2].key, p[1]) for p in pieces], done=not self.is_coordinator)
        return _done([WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info)
                      for item, _, info in pieces])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {}
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
        metadata.storage_data = storage
        self._put([(METADATA_KEY, encode_metadata(metadata))], done=True)

    def _put(self, objects: Sequence[tuple[str, bytes | torch.Tensor]], done: bool) -> None:
        """Every object into the session's staging buffer (kept between saves: its pages stay mapped), one
        PutCheckpoint (the daemon has copied them when it returns)."""
        session = self.client.session
        offsets, total = [], 0
        for _, data in objects:
            offsets.append(total)
            total += -(-len(data) // ALIGN) * ALIGN
        with _STAGING_LOCK:
            buffer = _staging(session, total) if total else None
            refs = []
            for (key, data), offset in zip(objects, offsets, strict=True):
                n = len(data)
                if n:
                    assert buffer is not None
                    source = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, bytes) else data
                    buffer.view(torch.uint8, offset, n).copy_(source)
                refs.append((key, offset, n))
            if buffer is not None:
                buffer.publish()
            _call(self.client, "put", session.put_checkpoint, self.step, buffer.buffer_id if buffer else "", refs,
                  self.rank, self.world_size, self.is_coordinator, done)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step) if self.step is not None else None)


# one staging buffer per session (a restarted daemon's new session gets a new one), reused by every save: a
# fresh buffer would cost its page faults and its unmapping each time (a third of a save's CPU)
_STAGING: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_STAGING_LOCK = threading.Lock()


def _staging(session: Any, nbytes: int) -> Any:
    """(under _STAGING_LOCK) The session's staging buffer, at least `nbytes`, grown by doubling."""
    buffer = _STAGING.get(session)
    if buffer is not None and buffer.nbytes >= nbytes and not buffer.closed:
        return buffer
    if buffer is not None and not buffer.closed:
        session.buffers.free(buffer.buffer_id)
    buffer = session.buffers.alloc(max(nbytes, 2 * buffer.nbytes if buffer is not None else 0, 1 << 20))
    _STAGING[session] = buffer
    return buffer


def _step_of(checkpoint_id: Any) -> int:
    text = str(checkpoint_id)
    if not text.isdigit() or len(text) > 18:
        raise CheckpointError(f"checkpoint_id {checkpoint_id!r} is not a step number (0 <= step < 10^18)")
    return int(text)


class MemoryReader(_OnTheDaemon, StorageReader):
    """DCP's StorageReader from the node's zend daemon: step `step` (DCP's `checkpoint_id`), or the newest
    complete on this node when neither is given (`Checkpointer.load_latest` agrees on one across trainers)."""

    def __init__(self, step: int | None = None, client: Client | None = None):
        super().__init__(step, client)
        self.storage_data: dict[MetadataIndex, ZenStorage] = {}
        self.read_bytes = 0
        self.read_seconds = 0.0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs:  # DCP's per-rank metadata (a fallback of its own): there is one metadata per step here
            raise CheckpointError("zen checkpoints have one metadata per step")
        session = self.client.session
        infos = _call(self.client, "list", session.list_checkpoints)
        if self.step is None:
            complete = [c.step for c in infos if c.state == "complete"]
            if not complete:
                raise CheckpointError(f"job {self.client.job!r} has no complete checkpoint on this node "
                                      f"({_describe(infos)})")
            self.step = max(complete)
        info = next((c for c in infos if c.step == self.step), None)
        if info is None or info.state != "complete":
            raise CheckpointError(f"checkpoint step {self.step} of job {self.client.job!r} is not complete on this "
                                  f"node ({_describe(infos)})")
        data = self._read([(METADATA_KEY, int(info.metadata_length))])[0]
        return decode_metadata(bytes(data.numpy()))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_key: dict[str, ZenStorage] = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if not isinstance(info, ZenStorage):
                raise CheckpointError(f"checkpoint step {self.step}: no zen object for {req.storage_index}")
            by_key.setdefault(info.key, info)
        with self._mapping(sorted(by_key)) as views:
            self._apply(plan, planner, views)
        return _done(None)

    def _apply(self, plan: LoadPlan, planner: LoadPlanner, views: dict[str, torch.Tensor]) -> None:
        """Each read item from the objects' bytes (views of the shared buffer) into the state dict."""
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            data = views[info.key]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(data.numpy())))
                continue
            tensor = data.view(_dtype(info.dtype)).reshape(info.shape) if info.length else torch.empty(
                info.shape, dtype=_dtype(info.dtype))
            source = _narrow(tensor, req)
            target = planner.resolve_tensor(req).detach()
            if target.size() != source.size():
                raise CheckpointError(f"checkpoint step {self.step}: {req.storage_index.fqn} has shape "
                                      f"{tuple(source.size())} here, the state dict wants {tuple(target.size())}")
            target.copy_(source)
            planner.commit_tensor(req, target)

    def _read(self, objects: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
        """The objects' bytes, copies the caller owns."""
        with self._reading(objects) as views:
            return [v.clone() for v in views]

    @contextlib.contextmanager
    def _mapping(self, keys: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        """The objects as read-only views of the daemon's checkpoint segments (mapped while the block lasts:
        the only copy is the caller's, into the state dict); any object in no segment is read by copy."""
        assert self.step is not None
        started = time.perf_counter()
        session = self.client.session
        places = _call(self.client, "locate", session.locate_checkpoint, self.step, list(keys))
        mapped: dict[str, Any] = {}
        views: dict[str, torch.Tensor] = {}
        try:
            for p in places:
                if not p.segment:
                    continue
                if p.segment not in mapped:
                    mapped[p.segment] = session.map_checkpoint_segment(self.step, p.segment)
                views[p.key] = mapped[p.segment].view(torch.uint8, int(p.offset), int(p.length))
            rest = [(p.key, int(p.length)) for p in places if not p.segment]
            with self._reading(rest) as copied:
                views.update(zip((k for k, _ in rest), copied, strict=True))
                yield views
        finally:
            views.clear()
            for segment in mapped.values():
                segment.close()
            self.read_seconds += time.perf_counter() - started
            self.read_bytes += sum(int(p.length) for p in places)

    @contextlib.contextmanager
    def _reading(self, objects: Sequence[tuple[str, int]]) -> Iterator[list[torch.Tensor]]:
        """The objects' bytes copied by the daemon into one shared buffer, as views of it while the block
        lasts (the buffer is freed after it)."""
        session = self.client.session
        offsets, total = [], 0
        for _, n in objects:
            offsets.append(total)
            total += -(-n // ALIGN) * ALIGN
        if not objects:
            yield []
            return
        buffer = session.buffers.alloc(max(total, ALIGN))
        try:
            _call(self.client, "read", session.read_checkpoint, self.step, buffer.buffer_id,
                  [(k, o, n) for (k, n), o in zip(objects, offsets, strict=True)])
            buffer.acquire()
            yield [buffer.view(torch.uint8, o, n) if n else torch.empty(0, dtype=torch.uint8)
                   for (_, n), o in zip(objects, offsets, strict=True)]
        finally:
            session.buffers.free(buffer.buffer_id)


def _narrow(tensor: torch.Tensor, req: ReadItem) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _describe(infos: Sequence[Any]) -> str:
    if not infos:
        return "none held"
    return ", ".join(f"step {c.step}: {c.state}{' (' + c.reason[:120] + ')' if c.reason else ''}" for c in infos[:6])


class Checkpointer:
    """The common loop: `maybe_save(state, step)` every `every` steps (DCP, through the daemon), and
    `load_latest(state)` at start: the newest step complete on *every* trainer of the job (agreed over
    `process_group`, DCP's), loaded into `state`; None when there is none. `asynchronous`: DCP's async_save
    (the state staged to CPU memory in the call, handed to the daemon from a thread) on a gloo group of its
    own, so that its collectives never interleave with the training's; one save in flight at a time."""

    def __init__(self, every: int = 1, client: Client | None = None, process_group: Any = None,
                 asynchronous: bool = False):
        if every < 1:
            raise ValueError(f"every={every}: must be at least 1")
        self.every, self._client, self.process_group = every, client, process_group
        self.asynchronous = asynchronous
        if asynchronous and process_group is None and dist.is_available() and dist.is_initialized():
            self.process_group = dist.new_group(backend="gloo")  # collective: every rank makes its Checkpointer
        self._pending: Any = None
        self._pending_step = -1
        self._stager: Any = None  # DCP's stager, kept: its CPU copy of the state is reused by every save
        self.last_saved: int | None = None

    @property
    def client(self) -> Client:
        self._client = _client(self._client)
        return self._client

    def maybe_save(self, state: dict[str, Any], step: int) -> bool:
        """Checkpoint `state` as step `step` if `step` is a multiple of `every`; whether it did."""
        if step % self.every:
            return False
        self.save(state, step)
        return True

    def save(self, state: dict[str, Any], step: int) -> None:
        """Checkpoint `state` as step `step`. CheckpointError if it failed, or (asynchronous) if the save before
        it failed: this one is under way all the same, so a failed save costs only itself."""
        import torch.distributed.checkpoint as dcp

        writer = MemoryWriter(step, self.client)
        before: CheckpointError | None = None
        if self.asynchronous:
            try:
                self.wait()  # one save in flight at a time: the kept stager's copy is free again
            except CheckpointError as exc:  # every rank alike: all of them go on to this save
                before = exc
            if self._stager is None:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                # async_save's own stager is made per call, and its fresh copy of the whole state faults in
                # new pages every time (10.8 of 12 ms of a 26 MB state here); a kept one copies in place
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                            use_async_staging=False, use_non_blocking_copy=False))
            with _dcp_failures(f"checkpoint step {step}: saving"):
                self._pending = dcp.async_save(state, storage_writer=writer, planner=NodeLocalSavePlanner(),
                                               process_group=self.process_group, async_stager=self._stager)
            self._pending_step = step
        else:
            with _dcp_failures(f"checkpoint step {step}: saving"):
                dcp.save(state, storage_writer=writer, planner=NodeLocalSavePlanner(),
                         process_group=self.process_group)
        self.last_saved = step
        if before is not None:
            raise before

    def wait(self) -> None:
        """Until the asynchronous save in flight (if any) has handed its bytes to the daemon; CheckpointError if
        it failed (on every trainer alike: DCP shares a rank's failure with the others)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with _dcp_failures(f"checkpoint step {self._pending_step}: saving"):
                getattr(pending, "upload_completion", pending).result()  # a Future, or DCP's AsyncSaveResponse

    def complete_steps(self) -> list[int]:
        """Steps complete on this trainer's node, newest first."""
        return self._held()[0]

    def _held(self) -> tuple[list[int], list[str]]:
        """(complete steps newest first, why steps were lost) on this trainer's node."""
        infos = _call(self.client, "list", self.client.session.list_checkpoints)
        complete = sorted((int(c.step) for c in infos if c.state == "complete"), reverse=True)
        return complete, [c.reason for c in infos if c.state == "failed" and " is lost" in c.reason]

    def agreed_step(self) -> int | None:
        """The newest step complete on every trainer's node (the same answer on every trainer); None when
        there is none, CheckpointError when there is none because a step was lost with its nodes."""
        mine: Any
        try:
            mine = self._held()
        except Exception as exc:  # said to every trainer: one that raised alone would leave the rest in the gather
            mine = f"{type(exc).__name__}: {exc}"
        if dist.is_available() and dist.is_initialized():
            everyone: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(everyone, mine, group=self.process_group)
        else:
            everyone = [mine]
        failed = [f"rank {rank}: {e}" for rank, e in enumerate(everyone) if isinstance(e, str)]
        if failed:
            raise CheckpointError("could not list the checkpoints held: " + "; ".join(failed))
        common = set(everyone[0][0]).intersection(*(set(e[0]) for e in everyone[1:]))
        if common:
            return max(common)
        lost = sorted({why for _, reasons in everyone for why in reasons})
        if lost:
            raise CheckpointError("; ".join(lost))
        return None

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the agreed newest complete step into `state`; its step, or None if there is none."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        step = self.agreed_step()
        if step is None:
            return None
        with _dcp_failures(f"checkpoint step {step}: loading"):
            dcp.load(state, storage_reader=MemoryReader(step, self.client), process_group=self.process_group)
        return step
