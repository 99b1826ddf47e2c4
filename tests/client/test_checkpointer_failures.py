"""What a training loop sees when a checkpoint cannot be saved or agreed on: zen's CheckpointError (an
Exception), never DCP's CheckpointException (a BaseException, which `except Exception` lets through and
which killed the drill's trainers), and the same error on every trainer.

Checkpointer.agreed_step runs over a real gloo group of two processes: a trainer whose daemon cannot be asked
(here: its list of checkpoints raises DaemonUnavailable) fails every trainer alike, naming itself, instead
of leaving the others in the gather until gloo's timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.subprocess_env import with_project

RANK = textwrap.dedent("""
    import datetime, sys
    import torch.distributed as dist
    import zen
    import zen.checkpoint as zc

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))

    def held(self):
        if rank == 1:
            raise zen.DaemonUnavailable("daemon at /run/zen/node1 is gone")
        return [20, 10], []

    zc.Checkpointer._held = held
    try:
        print("agreed", zc.Checkpointer(client=object()).agreed_step(), flush=True)
    except zc.CheckpointError as exc:
        print("refused", exc, flush=True)
""")


@pytest.mark.inprocess
def test_a_failed_dcp_save_reaches_the_loop_as_a_checkpoint_error_naming_each_rank() -> None:
    import zen
    import zen.checkpoint as zc
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def failed(exc: BaseException) -> tuple:
        try:
            raise exc
        except BaseException as raised:  # with its traceback, as DCP wraps it
            return _wrap_exception(raised)

    class Pending:
        def result(self) -> None:
            raise CheckpointException("write", {2: failed(zen.DaemonUnavailable("no zend daemon at node1")),
                                                3: failed(OSError("disk"))})

    ckpt = zc.Checkpointer(client=object())  # type: ignore[arg-type] # never asked: nothing reaches a daemon
    ckpt._pending, ckpt._pending_step = Pending(), 40
    with pytest.raises(zc.CheckpointError) as caught:
        ckpt.wait()
    assert isinstance(caught.value, Exception) and isinstance(caught.value, zen.ZenError)
    assert str(caught.value).startswith("checkpoint step 40: saving failed on 2 ranks: rank 2: DaemonUnavailable")
    assert "no zend daemon at node1" in str(caught.value) and "rank 3: OSError: disk" in str(caught.value)
    ckpt.wait()  # the failed save is gone: nothing in flight


@pytest.mark.inprocess
def test_an_asynchronous_save_after_a_failed_one_is_started_before_the_failure_is_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp
    import zen.checkpoint as zc
    from torch.distributed.checkpoint.api import CheckpointException

    started: list[int] = []

    def async_save(state: dict, **kw: Any) -> str:
        started.append(kw["storage_writer"].step)
        return "next"

    monkeypatch.setattr(dcp, "async_save", async_save)

    class Failed:
        def result(self) -> None:
            raise CheckpointException("write", {1: (RuntimeError("daemon gone"), None)})  # type: ignore[dict-item]

    ckpt = zc.Checkpointer(client=object(), asynchronous=True)  # type: ignore[arg-type] # no daemon is asked
    ckpt._pending, ckpt._pending_step = Failed(), 10
    with pytest.raises(zc.CheckpointError, match="step 10: saving failed on 1 rank: rank 1: RuntimeError: daemon gone"):
        ckpt.save({}, 20)
    assert started == [20] and ckpt._pending == "next" and ckpt.last_saved == 20


@pytest.mark.daemon
def test_one_trainer_that_cannot_list_its_checkpoints_fails_every_trainer_naming_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=with_project()) for rank in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=50)[0])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank, out in enumerate(outs):
        assert "refused could not list the checkpoints held: rank 1: DaemonUnavailable" in out, (rank, out)
        assert "/run/zen/node1 is gone" in out, (rank, out)
