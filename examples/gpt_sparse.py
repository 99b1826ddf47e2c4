"""A GPT-style language model with a sparse token embedding, trained data-parallel on real English.

Jane Austen's novels in the real GPT-2 BPE (bundled with zend), next-token prediction, DDP on
every rank. With `--backend zen` the sparse embedding gradient goes through the node's zend
daemon (DDP comm hook, zen.comm_hook) and dense buckets through gloo; with `--backend gloo`
DDP allreduces everything with gloo, the embedding with torch's own sparse allreduce; with
`--backend gloo-dense` the embedding is an ordinary dense parameter.

    # everything on this machine: a local zend cluster and NODES x TRAINERS ranks
    python examples/gpt_sparse.py --launch --nodes 2 --trainers 2 --backend zen --steps 100
    # one rank of a real job (torchrun's variables, and the sidecar's ZEN_* ones)
    python examples/gpt_sparse.py --backend zen --steps 100

Each step prints (rank 0) the loss, the step time and the bytes rank 0's node put on the
wire for the embedding against a dense allreduce; `--json` prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from reporting import report_step, report_summary  # examples/reporting.py
from torch import nn

from zend.traces import GPT2_VOCAB, TokenTrace


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int, sparse: bool = True):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim, sparse=sparse)  # the sparse gradient zen synchronises
        self.positions = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


def train(args: argparse.Namespace) -> list[dict[str, float]]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = TinyGPT(GPT2_VOCAB, args.dim, args.layers, args.heads, args.context, args.backend != "gloo-dense")
    ddp = nn.parallel.DistributedDataParallel(model)
    client = None
    if args.backend == "zen":
        import zen

        client = zen.Client()
        ddp.register_comm_hook(zen.HookState(client, model, dense=args.dense, topk_ratio=args.topk), zen.comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    trace = TokenTrace.default(seqs=args.batch, seq_len=args.context + 1, seed=args.seed)
    rows: list[dict[str, float]] = []
    dense_bytes = 2 * (world - 1) / world * GPT2_VOCAB * args.dim * 4
    for step in range(args.steps):
        ids = torch.from_numpy(trace.batch(rank, step).astype("int64"))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = ddp(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, GPT2_VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        seconds = time.perf_counter() - t0
        row = {"step": step, "loss": loss.item(), "seconds": seconds}
        if client is not None:
            stats = client.last_stats("ddp.tokens.weight")  # zen.comm_hook names buckets by their parameters
            row["wire_bytes"] = float(stats.bytes_sent) if stats is not None else 0.0
        else:
            row["wire_bytes"] = float("nan")  # gloo's sparse allreduce: an allgather of indices and values
        row["dense_bytes"] = dense_bytes
        rows.append(row)
        if rank == 0:
            report_step(row, args.steps, "embedding", args.json)
    if rank == 0 and not args.json:
        report_summary(rows, args.backend)
    if client is not None:
        client.close()
    dist.destroy_process_group()
    return rows


def launch(args: argparse.Namespace) -> int:
    """A local zend cluster (for --backend zen) and NODES x TRAINERS ranks of this script."""
    from zend.cluster import run_local_job

    forward = [a for a in sys.argv[1:] if a != "--launch"]
    return run_local_job([sys.executable, __file__, *forward], args.nodes, args.trainers, "gpt",
                         with_zen=args.backend == "zen")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["zen", "gloo", "gloo-dense"], default="zen")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense", choices=["torch", "topk"], default="torch",
                   help="zen: dense buckets by gloo allreduce (torch) or top-k through the daemon (topk)")
    p.add_argument("--topk", type=float, default=0.01, help="fraction of dense values kept with --dense topk")
    p.add_argument("--json", action="store_true")
    p.add_argument("--launch", action="store_true", help="start a local cluster and all ranks here")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2, help="ranks per node (with --launch)")
    args = p.parse_args(argv)
    if args.launch:
        return launch(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
