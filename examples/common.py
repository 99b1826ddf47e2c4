"""What examples (a) and (b) share: their command line, the local launch, joining the job, the
training loop's timing and reporting (a row per step, or a progress bar on a terminal; a summary)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn


def add_run_args(p: argparse.ArgumentParser, steps: int = 100) -> None:
    p.add_argument("--backend", choices=["zen", "zen-hook", "gloo", "gloo-dense"], default="zen",
                   help="zen: torch.distributed's backend 'zen' (sparse all_reduce through zend, the rest on gloo); "
                        "zen-hook: a gloo group with zen.comm_hook on DDP (dense buckets top-k'd with --dense topk)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--launch", action="store_true", help="start a local cluster and all ranks here")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2, help="ranks per node (with --launch)")
    p.add_argument("--restart-daemon-at", type=int, default=None, metavar="STEP",
                   help="with --launch --backend zen|zen-hook: kill -9 node 1's daemon as step STEP starts and "
                        "start it again; the loop waits for the cluster and redoes the step (an elastic cluster)")
    p.add_argument("--kill-trainer-at", type=int, default=None, metavar="STEP",
                   help="the last rank's trainer dies (exit 1, no cleanup) as step STEP starts, in its first life "
                        "only; with --max-restarts and --checkpoint-every the job restarts and resumes")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --launch: torchrun restarts every trainer of the job after one fails, up to N times "
                        "(ranks from its c10d rendezvous); with --checkpoint-every they resume from the newest "
                        "in-memory checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="with --backend zen|zen-hook: an in-memory checkpoint (model and optimiser, through zend; "
                        "zen.checkpoint) every K steps, and at start the newest one complete on every rank is loaded "
                        "(a restarted rank resumes there); 0: none")


def exit_process(code: int) -> NoReturn:
    """Leave without the interpreter's teardown, the process group destroyed and the output flushed:
    gloo's worker threads can still hold work whose tensors reference Python objects, and freeing them
    while the interpreter finalises aborts a rank that finished its job (SIGABRT, "terminate called
    without an active exception"; seen in CI on the gloo baseline, pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(script: str, args: argparse.Namespace, job: str) -> int:
    """A local zend cluster (for --backend zen) and NODES x TRAINERS ranks of `script`."""
    from zend.cluster.launcher import run_local_job

    forward = [a for a in sys.argv[1:] if a != "--launch"]
    return run_local_job([script, *forward], args.nodes, args.trainers, job,
                         with_zen=args.backend.startswith("zen"), restart_daemon_at=args.restart_daemon_at,
                         max_restarts=args.max_restarts)


def join_job(seed: int, backend: str, pg_options: Any = None) -> tuple[int, int]:
    """(rank, world size) from torchrun's variables, with torch.distributed up: on the "zen"
    backend for --backend zen (the one string a user changes), else on gloo."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "zen":
        import zen  # noqa: F401  (registers the backend)
    dist.init_process_group("zen" if backend == "zen" else "gloo", rank=rank, world_size=world,
                            pg_options=pg_options if backend == "zen" else None)
    return rank, world


def wrap(model: nn.Module, backend: str, **hook_options: Any) -> tuple[nn.Module, Any, Any]:
    """DDP over `model`. Returns (ddp, client, errors): the zen client and what re-raises zen's
    typed error after a failed backward (the process group, or the hook state); None without zen.
    With backend zen, plain DDP on the zen process group sends its sparse buckets through zend;
    with zen-hook, zen.comm_hook does (and dense ones too with dense="topk")."""
    ddp = nn.parallel.DistributedDataParallel(model)
    if backend == "zen":
        import zen

        return ddp, zen.distributed.client_of(), dist.group.WORLD
    if backend == "zen-hook":
        import zen

        client = zen.Client()
        state = zen.HookState(client, model, **hook_options)
        ddp.register_comm_hook(state, zen.comm_hook)
        return ddp, client, state
    return ddp, None, None


def last_stats(backend: str, client: Any, model: nn.Module, param: str, prefix: str = "ddp") -> Any:
    """The daemon's figures for the last step of parameter `param`'s sparse gradient."""
    import zen

    if backend == "zen-hook":
        return client.last_stats(f"{prefix}.{param}")  # zen.comm_hook names buckets by their parameters
    return client.last_stats(zen.distributed.sparse_name(model.get_parameter(param)))


def step_surviving_faults(run: Callable[[], torch.Tensor], client: Any, hook: Any) -> torch.Tensor:
    """zen.step_surviving_faults (redo a step zen aborted, once the cluster is whole); without zen, run()."""
    if client is None:
        return run()
    import zen

    return zen.step_surviving_faults(run, client, hook)


def fault_point(args: argparse.Namespace, rank: int, step: int) -> None:
    """--restart-daemon-at: rank 0 asks the launcher to restart a daemon as this step starts, and
    goes on once it is dead (so the fault falls inside the step on every rank). Every rank first
    meets at a barrier: a rank still taking the last step's result from its daemon would lose it
    with the daemon (zen.OutOfOrder, a restart from a checkpoint: not the fault this drill is for)."""
    folder = os.environ.get("ZEN_EXAMPLE_FAULT_DIR")
    if folder is None or args.restart_daemon_at != step:
        return
    dist.barrier()
    if rank != 0:
        return
    open(os.path.join(folder, "request"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, "done")) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_point(args: argparse.Namespace, rank: int, step: int) -> None:
    """--kill-trainer-at: the last rank dies as step STEP starts, as a crashed trainer would (no cleanup, no
    goodbye to its daemon or its process group), once in the job: a mark in the launcher's run folder says it
    happened (a restart may give the last rank to another node, whose torchrun counts no restart of its own)."""
    if args.kill_trainer_at != step or rank != dist.get_world_size() - 1:
        return
    folder = os.environ.get("ZEN_EXAMPLE_FAULT_DIR")
    if folder is None:  # not under --launch: torchrun's count of this node's restarts
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
    else:
        try:
            os.close(os.open(os.path.join(folder, "trainer-killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    print(f"rank {rank}: killed as step {step} starts (--kill-trainer-at)", file=sys.stderr, flush=True)
    os._exit(1)


def checkpointer(args: argparse.Namespace, client: Any) -> Any:
    """--checkpoint-every: zen's in-memory checkpoints (None without them)."""
    if not args.checkpoint_every or client is None:
        return None
    import zen.checkpoint

    return zen.checkpoint.Checkpointer(every=args.checkpoint_every, client=client, asynchronous=True)


def save_checkpoint(ckpt: Any, state_of: Callable[[], dict[str, Any]], step: int) -> None:
    """A checkpoint every --checkpoint-every steps. One that failed (a daemon restarted while the save before was
    handed over: every rank is told alike) costs only itself: the loop goes on, the next save tries again."""
    import zen.checkpoint

    try:
        ckpt.maybe_save(state_of(), step)
    except zen.checkpoint.CheckpointError as exc:
        print(f"checkpoint not taken, training goes on: {exc}", file=sys.stderr, flush=True)


def resume(ckpt: Any, state_of: Callable[[], dict[str, Any]] | None, load: Callable[[dict[str, Any]], None]) -> int:
    """The step to start at: after the newest checkpoint complete on every rank (loaded into the model and
    optimiser), else 0."""
    if ckpt is None or state_of is None:
        return 0
    state = state_of()
    step = ckpt.load_latest(state)
    if step is None:
        return 0
    load(state)
    return step + 1


def train_steps(args: argparse.Namespace, rank: int, client: Any, batch_of: Callable[[int], Any],
                loss_of: Callable[[Any], torch.Tensor], wire_of: Callable[[Any], dict[str, Any]],
                dense_bytes: float, what: str, hook: Any = None,
                state_of: Callable[[], dict[str, Any]] | None = None,
                load: Callable[[dict[str, Any]], None] = lambda state: None) -> list[dict[str, Any]]:
    """args.steps steps of `loss_of(batch_of(step))` (its backward and optimiser step included),
    timed from the batch on; `wire_of(client)` gives the daemon's bytes (only with zen). With
    --checkpoint-every, `state_of()` (DCP's state dict of the model and optimiser) is checkpointed in
    memory, its time inside the step's, and the loop starts after the newest complete one (`load` puts
    a loaded state back): a job that torchrun restarted after a trainer failed (--max-restarts) resumes
    there on every rank, with the same state. Reports on rank 0, then closes the client and the process
    group. Returns one row per step."""
    rows: list[dict[str, Any]] = []
    ckpt = checkpointer(args, client)
    step = resume(ckpt, state_of, load)
    while step < args.steps:
        batch = batch_of(step)
        fault_point(args, rank, step)
        t0, cpu0 = time.perf_counter(), time.process_time()
        kill_point(args, rank, step)
        # a failure that is not a redo (zen.OutOfOrder: the job moved on without this rank) ends the process:
        # this rank cannot resume alone, its replica would differ from the others'; the job restarts together
        loss = step_surviving_faults(lambda b=batch: loss_of(b), client, hook)
        if ckpt is not None and state_of is not None:
            save_checkpoint(ckpt, state_of, step)
        seconds = time.perf_counter() - t0
        # the trainer's CPU (every thread) beside the wall time; `end` places the step on the wall clock
        row: dict[str, Any] = {"step": step, "loss": loss.item(), "seconds": seconds,
                               "cpu_seconds": time.process_time() - cpu0, "end": time.time()}
        if client is not None:
            row.update(wire_of(client))
        else:
            row["wire_bytes"] = float("nan")  # gloo: an allgather of indices and values, or every row
        row["dense_bytes"] = dense_bytes
        rows.append(row)
        if rank == 0:
            report_step(row, args.steps, what, args.json)
        step += 1
    if ckpt is not None:
        try:
            ckpt.wait()
        except Exception as exc:  # zen.checkpoint.CheckpointError: the last save failed, the training did not
            print(f"the last checkpoint was not taken: {exc}", file=sys.stderr, flush=True)
    if rank == 0 and not args.json:
        report_summary(rows, args.backend)
    if client is not None and hook is not dist.group.WORLD:
        client.close()  # the hook's; the zen process group closes its own
    dist.destroy_process_group()
    return rows


def model_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[Callable[[], dict[str, Any]],
                                                                       Callable[[dict[str, Any]], None]]:
    """(state_of, load) for train_steps: DCP's state dicts of `model` and `opt`, and putting them back."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state_of() -> dict[str, Any]:
        model_sd, opt_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": opt_sd}

    def load(state: dict[str, Any]) -> None:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return state_of, load


def report_step(row: dict[str, Any], steps: int, what: str, as_json: bool) -> None:
    """`row` has step, loss, seconds, cpu_seconds, end, wire_bytes (NaN without zen) and dense_bytes; `what` names the
    tensors counted on the wire ("embedding", "tables")."""
    if as_json:
        print(json.dumps(row), flush=True)
        return
    step, wire, dense = row["step"], row["wire_bytes"], row["dense_bytes"]
    done = (step + 1) / steps
    bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
    saved = "" if math.isnan(wire) or not dense else (
        f"  {what} {wire / 1e6:6.3f} MB on the wire vs {dense / 1e6:6.3f} MB dense ({1 - wire / dense:.0%} saved)")
    line = f"[{bar}] {step + 1}/{steps}  loss {row['loss']:.4f}  {row['seconds'] * 1e3:6.0f} ms/step{saved}"
    if sys.stdout.isatty():
        print("\r" + line, end="", flush=True)
    else:
        print(line, flush=True)


def report_summary(rows: list[dict[str, Any]], backend: str) -> None:
    if not rows:
        return
    mean = sum(r["seconds"] for r in rows[1:]) / max(1, len(rows) - 1)
    print(f"\n{backend}: {len(rows)} steps, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, "
          f"{mean * 1e3:.0f} ms per step after the first ({1 / mean:.2f} steps/s)", flush=True)
