"""The daemon's pure parts: step bookkeeping, tensor layout, jobs and tokens, settings."""

from __future__ import annotations

import threading

import pytest
import torch

from zend.core.sparse import SparseGrad, SparseGradError
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.daemon.jobs import JobRegistry, job_token, tensor_id
from zend.daemon.node_steps import local_sum
from zend.daemon.settings import SettingsError, resolve
from zend.daemon.steps import StepKey, StepTable
from zend.protocol.layout import TensorSpec, align

pytestmark = pytest.mark.inprocess


def test_step_starts_when_every_local_trainer_has_submitted_and_repeats_join_it():
    table = StepTable()
    key = StepKey("job", 1, 5)
    step, start = table.join(key, 0, "s0", "part0", expected=2)
    assert not start and step.missing() == [1]
    again, start = table.join(key, 0, "s0", "part0-again", expected=2)
    assert again is step and not start and step.parts[0] == "part0"  # idempotent
    _, start = table.join(key, 1, "s1", "part1", expected=2)
    assert start and step.started
    table.finish(step, result="sum")
    late, start = table.join(key, 1, "s1", "whatever", expected=2)
    assert late is step and not start and late.result == "sum" and late.done.is_set()


def test_past_and_out_of_order_steps_are_refused_with_the_step_numbers():
    table = StepTable()
    step, _ = table.join(StepKey("j", 1, 7), 0, "s", "p", expected=1)
    table.finish(step, result="r")
    with pytest.raises(StepError, match=r"step 3 .* step 7 has already") as err:
        table.join(StepKey("j", 1, 3), 0, "s", "p", expected=1)
    assert err.value.code == codes.FAILED_PRECONDITION
    table.join(StepKey("j", 1, 9), 0, "s", "p", expected=2)
    with pytest.raises(StepError, match=r"step 8 .* after step 9") as err:  # the same trainer going back
        table.join(StepKey("j", 1, 8), 0, "s", "p", expected=2)
    assert err.value.code == codes.FAILED_PRECONDITION
    # another trainer of the node, behind the one at step 9 (restarted: it lost step 8's result)
    with pytest.raises(StepError, match=r"local rank\(s\) \[0\] of this node are at step 9 .* the job is at step 9"
                       ) as err:
        table.join(StepKey("j", 1, 8), 1, "s2", "p", expected=2)
    assert err.value.code == codes.ABORTED and err.value.job_step == 9


def test_a_departed_trainer_fails_the_unstarted_steps_of_its_job_only():
    table = StepTable()
    waiting, _ = table.join(StepKey("j", 1, 1), 0, "alive", "p", expected=2)  # waits for local rank 1
    other, _ = table.join(StepKey("k", 2, 1), 0, "alive", "p", expected=2)
    failed = table.abandon("j", lambda s: StepError(codes.ABORTED, "trainer gone"))
    assert failed == [waiting] and waiting.error is not None and waiting.error.code == codes.ABORTED
    assert not other.done.is_set() and table.in_flight() == 1
    # a failure before the start is not final: the step can be submitted again
    retry, _ = table.join(StepKey("j", 1, 1), 1, "alive", "p", expected=2)
    assert retry is not waiting and (waiting.attempt, retry.attempt) == (0, 1)  # its messages are tagged apart


def test_a_failed_step_is_a_new_attempt_and_a_success_forgets_the_count():
    table = StepTable()
    key = StepKey("j", 1, 5)
    for attempt in range(3):
        step, start = table.join(key, 0, "s", "p", expected=1)
        assert start and step.attempt == attempt
        table.finish(step, error=StepError(codes.ABORTED, "node 2 lost"))
    step, _ = table.join(key, 0, "s", "p", expected=1)
    table.finish(step, result="sum")
    again, start = table.join(key, 0, "s", "p", expected=1)
    assert again is step and not start and again.result == "sum"  # a repeat after success: the same answer
    assert table.entries() == 1  # the attempt count is gone, the last result kept


def test_a_step_a_peer_aborted_before_it_opened_here_opens_at_the_next_attempt():
    """Node 1's trainer died before step 5; node 0 aborted its attempts 0 and 1 (its trainers left), and told
    node 1, which never had it open: node 1 opens it at attempt 2, the attempt node 0 redoes it as."""
    voided = {(StepKey("j", 1, 5), 0), (StepKey("j", 1, 5), 1)}
    table = StepTable(aborted=lambda key, attempt: (key, attempt) in voided)
    step, start = table.join(StepKey("j", 1, 5), 0, "s", "p", expected=1)
    assert start and step.attempt == 2
    table.finish(step, error=StepError(codes.ABORTED, "node 0 lost"))
    step, _ = table.join(StepKey("j", 1, 5), 0, "s", "p", expected=1)
    assert step.attempt == 3  # a failure here counts on from there
    other, _ = table.join(StepKey("j", 2, 5), 0, "s", "p", expected=1)
    assert other.attempt == 0  # another tensor's step 5 was not aborted


def test_steps_expire_when_a_trainer_never_comes():
    table = StepTable()
    step, _ = table.join(StepKey("j", 1, 1), 0, "s", "p", expected=2)
    assert table.expire(10.0, lambda s: StepError(codes.DEADLINE_EXCEEDED, "late")) == []
    expired = table.expire(0.0, lambda s: StepError(codes.DEADLINE_EXCEEDED, f"missing {s.missing()}"))
    assert expired == [step] and step.error is not None and "missing [1]" in step.error.message


def test_waiters_of_one_step_all_see_its_end():
    table = StepTable()
    key = StepKey("j", 1, 1)
    seen = []
    step, _ = table.join(key, 0, "a", "p", expected=2)
    t = threading.Thread(target=lambda: seen.append(step.done.wait(5) and step.result))
    t.start()
    table.join(key, 1, "b", "p", expected=2)
    table.finish(step, result="done")
    t.join(5)
    assert seen == ["done"]


def _buffer(nbytes: int) -> tuple[torch.Tensor, object]:
    raw = torch.zeros(nbytes, dtype=torch.uint8)

    def view(dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        size = torch.empty(0, dtype=dtype).element_size()
        return raw[offset: offset + count * size].view(dtype)
    return raw, view


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sparse_rows_layout_round_trips_through_a_buffer(dtype):
    spec = TensorSpec("j", "emb", (100, 3, 2), dtype, "sparse_rows", False)
    grad = SparseGrad(torch.tensor([7, 2, 99]), torch.randn(3, 3, 2).to(spec.dtype), 100, "emb")
    assert spec.nbytes(3) == align(24) + 3 * 6 * spec.itemsize
    _, view = _buffer(spec.nbytes(3) + 64)
    spec.write(grad, view, 64)
    back = spec.read(view, 64, 3)
    assert torch.equal(back.indices, grad.indices) and torch.equal(back.values, grad.values)


def test_dense_layout_round_trips_and_writes_zeros_where_the_result_has_no_row():
    spec = TensorSpec("j", "w", (4, 2), "float32", "dense", True)
    _, view = _buffer(spec.max_bytes)
    spec.write(SparseGrad(torch.tensor([1, 3]), torch.ones(2, 2), 4, "w"), view, 0)
    assert torch.equal(spec.read(view, 0, 0).values, torch.tensor([[0.0, 0], [1, 1], [0, 0], [1, 1]]))


def test_reading_a_bad_gradient_names_the_value():
    spec = TensorSpec("j", "emb", (10, 2), "float32", "sparse_rows", False)
    _, view = _buffer(spec.nbytes(1))
    view(torch.int64, 0, 1).fill_(10)
    with pytest.raises(SparseGradError, match="index 10 out of range for 10 rows"):
        spec.read(view, 0, 1)
    view(torch.int64, 0, 1).fill_(3)
    view(torch.float32, align(8), 2).fill_(float("nan"))
    with pytest.raises(SparseGradError, match="non-finite value nan in row 3"):
        spec.read(view, 0, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype_name": "int8"}, "dtype 'int8'"),
    ({"layout": "csr"}, "layout 'csr'"),
    ({"shape": (0, 4)}, r"shape \[0, 4\]"),
    ({"name": ""}, "tensor name"),
])
def test_tensor_spec_errors_name_the_value(kwargs, message):
    base = {"job": "j", "name": "t", "shape": (4, 4), "dtype_name": "float32", "layout": "dense", "average": False}
    with pytest.raises(SparseGradError, match=message):
        TensorSpec(**{**base, **kwargs})


def test_local_sum_adds_the_trainers_parts_in_float32():
    spec = TensorSpec("j", "emb", (10, 2), "float16", "sparse_rows", False)
    a = SparseGrad(torch.tensor([1, 5]), torch.ones(2, 2, dtype=torch.float16), 10)
    b = SparseGrad(torch.tensor([5, 9, 5]), torch.ones(3, 2, dtype=torch.float16), 10)
    total = local_sum(spec, [a, b])
    assert total.coalesced and total.indices.tolist() == [1, 5, 9]
    assert total.values[:, 0].tolist() == [1.0, 3.0, 1.0]


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on another device, and, like torch on two GPUs, refuses to mix
    with a tensor on a third: a stand-in for the parts of one trainer per GPU, on a machine without any."""

    fake: torch.device

    @staticmethod
    def of(data: torch.Tensor, device: str) -> OnDevice:
        t = data.as_subclass(OnDevice)
        t.fake = torch.device(device)
        return t

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return self.fake

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        found: list[torch.device] = []

        def plain(x):  # type: ignore[no-untyped-def]
            if isinstance(x, OnDevice):
                found.append(x.fake)
                return x.as_subclass(torch.Tensor)
            if isinstance(x, list | tuple):
                return type(x)(plain(v) for v in x)
            return x

        args, kwargs = plain(args), {k: plain(v) for k, v in kwargs.items()}
        target = found[0] if found else torch.device("cpu")
        if func is torch.Tensor.to:  # a move: the device asked for, if any
            for a in (*args[1:], *kwargs.values()):
                if isinstance(a, torch.device | str):
                    target = torch.device(a)
            args = (args[0], *(a for a in args[1:] if not isinstance(a, torch.device | str)))
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        elif len(set(found)) > 1:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{found[0]} and {next(d for d in found if d != found[0])}!")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)

        def tagged(x):  # type: ignore[no-untyped-def]
            if isinstance(x, torch.Tensor):
                return OnDevice.of(x, str(target))
            return type(x)(tagged(v) for v in x) if isinstance(x, tuple) and not hasattr(x, "_fields") else x
        return tagged(out)


@pytest.mark.parametrize("dense", [False, True])
def test_local_sum_of_trainers_on_different_gpus_lands_on_the_first_ones(dense):
    """One trainer per GPU: each part lies on its trainer's device; concatenating them as they are fails."""
    layout = "dense" if dense else "sparse_rows"
    spec = TensorSpec("j", "emb", (4, 2), "float32", layout, False)
    rows = [torch.arange(4), torch.arange(4)] if dense else [torch.tensor([1, 3]), torch.tensor([3, 0])]
    parts = [SparseGrad(OnDevice.of(r, f"cuda:{i}"), OnDevice.of(torch.full((len(r), 2), float(i + 1)), f"cuda:{i}"),
                        4, "emb", dense) for i, r in enumerate(rows)]
    total = local_sum(spec, parts)
    assert total.values.device == torch.device("cuda:0") and total.indices.device == torch.device("cuda:0")
    dense_sum = torch.zeros(4, 2)
    for p in parts:
        dense_sum.index_add_(0, p.indices.as_subclass(torch.Tensor), p.values.as_subclass(torch.Tensor))
    assert torch.equal(total.to_dense().as_subclass(torch.Tensor), dense_sum)
    with pytest.raises(RuntimeError, match="same device"):  # the fake refuses what two GPUs refuse
        torch.cat([parts[0].values, parts[1].values])


def test_job_tokens_sessions_and_tensor_ids():
    secret = b"s" * 32
    reg = JobRegistry(secret)
    reg.check_token("a", job_token(secret, "a"))
    with pytest.raises(StepError, match="not job 'b'") as err:
        reg.check_token("b", job_token(secret, "a"))
    assert err.value.code == codes.UNAUTHENTICATED
    s0 = reg.open_session("a", 0, 2, pid=11)
    with pytest.raises(StepError, match="local rank 0 of job 'a' is already taken by pid 11"):
        reg.open_session("a", 0, 2, pid=12)
    with pytest.raises(StepError, match="runs 2 trainers on this node, not 3"):
        reg.open_session("a", 1, 3, pid=12)
    assert reg.session(s0.session_id) is s0
    with pytest.raises(StepError, match="is not open on this daemon") as err:
        reg.session("no-such-session")
    assert err.value.code == codes.NOT_FOUND
    spec = TensorSpec("a", "emb", (10, 2), "float32", "sparse_rows", False)
    state = reg.register(s0, spec, lambda: "scheme")
    assert state.tensor_id == tensor_id("a", "emb") != tensor_id("b", "emb")
    with pytest.raises(StepError, match="already registered"):
        reg.register(s0, TensorSpec("a", "emb", (10, 3), "float32", "sparse_rows", False), lambda: "scheme")


def test_settings_come_from_flags_then_environment_then_file(tmp_path):
    config = tmp_path / "zend.toml"
    config.write_text('scheme = "zen"\nhash_seed = 3\nmetrics_port = 9500\n')
    s = resolve({"hash_seed": 5}, env={"ZEND_METRICS_PORT": "9600"}, config_file=str(config))
    assert (s.scheme, s.hash_seed, s.metrics_port) == ("zen", 5, 9600)
    assert s.sources["hash_seed"] == "flag" and s.sources["metrics_port"] == "$ZEND_METRICS_PORT"


def test_metrics_bind_this_host_and_trainers_stay_off_tcp_by_default():
    s = resolve({}, env={})
    assert (s.metrics_host, s.grpc_listen, s.grpc_listen_trainers) == ("127.0.0.1", "", 0)
    s = resolve({"grpc_listen": "0.0.0.0:7070"}, env={"ZEND_METRICS_HOST": "0.0.0.0", "ZEND_GRPC_LISTEN_TRAINERS": "1"})
    assert (s.metrics_host, s.grpc_listen_trainers) == ("0.0.0.0", 1)


@pytest.mark.parametrize(("flags", "env", "message"), [
    ({"world_size": 2, "rank": 2, "peers": "tcp://a:1,tcp://b:2"}, {}, r"rank=2 \(from flag\): must be in \[0, 2\)"),
    ({"world_size": 3, "peers": "tcp://a:1,tcp://b:2"}, {}, "lists 2 addresses for a world size of 3"),
    ({"world_size": 2, "peers": "tcp://a:1,http://b:2"}, {}, "scheme 'http'"),
    ({}, {"ZEND_SCHEME": "magic"}, r"scheme='magic' \(from \$ZEND_SCHEME\)"),
    ({}, {"ZEND_STEP_TIMEOUT_S": "soon"}, r"step_timeout_s='soon' \(from \$ZEND_STEP_TIMEOUT_S\) is not a valid float"),
    ({"world_size": 2}, {}, "more than one node needs peers or rendezvous"),
    ({"metrics_port": 70000}, {}, "metrics_port=70000"),
    ({"grpc_listen_trainers": 1}, {}, r"grpc_listen_trainers=1 \(from flag\): needs grpc_listen"),
    ({"grpc_listen": "127.0.0.1:7070"}, {"ZEND_GRPC_LISTEN_TRAINERS": "2"}, "grpc_listen_trainers=2 .*must be 0 or 1"),
    ({"rendezvous": "env", "listen": "tcp://a:1"}, {"MASTER_ADDR": "a", "PET_NODE_RANK": "0", "PET_NNODES": "1:4"},
     r"rendezvous='env': environment variable PET_NNODES='1:4' is not an integer \(a range: an elastic job"),
    ({"rendezvous": "env", "listen": "tcp://a:1", "rank": 1}, {"MASTER_ADDR": "a", "NODE_RANK": "0", "NNODES": "2"},
     r"rank=1 \(from flag\): rendezvous env takes the node's rank and count from the environment"),
])
def test_bad_settings_name_the_setting_value_and_source(flags, env, message):
    with pytest.raises(SettingsError, match=message):
        resolve(flags, env=env)


def test_rendezvous_env_is_resolved_into_the_settings_before_anything_starts():
    env = {"MASTER_ADDR": "10.0.0.1", "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "3", "RANK": "9", "WORLD_SIZE": "12"}
    s = resolve({"rendezvous": "env", "listen": "tcp://10.0.0.3:7000"}, env=env)
    assert (s.rendezvous, s.rank, s.world_size) == ("10.0.0.1:7001", 2, 3)  # the metrics' node label is right too
    assert s.sources["rank"] == "the environment"


def test_config_file_with_an_unknown_setting_is_refused(tmp_path):
    config = tmp_path / "zend.toml"
    config.write_text("shceme = 'zen'\n")
    with pytest.raises(SettingsError, match="unknown setting 'shceme'"):
        resolve({}, env={}, config_file=str(config))


# --- bounds on what a trainer can make the daemon hold (issue 14, item 8) -------------------------

def test_step_numbers_are_bounded_and_may_not_jump_far_past_the_last_synchronised_step():
    from zend.daemon.steps import MAX_STEP, STEP_WINDOW

    table = StepTable()
    with pytest.raises(StepError, match=r"step 4611686018427387904 of tensor 1 is outside \[0, 2\*\*62\)") as err:
        table.join(StepKey("j", 1, MAX_STEP), 0, "s", "p", expected=1)
    assert err.value.code == codes.INVALID_ARGUMENT
    step, _ = table.join(StepKey("j", 1, 10), 0, "s", "p", expected=1)
    table.finish(step, result="r")
    with pytest.raises(StepError, match=f"more than {STEP_WINDOW} past its last synchronised step 10"):
        table.join(StepKey("j", 1, 11 + STEP_WINDOW), 0, "s", "p", expected=1)  # would wedge the tensor
    nxt, start = table.join(StepKey("j", 1, 10 + STEP_WINDOW), 0, "s", "p", expected=1)  # the edge is fine
    assert start and nxt.key.step == 10 + STEP_WINDOW


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("emb\0x", (10, 2), r"unprintable character '\\x00' at position 3"),
    ("emb\nINFO forged", (10, 2), r"unprintable character '\\n' at position 3"),
    ("emb", (2,) * 9, "9 dimensions, more than 8"),
])
def test_tensor_names_and_shapes_are_bounded(name: str, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(SparseGradError, match=message):
        TensorSpec("a", name, shape, "float32", "sparse_rows", False)


def test_sessions_and_tensors_per_job_are_bounded_with_the_limit_named():
    secret = b"s" * 32
    reg = JobRegistry(secret, max_tensors_per_job=2, max_tensor_bytes=1 << 20)
    with pytest.raises(StepError, match=r"local_world_size 4294967295 outside \[1, 1024\]") as err:
        reg.open_session("a", 0, 2**32 - 1, pid=1)
    assert err.value.code == codes.INVALID_ARGUMENT
    s = reg.open_session("a", 0, 1, pid=1)
    with pytest.raises(StepError, match=r"needs \d+ bytes of result buffer, over this daemon's max_session_bytes"):
        reg.register(s, TensorSpec("a", "big", (1 << 20, 4), "float32", "sparse_rows", False), lambda: "scheme")
    for name in ("t0", "t1"):
        reg.register(s, TensorSpec("a", name, (10, 2), "float32", "sparse_rows", False), lambda: "scheme")
    with pytest.raises(StepError, match="job 'a' has registered 2 tensors on this node, its limit") as err:
        reg.register(s, TensorSpec("a", "t2", (10, 2), "float32", "sparse_rows", False), lambda: "scheme")
    assert err.value.code == codes.RESOURCE_EXHAUSTED
    reg.register(s, TensorSpec("a", "t1", (10, 2), "float32", "sparse_rows", False), lambda: "scheme")  # again: fine
    other = reg.open_session("b", 0, 1, pid=2)
    reg.register(other, TensorSpec("b", "t2", (10, 2), "float32", "sparse_rows", False), lambda: "scheme")  # per job


# --- per-job quotas and the buffer socket's bounds (issue 14, item 5) ------------------------------

def test_quota_settings_have_sane_defaults_and_read_the_environment():
    s = resolve({}, env={})
    assert (s.max_sessions_per_job, s.max_submits_in_flight_per_job) == (1024, 1024)
    assert (s.max_buffer_connections, s.max_buffer_connections_per_pid, s.buffer_hello_timeout_s) == (1024, 64, 5.0)
    assert s.max_job_buffer_bytes == 0 and s.job_buffer_bytes == s.max_pool_bytes // 2  # no job takes the whole pool
    s = resolve({"max_pool_bytes": 1 << 30}, env={"ZEND_MAX_JOB_BUFFER_BYTES": str(1 << 30),
                                                  "ZEND_MAX_SUBMITS_IN_FLIGHT_PER_JOB": "8"})
    assert (s.job_buffer_bytes, s.max_submits_in_flight_per_job) == (1 << 30, 8)
    assert s.sources["max_job_buffer_bytes"] == "$ZEND_MAX_JOB_BUFFER_BYTES"


@pytest.mark.parametrize(("flags", "env", "message"), [
    ({"max_pool_bytes": 1000, "max_job_buffer_bytes": 1001}, {},
     r"max_job_buffer_bytes=1001 \(from flag\): must be 0 \(half of max_pool_bytes\) or in \[1, 1000\]"),
    ({}, {"ZEND_MAX_JOB_BUFFER_BYTES": "-1"}, r"max_job_buffer_bytes=-1 \(from \$ZEND_MAX_JOB_BUFFER_BYTES\)"),
    ({"max_sessions_per_job": 0}, {}, r"max_sessions_per_job=0 \(from flag\): must be at least 1"),
    ({"max_sessions_per_job": 1025}, {}, r"max_sessions_per_job=1025 .*at most 1024"),
    ({"max_submits_in_flight_per_job": 0}, {}, "max_submits_in_flight_per_job=0 .*must be at least 1"),
    ({"max_buffer_connections": 0}, {}, "max_buffer_connections=0 .*must be at least 1"),
    ({"max_buffer_connections": 10, "max_buffer_connections_per_pid": 11}, {},
     r"max_buffer_connections_per_pid=11 .*at most max_buffer_connections \(10\)"),
    ({}, {"ZEND_BUFFER_HELLO_TIMEOUT_S": "0"}, r"buffer_hello_timeout_s=0.0 \(from \$ZEND_BUFFER_HELLO_TIMEOUT_S\): "
                                               "must be positive"),
])
def test_bad_quota_settings_name_the_setting_value_and_source(flags, env, message):
    with pytest.raises(SettingsError, match=message):
        resolve(flags, env=env)


def test_a_jobs_sessions_are_bounded_by_its_quota_per_job():
    reg = JobRegistry(b"s" * 32, max_sessions_per_job=2)
    with pytest.raises(StepError, match=r"job 'a' asks for local_world_size 3 trainers on this node, over its "
                                        r"quota of 2 sessions \(max_sessions_per_job\)") as err:
        reg.open_session("a", 0, 3, pid=1)
    assert err.value.code == codes.RESOURCE_EXHAUSTED
    for rank in range(2):
        reg.open_session("a", rank, 2, pid=rank)
    reg.open_session("b", 0, 2, pid=3)  # another job's own quota
    with pytest.raises(StepError, match="already taken"):
        reg.open_session("a", 1, 2, pid=4)


def test_rank_auto_takes_the_rendezvous_and_nothing_else() -> None:
    s = resolve({"rank": "auto", "world_size": 3, "rendezvous": "10.0.0.1:7001", "listen": "tcp://10.0.0.2:7000"},
                env={})
    assert s.rank == -1 and s.world_size == 3
    with pytest.raises(SettingsError, match="auto needs the one-shot rendezvous"):
        resolve({"rank": "auto", "world_size": 2, "peers": "tcp://a:1,tcp://b:2"}, env={})
    with pytest.raises(SettingsError, match="auto needs the one-shot rendezvous"):
        resolve({"rank": "auto", "world_size": 2, "rendezvous": "10.0.0.1:7001", "listen": "tcp://10.0.0.2:7000",
                 "elastic": 1}, env={})
    with pytest.raises(SettingsError, match="rank='x'"):
        resolve({"rank": "x"}, env={})


def test_an_etcd_rendezvous_is_elastic_and_names_a_member_that_is_not_host_port() -> None:
    given = {"rank": 1, "world_size": 3, "listen": "tcp://10.0.0.2:7000"}
    s = resolve({**given, "rendezvous": "etcd://10.0.0.7:2379,10.0.0.8:2379,[fd00::9]:2379", "elastic": 1}, env={})
    assert s.rendezvous.startswith("etcd://") and s.elastic == 1
    with pytest.raises(SettingsError, match="an etcd cluster holds elastic rounds only: add --elastic 1"):
        resolve({**given, "rendezvous": "etcd://10.0.0.7:2379"}, env={})
    with pytest.raises(SettingsError, match=r"'10.0.0.8' is not HOST:PORT of an etcd member"):
        resolve({**given, "rendezvous": "etcd://10.0.0.7:2379,10.0.0.8", "elastic": 1}, env={})


def test_the_job_is_at_the_lowest_step_its_tensors_reached_or_its_generations() -> None:
    from zend.daemon.jobs import where_the_job_is

    assert where_the_job_is(0, []) == 0
    assert where_the_job_is(5, []) == 5  # only the generation's word
    # tensor 1 went on to step 8 (a trainer waits in it), tensor 2's step 7 was aborted: the job is at 7,
    # and a healthy trainer with tensor 2 at 7 is not behind
    assert where_the_job_is(0, [(1, 8), (2, 7), (1, 7)]) == 7
    # every daemon restarted: only what the tensors say (a peer at step 66, a trainer here waiting in it)
    assert where_the_job_is(0, [(1, 66), (1, 65)]) == 66
    assert where_the_job_is(70, [(1, 66)]) == 70
