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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def add_run_args(p: argparse.ArgumentParser, steps: int = 100) -> None:
    p.add_argument("--backend", choices=["zen", "gloo", "gloo-dense"], default="zen")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--launch", action="store_true", help="start a local cluster and all ranks here")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2, help="ranks per node (with --launch)")


def launch(script: str, args: argparse.Namespace, job: str) -> int:
    """A local zend cluster (for --backend zen) and NODES x TRAINERS ranks of `script`."""
    from zend.cluster.launcher import run_local_job

    forward = [a for a in sys.argv[1:] if a != "--launch"]
    return run_local_job([sys.executable, script, *forward], args.nodes, args.trainers, job,
                         with_zen=args.backend == "zen")


def join_job(seed: int) -> tuple[int, int]:
    """(rank, world size) from torchrun's variables, with torch.distributed up over gloo."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def wrap(model: nn.Module, backend: str, **hook_options: Any) -> tuple[nn.Module, Any]:
    """DDP over `model`; with backend zen, its sparse buckets go through the node's daemon."""
    ddp = nn.parallel.DistributedDataParallel(model)
    client = None
    if backend == "zen":
        import zen

        client = zen.Client()
        ddp.register_comm_hook(zen.HookState(client, model, **hook_options), zen.comm_hook)
    return ddp, client


def train_steps(args: argparse.Namespace, rank: int, client: Any, batch_of: Callable[[int], Any],
                loss_of: Callable[[Any], torch.Tensor], wire_of: Callable[[Any], dict[str, Any]],
                dense_bytes: float, what: str) -> list[dict[str, Any]]:
    """args.steps steps of `loss_of(batch_of(step))` (its backward and optimiser step included),
    timed from the batch on; `wire_of(client)` gives the daemon's bytes (only with zen). Reports on
    rank 0, then closes the client and the process group. Returns one row per step."""
    rows: list[dict[str, Any]] = []
    for step in range(args.steps):
        batch = batch_of(step)
        t0 = time.perf_counter()
        loss = loss_of(batch)
        seconds = time.perf_counter() - t0
        row: dict[str, Any] = {"step": step, "loss": loss.item(), "seconds": seconds}
        if client is not None:
            row.update(wire_of(client))
        else:
            row["wire_bytes"] = float("nan")  # gloo: an allgather of indices and values, or every row
        row["dense_bytes"] = dense_bytes
        rows.append(row)
        if rank == 0:
            report_step(row, args.steps, what, args.json)
    if rank == 0 and not args.json:
        report_summary(rows, args.backend)
    if client is not None:
        client.close()
    dist.destroy_process_group()
    return rows


def report_step(row: dict[str, Any], steps: int, what: str, as_json: bool) -> None:
    """`row` has step, loss, seconds, wire_bytes (NaN without zen) and dense_bytes; `what` names the
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
