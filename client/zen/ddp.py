"""PyTorch integration: a DDP communication hook, and one call that syncs a model without DDP.

    ddp.register_comm_hook(zen.HookState(client, ddp.module), zen.comm_hook)

Sparse buckets (nn.Embedding(sparse=True) parameters get a bucket each) go through the zen
daemon, fused: the hook holds each until DDP's last bucket of the backward pass
(`GradBucket.is_last()`), then sends them all as one step per dtype (row widths share it as
rows of their common divisor, within bounds: `Client.allreduce_many`), so the
daemon's fixed cost and the commit's rounds are paid once per iteration, not once per table
(`fuse=False`: a step per bucket as it comes, overlapping the rest of the backward pass).
Dense buckets go through torch's own allreduce on DDP's process group, or, with
`dense="topk"`, through the daemon as top-k values with error feedback. DDP stops dividing by
the world size once a hook is registered, so the hook averages. torch's DDP itself refuses a
sparse parameter left unused in a step (even with find_unused_parameters=True); for models
that have them, `sync_gradients` without DDP handles it.
"""

# no `from __future__ import annotations`: DDP checks comm_hook's annotations as objects
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zen.client import Client
from zen.errors import behind
from zen.fusion import fail, fuse_setting, settle


@dataclass
class _Held:
    buffer: torch.Tensor
    name: str
    result: torch.futures.Future[Any]  # Any: the stubs type set_exception's argument as the result
    backward_pass: int  # autograd's graph task: a bucket of an earlier pass left held was never sent


@dataclass
class HookState:
    """`HookState(client, ddp.module)`: the model names the buckets (the same on every rank)."""

    client: Client
    model: nn.Module
    dense: str = "torch"  # "torch": DDP's process group allreduces dense buckets; "topk": via the daemon
    topk_ratio: float = 0.01
    process_group: dist.ProcessGroup | None = None
    prefix: str = "ddp"  # give each DDP model of a job its own
    fuse: bool | None = None  # a pass's sparse buckets as one step at its last bucket (the module's text);
    # default: yes, unless ZEN_FUSE=0
    error: BaseException | None = field(default=None, init=False)  # the zen error that failed a bucket
    _param_names: dict[int, str] = field(default_factory=dict)
    _held: list[_Held] = field(default_factory=list, init=False)  # sparse buckets waiting for the pass's last

    def __post_init__(self) -> None:
        self.fuse = fuse_setting(self.fuse, os.environ)
        if self.dense not in ("torch", "topk"):
            raise ValueError(f"dense={self.dense!r}: choose 'torch' or 'topk'")
        if not 0 < self.topk_ratio <= 1:
            raise ValueError(f"topk_ratio={self.topk_ratio} must be in (0, 1]")
        self._param_names = {id(p): n for n, p in self.model.named_parameters()}

    def reraise(self, cause: BaseException | None = None) -> None:
        """Raise the typed zen error (e.g. `zen.StepAborted`) that failed the last backward, if any
        (given DDP's RuntimeError as `cause`: only if it is that error's; a stale one is dropped).

        DDP hands a hook's failure to `backward()` as a RuntimeError; the training loop gets the
        typed one back with:

            try:
                loss.backward()
            except RuntimeError as exc:
                state.reraise(exc)  # zen.StepAborted, ...: redo the step from the same state
                raise               # not zen's
        """
        error, self.error = self.error, None
        if error is not None and behind(error, cause):
            raise error

    def bucket_name(self, bucket: dist.GradBucket) -> str:
        """From the bucket's parameters, not its index: DDP rebuilds its buckets after the first step."""
        names = [self._param_names.get(id(p), f"?{tuple(p.shape)}") for p in bucket.parameters()]
        key = ",".join(names)
        if len(key) > 150:
            digest = hashlib.blake2b(key.encode(), digest_size=4).hexdigest()
            key = f"{names[0]}..{names[-1]}({len(names)})#{digest}"
        return f"{self.prefix}.{key}"


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    name = state.bucket_name(bucket)
    if buffer.is_sparse and state.fuse:
        held = _hold(state, buffer, name)
        if bucket.is_last():
            _send_held(state)
        return _noting_errors(state, held)
    if state.fuse and bucket.is_last():  # DDP calls the hook in bucket order: nothing of this pass comes after
        _send_held(state)
    if buffer.is_sparse:
        return _noting_errors(state, state.client.allreduce_async(buffer, name=name, average=True))
    if state.dense == "topk":
        return _noting_errors(state, state.client.allreduce_async(buffer, name=name, average=True,
                                                                  topk=state.topk_ratio))
    group = state.process_group or dist.group.WORLD
    world = dist.get_world_size(group)
    work = dist.all_reduce(buffer.div_(world), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _hold(state: HookState, buffer: torch.Tensor, name: str) -> torch.futures.Future[torch.Tensor]:
    """Keep a sparse bucket for the pass's fused step; its future completes with that step."""
    backward_pass = torch._C._current_graph_task_id()
    stale = [h for h in state._held if h.backward_pass != backward_pass]
    if stale:  # its pass ended before its last bucket (a hook or the backward failed): it was never sent
        state._held = [h for h in state._held if h.backward_pass == backward_pass]
        for h in stale:
            fail([h.result], RuntimeError(
                f"zen.comm_hook: bucket {h.name!r} of an earlier backward pass was never sent: that pass stopped "
                "before its last bucket, or another backward pass ran inside it (reentrant activation "
                "checkpointing; HookState(fuse=False) or ZEN_FUSE=0 there)"))
    held = _Held(buffer, name, torch.futures.Future(), backward_pass)
    state._held.append(held)
    return held.result


def _send_held(state: HookState) -> None:
    """The held sparse buckets, in the order DDP gave them (the same on every rank), as one step per kind."""
    held, state._held = state._held, []
    if not held:
        return
    sums = state.client.allreduce_many_async([h.buffer for h in held], names=[h.name for h in held], average=True)
    settle(sums, [h.result for h in held], each=True)


def _noting_errors(state: HookState, future: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """The same future; a failure is also kept on `state` (DDP loses its type: see HookState.reraise)."""
    def note(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        try:
            return done.value()
        except BaseException as exc:
            state.error = exc
            raise
    return future.then(note)


def sync_gradients(model: nn.Module, client: Client, *, average: bool = True, topk: float | None = None,
                   prefix: str = "") -> None:
    """Sum (or average) every parameter's gradient across the job's trainers, all tensors at once.

    Sparse gradients stay sparse, fused into one step per dtype (`Client.allreduce_many`: the
    daemon's fixed cost and the commit's rounds per step are paid once); dense ones are
    summed densely, or top-k sparsified when `topk` is given, each in its own step, in flight
    meanwhile. Parameters without a gradient this step send an empty one (every trainer must
    take part in every tensor's step), so a parameter unused on one trainer still gets the
    others' gradient.
    """
    futures = []
    sparse: list[tuple[nn.Parameter, str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        grad = p.grad
        if grad is None:  # unused here: contribute nothing, but take part
            grad = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=p.device),
                                           torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                           p.shape) if _is_sparse_param(model, name) else torch.zeros_like(p)
        if grad.is_sparse and grad.sparse_dim() == 1:
            sparse.append((p, prefix + name, grad))
            continue
        kwargs = {"topk": topk} if topk is not None and not grad.is_sparse else {}
        futures.append((p, client.allreduce_async(grad, name=prefix + name, average=average, **kwargs)))
    if sparse:
        sums = client.allreduce_many([g for _, _, g in sparse], names=[n for _, n, _ in sparse], average=average)
        for (p, _, _), total in zip(sparse, sums, strict=True):
            p.grad = total
    for p, fut in futures:
        p.grad = fut.wait()


def _is_sparse_param(model: nn.Module, name: str) -> bool:
    module_name, _, _ = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return bool(getattr(module, "sparse", False))
