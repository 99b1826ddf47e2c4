"""The zen client and its PyTorch integration against real daemons and real torch.distributed ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import zen

from tests.helpers import ROOT, launch_ranks, run_all
from tests.subprocess_env import with_project
from zend.cluster.local import free_port


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory):  # type: ignore[no-untyped-def]
    from zend.cluster.local import LocalCluster

    with LocalCluster(2, tmp_path_factory.mktemp("zen2"), extra=["--log-format", "text", "--step-timeout-s",
                                                                 "30"]) as c:
        yield c


@pytest.mark.daemon
def test_ddp_hook_gives_plain_ddps_gradients_with_unused_embeddings_topk_and_fused_steps(cluster2):
    launch_ranks(cluster2, [str(ROOT / "tests/client/worker.py"), "ddp"], "ddp")


@pytest.mark.daemon
def test_helper_in_fp32_fp16_bf16_with_unused_and_empty_gradients_pairs_and_async(cluster2):
    launch_ranks(cluster2, [str(ROOT / "tests/client/worker.py"), "helper"], "helper")


@pytest.mark.daemon
def test_helper_through_buffers_that_show_writes_only_once_published(tmp_path):
    """The client, its async path and sync_gradients over the fenced double of a device buffer
    (zend/buffers/fenced.py): a hand-off without publish or acquire would give the wrong sums here."""
    from zend.buffers import fenced
    from zend.cluster.local import LocalCluster

    with LocalCluster(2, tmp_path, extra=["--log-format", "text", "--step-timeout-s", "30"],
                      env={fenced.ENV: "1"}) as c:
        launch_ranks(c, [str(ROOT / "tests/client/worker.py"), "helper"], "fenced-helper", env={fenced.ENV: "1"})


@pytest.mark.inprocess
def test_daemon_absent_names_the_address(tmp_path):
    with pytest.raises(zen.DaemonUnavailable, match=f"no zend daemon at unix:{tmp_path}/zend.sock"):
        zen.Client(str(tmp_path), job="j", token="t", wait_s=0)
    with pytest.raises(zen.NotAuthorized, match="ZEN_JOB_TOKEN"):
        zen.Client(str(tmp_path), job="j", token="")


@pytest.mark.daemon
def test_wrong_token_and_invalid_tensors_raise_typed_errors(cluster2):
    with pytest.raises(zen.NotAuthorized, match="not job 'j'"):
        zen.Client(cluster2.socket_dir(0), job="j", token=cluster2.token("other"))
    with zen.Client(cluster2.socket_dir(0), job="invalid", token=cluster2.token("invalid")) as client:
        bad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([[1.0], [float("nan")]]), (4, 1),
                                      check_invariants=True)
        with pytest.raises(zen.InvalidGradient, match="non-finite value nan in row 1"):
            client.allreduce(bad, name="nan")
        with pytest.raises(zen.InvalidGradient, match="sparse_dim 2"):
            client.allreduce(torch.eye(3).to_sparse(), name="2d")
        with pytest.raises(zen.InvalidGradient, match="int64"):
            client.allreduce(torch.ones(3, dtype=torch.int64), name="ints")
        with pytest.raises(zen.InvalidGradient, match="num_rows"):
            client.allreduce((torch.tensor([1]), torch.ones(1)), name="pair")


@pytest.mark.daemon
def test_timeout_raises_step_timeout(cluster2):
    # node 1 never submits: node 0's step cannot finish
    with zen.Client(cluster2.socket_dir(0), job="slow", token=cluster2.token("slow")) as client:
        t0 = time.monotonic()
        with pytest.raises(zen.StepTimeout):
            client.allreduce(torch.ones(4), name="w", timeout_s=1.0)
        assert time.monotonic() - t0 < 5


@pytest.mark.daemon
def test_daemon_killed_mid_step_raises_daemon_unavailable(fresh_cluster):
    c = fresh_cluster(2, extra=["--log-format", "text"])
    with zen.Client(c.socket_dir(0), job="k", token=c.token("k")) as client:
        threading.Timer(1.0, lambda: c.kill(0, signal.SIGKILL)).start()
        with pytest.raises(zen.DaemonUnavailable):
            client.allreduce(torch.ones(4), name="w", timeout_s=30)


@pytest.mark.daemon
def test_gpt_example_same_loss_with_zen_and_with_ddp_gloo(cluster2):
    """Example (a), 4 ranks (2 nodes x 2), 50 steps, same seed: the loss at every step agrees."""
    from zend.cluster.local import LocalCluster

    args = ["--steps", "50", "--dim", "32", "--layers", "1", "--heads", "2", "--context", "32", "--batch", "2",
            "--json"]
    script = [str(ROOT / "examples/gpt_sparse.py")]
    with LocalCluster(2, cluster2.workdir / "gpt", extra=["--log-format", "text"]) as c:
        zen_out = launch_ranks(c, [*script, "--backend", "zen", *args], "gpt", per_node=2, timeout_s=600)
    gloo_out = launch_ranks(cluster2, [*script, "--backend", "gloo", *args], "gpt", per_node=2, timeout_s=600)
    import json

    zen_losses = [json.loads(line)["loss"] for line in zen_out[0].splitlines() if line.startswith("{")]
    gloo_losses = [json.loads(line)["loss"] for line in gloo_out[0].splitlines() if line.startswith("{")]
    assert len(zen_losses) == len(gloo_losses) == 50
    for step, (a, b) in enumerate(zip(zen_losses, gloo_losses, strict=True)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"step {step}: zen {a} vs gloo {b}"
    assert zen_losses[-1] < zen_losses[0] - 0.5  # it learns


@pytest.mark.daemon
def test_a_daemon_out_of_descriptors_refuses_one_request_with_out_of_resources_and_the_session_lives(
        fresh_cluster):  # type: ignore[no-untyped-def]
    """issue 14, item 6: an established trainer's next alloc hits EMFILE (the daemon's fd limit lowered
    to what it holds): that request is OutOfResources; the session, its tensors and its steps go on."""
    import resource

    c = fresh_cluster(1, extra=["--log-format", "text"])
    pid = c.procs[0].pid
    with zen.Client(c.socket_dir(0), job="fds", token=c.token("fds")) as client:
        client.allreduce(torch.ones(64), name="kept")
        limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        held = len(os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (held, limits[1]))
        try:
            with pytest.raises(zen.OutOfResources, match=r"tensor 'new'.*out of resources \(EMFILE"):
                client.allreduce(torch.ones(1024), name="new")
            assert client.allreduce(torch.ones(64), name="kept").sum().item() == 64  # the session lives on
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
        assert client.allreduce(torch.ones(1024), name="new").sum().item() == 1024
    assert "the daemon is out of resources" in c.log_tail(0, 200) or "Too many open files" in c.log_tail(0, 200)


@pytest.mark.daemon
def test_all_tensor_kinds_over_threads_on_one_node(fresh_cluster):
    c = fresh_cluster(1, extra=["--log-format", "text"])

    def trainer(local: int):  # type: ignore[no-untyped-def]
        with zen.Client(c.socket_dir(0), job="t", token=c.token("t"), local_rank=local,
                        local_world_size=2) as client:
            return client.allreduce(torch.full((5,), float(local)), name="v", topk=0.4).tolist()

    results = run_all([lambda r=r: trainer(r) for r in range(2)])
    assert all(not isinstance(r, BaseException) for r in results), results
    assert results[0] == results[1]


def fused_and_one_by_one(cluster, job: str, tensors, names: list[str]) -> list:  # type: ignore[no-untyped-def]
    """On each of the 2 nodes, one trainer: `tensors(node)` through allreduce_many, then each alone;
    per node (fused, one by one, last_stats of each name), or the exception it raised."""
    def trainer(node: int):  # type: ignore[no-untyped-def]
        with zen.Client(cluster.socket_dir(node), job=job, token=cluster.token(job)) as client:
            fused = client.allreduce_many(tensors(node), names=names)
            one_by_one = [client.allreduce(t, name=f"single-{n}") for t, n in zip(tensors(node), names, strict=True)]
            return fused, one_by_one, [client.last_stats(n) for n in names]

    return run_all([lambda n=n: trainer(n) for n in range(2)])


@pytest.mark.daemon
def test_allreduce_many_fuses_tensors_and_gives_each_its_own_sum(cluster2):
    """Tensor fusion: tensors of one kind in one step, split back; the same as one step each."""
    def tensors(node: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(node)

        def sparse(rows: int, shape: tuple[int, ...], dtype: torch.dtype, present: int) -> torch.Tensor:
            idx = torch.randperm(rows, generator=g)[:present].unsqueeze(0)
            return torch.sparse_coo_tensor(idx, torch.randn(present, *shape, generator=g).to(dtype), (rows, *shape),
                                           check_invariants=True)

        return [sparse(10, (4,), torch.float32, 3), sparse(7, (4,), torch.float32, 7),
                sparse(5, (2,), torch.float32, 2), sparse(9, (4,), torch.bfloat16, 4),
                sparse(3, (4,), torch.float32, 0)]

    names = ["a", "b", "c", "d", "e"]

    results = fused_and_one_by_one(cluster2, "fused", tensors, names)
    assert all(not isinstance(r, BaseException) for r in results), results
    expected = [sum(tensors(n)[i].to_dense().float() for n in range(2)) for i in range(len(names))]
    for fused, one_by_one, stats in results:
        # a member's figures are its fused step's: a and b (float32, width 4) went in one, c in another
        assert stats[0] is not None and stats[0] is stats[1] and stats[2] is not stats[0], stats
        assert [s.step for s in stats if s is not None] == [0] * len(names)
        for i, (f, single) in enumerate(zip(fused, one_by_one, strict=True)):
            assert f.shape == tensors(0)[i].shape and f.dtype == tensors(0)[i].dtype and f.is_coalesced()
            torch.testing.assert_close(f.to_dense().float(), expected[i], rtol=2e-2, atol=2e-2)
            assert torch.equal(f.to_dense(), single.to_dense())  # fused or not, the same bits
    with zen.Client(cluster2.socket_dir(0), job="fused", token=cluster2.token("fused")) as client, \
            pytest.raises(zen.InvalidGradient, match="distinct"):
        client.allreduce_many(tensors(0)[:2], names=["x", "x"])


@pytest.mark.daemon
def test_allreduce_many_sends_tables_of_different_widths_in_one_step_with_the_same_bits(cluster2):
    """Widths 256, 64, 4x16 and 128 float32 values (rows cut into 64) share one step; width 3 goes in its
    own. Rows repeated within a table (nn.Embedding's uncoalesced gradients) and a table with no rows too."""
    def tensors(node: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + node)

        def sparse(rows: int, shape: tuple[int, ...], present: int, repeat: bool = False) -> torch.Tensor:
            idx = torch.randperm(rows, generator=g)[:present]
            if repeat:
                idx = torch.cat([idx, idx[: present // 2]])
            values = torch.randn(idx.numel(), *shape, generator=g)
            return torch.sparse_coo_tensor(idx.unsqueeze(0), values, (rows, *shape), check_invariants=True)

        return [sparse(40, (256,), 9, repeat=True), sparse(30, (64,), 30), sparse(12, (4, 16), 5),
                sparse(50, (3,), 7), sparse(20, (128,), 0), sparse(25, (256,), 3 + node)]

    names = ["wide", "narrow", "shaped", "odd", "empty", "wide2"]

    results = fused_and_one_by_one(cluster2, "widths", tensors, names)
    assert all(not isinstance(r, BaseException) for r in results), results
    for fused, one_by_one, stats in results:
        shared = [s for i, s in enumerate(stats) if names[i] != "odd"]
        assert all(s is shared[0] for s in shared) and stats[3] is not shared[0], stats  # two steps, not five
        for i, (f, single) in enumerate(zip(fused, one_by_one, strict=True)):
            assert f.shape == single.shape and f.is_coalesced(), names[i]
            assert torch.equal(f._indices(), single._indices()), names[i]  # the same rows, none added or lost
            assert torch.equal(f._values(), single._values()), names[i]  # fused or not, the same bits


@pytest.mark.daemon
@pytest.mark.parametrize("fuse", [True, False])
def test_a_failed_bucket_comes_back_to_the_training_loop_typed(fuse):
    """DDP turns a hook's failure into a RuntimeError; HookState.reraise gives zen's typed error back."""
    script = (
        "import os, torch, torch.distributed as dist, zen\n"
        "from torch import nn\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['TEST_PORT'])\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "class Aborting:\n"
        "    def allreduce_async(self, tensor, **kwargs):\n"
        "        f = torch.futures.Future()\n"
        "        f.set_exception(zen.StepAborted(\"step 4 of tensor 'emb' aborted: node 1 lost [ABORTED]\"))\n"
        "        return f\n"
        "    def allreduce_many_async(self, tensors, **kwargs):\n"
        "        return self.allreduce_async(tensors[0])\n"
        "model = nn.Embedding(10, 4, sparse=True)\n"
        "ddp = nn.parallel.DistributedDataParallel(model)\n"
        f"state = zen.HookState(Aborting(), model, fuse={fuse})\n"
        "ddp.register_comm_hook(state, zen.comm_hook)\n"
        "try:\n"
        "    ddp(torch.tensor([1, 2])).sum().backward()\n"
        "    raise SystemExit('backward did not fail')\n"
        "except RuntimeError:\n"
        "    try:\n"
        "        state.reraise()\n"
        "    except zen.StepAborted as exc:\n"
        "        print('typed:', exc)\n"
        "state.reraise()  # nothing left: returns\n"
        "dist.destroy_process_group()\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=with_project(TEST_PORT=str(free_port())))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "typed: step 4 of tensor 'emb' aborted: node 1 lost" in run.stdout
