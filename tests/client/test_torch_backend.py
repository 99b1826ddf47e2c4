"""torch.distributed's "zen" backend against real daemons and real ranks (tests/client/backend_worker.py),
and its pure helpers in-process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zen
import zen.distributed as zd

from tests.helpers import ROOT, launch_ranks, poll_for
from tests.subprocess_env import project_path, with_project
from zend.cluster.local import LocalCluster, free_port

WORKER = str(ROOT / "tests/client/backend_worker.py")
EXTRA = ["--log-format", "text", "--step-timeout-s", "30"]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):  # type: ignore[no-untyped-def]
    """One local cluster per node count the tests use (1, 2, 3 nodes), started once."""
    made: dict[int, LocalCluster] = {}
    try:
        yield lambda n: made.get(n) or made.setdefault(
            n, LocalCluster(n, tmp_path_factory.mktemp(f"zen{n}"), extra=EXTRA).__enter__())
    finally:
        for c in made.values():
            c.__exit__(None, None, None)


# world size -> (nodes, trainers per node, backend string)
WORLDS = {1: (1, 1, "zen"), 2: (2, 1, "cpu:zen,cuda:zen"), 3: (3, 1, "zen"), 4: (2, 2, "cpu:zen,cuda:gloo")}


@pytest.mark.daemon
@pytest.mark.parametrize("world", sorted(WORLDS))
def test_torchs_own_sparse_reduce_cases_equal_the_expected_sums_and_gloos(clusters, world: int) -> None:
    """torch's simple_sparse_reduce_tests (num_inputs 1 and 2), AVG, fp16/bf16, int32 indices,
    uncoalesced input, a float64 tensor (through gloo), name hints; then every dense collective."""
    nodes, per_node, backend = WORLDS[world]
    outs = launch_ranks(clusters(nodes), [WORKER, "sparse_suite"], f"suite{world}", per_node=per_node,
                        timeout_s=240, env={"ZEN_TEST_BACKEND": backend})
    assert all(out.strip().endswith("OK") for out in outs), outs


@pytest.mark.daemon
def test_ddp_on_the_zen_backend_trains_as_ddp_on_gloo(clusters) -> None:
    """4 ranks on 2 nodes: a dense-only model and one with two same-shaped sparse embeddings, 5
    SGD steps each under plain DDP (no hook), parameters equal to DDP on a gloo group."""
    outs = launch_ranks(clusters(2), [WORKER, "ddp"], "ddp-backend", per_node=2, timeout_s=240)
    assert all(out.strip().endswith("OK") for out in outs), outs


@pytest.mark.daemon
@pytest.mark.parametrize("mode", ["ring", "topk"])
def test_dense_buckets_through_zend_when_asked_train_as_gloo(clusters, mode: str) -> None:
    """ZEN_DENSE_ALLREDUCE=ring|topk (top-k of all values here): DDP's dense buckets go through
    the daemons too, and the parameters still equal DDP on gloo."""
    outs = launch_ranks(clusters(2), [WORKER, "ddp_dense"], f"dense-{mode}", per_node=2, timeout_s=240,
                        env={"ZEN_DENSE_ALLREDUCE": mode})
    assert all(out.strip().endswith("OK") for out in outs), outs


@pytest.mark.daemon
@pytest.mark.parametrize("scheme", ["auto", "zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense"])
def test_two_tables_under_sparse_adam_train_as_on_gloo_whatever_the_scheme(tmp_path: Path, scheme: str) -> None:
    """A word2vec-like model (two same-shaped sparse tables, SparseAdam) under DDP on the zen backend,
    each scheme in turn on the daemons: the same losses as DDP on gloo at every step. A scheme that
    returned rows nobody sent (zeros) would make SparseAdam move them, and the losses part. The
    daemons see one tensor per table, stepped while the backend learns the pass's order (the first
    pass, and the second when DDP rebuilt its buckets), and then one fused tensor of both, stepped
    once per pass for the rest."""
    import json

    with LocalCluster(2, tmp_path, extra=[*EXTRA, "--scheme", scheme]) as c:
        outs = launch_ranks(c, [WORKER, "sparse_adam"], "w2v", per_node=1, timeout_s=240)
        names = {line.split()[1:] and tuple(line.split()[1:]) for out in outs for line in out.splitlines()
                 if line.startswith("ZEN_TENSORS")}
        assert len(names) == 1 and len(next(iter(names))) == 2, names  # every rank: the same two names
        run = subprocess.run([sys.executable, "-m", "zend", "status", "--json", "--socket-dir", c.socket_dir(0)],
                             capture_output=True, text=True, timeout=60, env=c.env)
        assert run.returncode == 0, run.stderr
        tensors = [t for t in json.loads(run.stdout)["tensors"] if t["job_id"] == "w2v"]
    tables = [t for t in tensors if not t["name"].startswith("fused:")]
    fused = [t for t in tensors if t["name"].startswith("fused:")]
    assert sorted(t["name"] for t in tables) == sorted(next(iter(names))), tensors
    assert len(fused) == 1 and fused[0]["shape"] == [400, 8], tensors  # both tables, one after the other
    learning = {t["steps"] for t in tables}
    assert len(learning) == 1 and learning <= {1, 2}, tensors
    assert fused[0]["steps"] == 10 - learning.pop(), tensors  # a step per pass, every pass


@pytest.mark.daemon
def test_ranks_calling_in_different_orders_get_out_of_order_naming_both_calls(clusters) -> None:
    outs = launch_ranks(clusters(2), [WORKER, "out_of_order"], "order", per_node=1, timeout_s=120)
    assert all("OUT_OF_ORDER_OK" in out for out in outs), outs


@pytest.mark.daemon
def test_a_lost_daemon_fails_work_wait_with_a_typed_error_within_the_peer_timeout(tmp_path: Path) -> None:
    from zend.cluster.launcher import rank_env

    with LocalCluster(2, tmp_path, extra=["--log-format", "text", "--peer-timeout-s", "2",
                                          "--step-timeout-s", "30"]) as c:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, WORKER, "daemon_lost"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=with_project(**rank_env(n, 0, 2, 1, port, c, "lost")))
                 for n in range(2)]
        try:
            for p in procs:
                assert p.stdout is not None
                line = p.stdout.readline()
                assert "FIRST_STEP_DONE" in line, line + (p.stderr.read() if p.stderr else "")
            c.kill(1)
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            out, err = procs[0].communicate(timeout=60)
            assert procs[0].returncode == 0, err[-3000:]
            assert "TYPED_ERROR" in out, out
            print(out.strip())  # the error and how long it took (pytest -s shows it)
            seconds = float(out.split(" after ")[1].split(" s")[0])
            assert seconds < 2 + 3, f"the error came {seconds:.1f} s after the call (peer timeout 2 s)"
        finally:
            for p in procs:
                p.kill()
                p.wait()


@pytest.mark.inprocess
def test_the_examples_default_backend_is_the_one_string_change() -> None:
    """examples/common.py's --backend zen is init_process_group("zen") and plain DDP: no hook."""
    source = (ROOT / "examples/common.py").read_text()
    assert 'dist.init_process_group("zen" if backend == "zen" else "gloo"' in source


# ------------------------------------------------------------------------------ in-process: pure helpers
@pytest.mark.inprocess
@pytest.mark.parametrize("shape,sparse_dims", [((7,), 1), ((4, 5), 2), ((3, 4, 5), 3), ((6, 2, 3), 1),
                                               ((5, 4, 2), 2)])
def test_linearised_rows_round_trip_every_sparse_dim(shape: tuple[int, ...], sparse_dims: int) -> None:
    torch.manual_seed(0)
    dense = torch.randn(shape) * (torch.rand(shape) < 0.3)
    t = dense.to_sparse(sparse_dims)
    rows, values, num_rows = zd._linearise(t)
    assert num_rows == int(torch.tensor(shape[:sparse_dims]).prod())
    back = torch.sparse_coo_tensor(zd._delinearise(rows, t), values, shape)
    assert torch.equal(back.to_dense(), dense)


@pytest.mark.inprocess
def test_options_and_hints_refuse_bad_values_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"Options\.dense='fast'"):
        zd.Options(dense="fast").dense_mode()
    monkeypatch.setenv(zd.DENSE_ENV, "ring2")
    with pytest.raises(ValueError, match="ZEN_DENSE_ALLREDUCE='ring2'"):
        zd.Options().dense_mode()
    monkeypatch.setenv(zd.DENSE_ENV, "topk")
    assert zd.Options().dense_mode() == "topk"
    with pytest.raises(ValueError, match="topk_ratio=0"):
        zd.Options(dense="topk", topk_ratio=0).dense_mode()
    with pytest.raises(ValueError, match="'a/b'"):
        zd.name(torch.ones(1), "a/b")
    assert zd.name(torch.ones(1), "emb")._zen_name == "emb"


@pytest.mark.inprocess
def test_the_order_check_record_carries_a_digest_and_the_readable_name() -> None:
    a, b = zd._call_record("pg0.sparse1[5].float32.sum.cpu"), zd._call_record("pg0.sparse1[6].float32.sum.cpu")
    assert a.numel() == b.numel() == 128 and not torch.equal(a[:16], b[:16])
    assert zd._call_text(a) == "pg0.sparse1[5].float32.sum.cpu"
    long = "x" * 300
    assert zd._call_text(zd._call_record(long)) == long[:112]


@pytest.mark.inprocess
def test_work_wait_raises_the_typed_error_and_a_timeout_as_step_timeout() -> None:
    failed: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    failed.set_exception(zen.StepAborted("node 1 lost [ABORTED]"))
    work = zd.ZenWork(failed)
    with pytest.raises(zen.StepAborted, match="node 1 lost"):
        work.wait()
    assert work.is_completed() and not work.is_success()
    with pytest.raises(RuntimeError, match="StepAborted"):  # what DDP's reducer sees
        work.get_future().wait()
    pending = zd.ZenWork(torch.futures.Future())
    started = time.monotonic()
    with pytest.raises(zen.StepTimeout, match=r"0\.2 s"):
        pending.wait(timedelta(seconds=0.2))
    assert time.monotonic() - started < 2


@pytest.mark.inprocess
def test_the_backend_is_registered_on_import_zen() -> None:
    assert "zen" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["zen"] == ["cpu", "cuda"]
    assert zen.__version__ and zen.__version__ != "0+unknown"


@pytest.mark.daemon
def test_init_without_a_daemon_names_the_socket(tmp_path: Path) -> None:
    """A rank whose node has no zend waits for one up to the group's timeout, saying so, then fails in
    init_process_group, saying where it looked."""
    code = ("import os, datetime, torch.distributed as dist, zen\n"
            "dist.init_process_group('zen', rank=0, world_size=1, timeout=datetime.timedelta(seconds=2))\n")
    env = {**os.environ, "ZEN_SOCKET_DIR": str(tmp_path), "ZEN_JOB_TOKEN": "t", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": project_path()}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "DaemonUnavailable" in run.stderr and str(tmp_path) in run.stderr, run.stderr[-2000:]
    assert "waiting up to 2 s for the zend daemon" in run.stderr and "waited 2 s" in run.stderr, run.stderr[-2000:]


class _BlockingClient:
    """A stand-in for zen.Client: allreduce waits until released, records the order it ran in."""

    job, world_size, local_world_size = "fake", 1, 1

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.ran: list[str] = []

    def allreduce(self, tensor, *, name, num_rows=None, average=False, timeout_s=None, topk=None):  # type: ignore[no-untyped-def]
        self.ran.append(name)
        assert self.release.wait(30)
        return tensor

    def last_stats(self, name: str) -> None:
        return None


def _fake_group(client: _BlockingClient) -> zd.ZenProcessGroup:
    return zd.ZenProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=30), "7", zd.Options(client=client))  # type: ignore[arg-type]


def _sparse(rows: list[int], n: int = 10) -> torch.Tensor:
    return torch.sparse_coo_tensor([rows], torch.ones(len(rows)), (n,))


@pytest.mark.inprocess
def test_one_name_runs_one_step_at_a_time_in_call_order_and_results_land_in_place() -> None:
    client = _BlockingClient()
    pg = _fake_group(client)
    a, b = _sparse([1]), _sparse([2, 3])
    work_a, work_b = pg.allreduce([a]), pg.allreduce([b])  # one name: b queues behind a
    poll_for(lambda: client.ran, 10, "a's step running")
    time.sleep(0.2)  # the point: b, queued behind a, does not start meanwhile
    assert client.ran == ["pg7.sparse1[10].float32.sum.cpu"]  # only a's step is running
    client.release.set()
    assert work_a.wait() and work_b.wait()
    assert len(client.ran) == 2
    assert work_b.result()[0] is b and torch.equal(b.to_dense(), _sparse([2, 3]).to_dense())
    pg.shutdown()


@pytest.mark.inprocess
def test_abort_fails_running_and_queued_work_with_step_aborted_at_once() -> None:
    client = _BlockingClient()
    pg = _fake_group(client)
    running, queued = pg.allreduce([_sparse([1])]), pg.allreduce([_sparse([2])])
    poll_for(lambda: client.ran, 10, "the first step running, the second queued behind it")
    started = time.monotonic()
    pg.abort()
    for work in (running, queued):
        with pytest.raises(zen.StepAborted, match="aborted"):
            work.wait()
    assert time.monotonic() - started < 2
    with pytest.raises(zen.ZenError, match="shut down"):
        pg.allreduce([_sparse([3])])
    client.release.set()


@pytest.mark.inprocess
def test_shutdown_waits_for_the_steps_queued_behind_others() -> None:
    import threading

    client = _BlockingClient()
    pg = _fake_group(client)
    first, second = pg.allreduce([_sparse([1])]), pg.allreduce([_sparse([2])])  # one name: second queued
    threading.Timer(0.3, client.release.set).start()
    pg.shutdown()  # returns once both ran
    assert first.wait() and second.wait() and len(client.ran) == 2


@pytest.mark.inprocess
def test_reraise_gives_the_typed_error_behind_ddps_runtime_error_and_drops_a_stale_one() -> None:
    client = _BlockingClient()
    pg = _fake_group(client)
    pg.error = zen.StepAborted("step 3 of tensor 'e' aborted: node 1 lost [ABORTED]")
    with pytest.raises(zen.StepAborted):
        pg.reraise(RuntimeError("Got the following error when running the callback: StepAborted: step 3 of tensor "
                                "'e' aborted: node 1 lost [ABORTED]"))
    pg.error = zen.StepAborted("step 3 of tensor 'e' aborted [ABORTED]")
    pg.reraise(RuntimeError("CUDA out of memory"))  # not zen's: nothing raised, and the stale error is gone
    assert pg.error is None
    pg.shutdown()


@pytest.mark.inprocess
def test_dense_topk_keeps_one_residual_per_tensor_storage_under_one_name() -> None:
    client = _BlockingClient()
    client.release.set()
    pg = zd.ZenProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=30), "8",
                            zd.Options(dense="topk", topk_ratio=0.5, client=client))  # type: ignore[arg-type]
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 0.0, 0.0, 0.0])
    pg.allreduce([a]).wait()
    assert a.tolist() == [0.0, 0.0, 3.0, 4.0]  # 1 and 2 carried over in a's residual
    pg.allreduce([b]).wait()
    assert b.tolist() == [10.0, 0.0, 0.0, 0.0]  # a's residual is not b's, though one zen name serves both
    a.copy_(torch.ones(4))
    pg.allreduce([a]).wait()
    assert a.tolist() == [2.0, 3.0, 0.0, 0.0]
    assert set(client.ran) == {"pg8.topk0.5[4].float32.sum.cpu"}
    pg.shutdown()


@pytest.mark.inprocess
def test_sparse_tensors_zen_cannot_carry_go_through_gloo_with_the_same_sum() -> None:
    client = _BlockingClient()
    pg = _fake_group(client)
    huge = torch.sparse_coo_tensor([[65_540, 3], [5, 65_540]], torch.ones(2), (2**16 + 10, 2**16 + 10))  # 2^32 rows
    wide = torch.sparse_coo_tensor([[1]], torch.ones(1, dtype=torch.float64), (4,))
    for t, op in ((huge, dist.ReduceOp.SUM), (wide, dist.ReduceOp.AVG)):
        want = t.coalesce()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        work = pg.allreduce([t], opts)
        work.wait()
        for got in (t.coalesce(), work.result()[0].coalesce()):  # a world of one: the input itself, once
            assert torch.equal(got.indices(), want.indices()) and torch.equal(got.values(), want.values())
    assert client.ran == []
    pg.shutdown()
