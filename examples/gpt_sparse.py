"""A GPT-style language model with a sparse token embedding, trained data-parallel on real English.

Jane Austen's novels in the real GPT-2 BPE (bundled with zend), next-token prediction, DDP on
every rank. With `--backend zen` (torch.distributed's "zen" backend) the sparse embedding
gradient goes through the node's zend daemon and dense buckets through gloo; `--backend zen-hook`
does the same with zen.comm_hook on a gloo group (and `--dense topk` top-k's the dense buckets
through zend too); with `--backend gloo`
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
from typing import Any

import torch
from common import (  # examples/common.py
    add_run_args,
    exit_process,
    join_job,
    last_stats,
    launch,
    model_state,
    train_steps,
    wrap,
)
from torch import nn

from zend.simulator.traces import GPT2_VOCAB, TokenTrace


class TinyGPT(nn.Module):
    """`sampled` > 0 makes the output layer an embedding too (sampled softmax, as the One Billion Word
    LSTMs do): logits only over the batch's targets plus `sampled` shared random negatives, so
    its gradient is row-sparse like the input's, and the sparse tables hold most parameters."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int, sparse: bool = True,
                 sampled: int = 0):
        super().__init__()
        self.vocab, self.sampled = vocab, sampled
        self.tokens = nn.Embedding(vocab, dim, sparse=sparse)  # the sparse gradient zen synchronises
        self.positions = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        if sampled:
            self.out = nn.Embedding(vocab, dim, sparse=sparse)
            nn.init.normal_(self.out.weight, std=dim**-0.5)  # logits of order 1, as a Linear head starts
        else:
            self.head = nn.Linear(dim, vocab, bias=False)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The cross-entropy of predicting `targets` (full softmax, or sampled)."""
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions[:n]
        h = self.norm(self.blocks(x, mask=self.mask[:n, :n], is_causal=True)).reshape(-1, x.shape[-1])
        if not self.sampled:
            return nn.functional.cross_entropy(self.head(h), targets.reshape(-1))
        negatives = torch.randint(0, self.vocab, (self.sampled,))
        candidates, where = torch.unique(torch.cat([targets.reshape(-1), negatives]), return_inverse=True)
        logits = h @ self.out(candidates).t()  # (tokens, candidates): only these rows get a gradient
        return nn.functional.cross_entropy(logits, where[: targets.numel()])


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    options = None
    if args.backend == "zen":
        import zen

        options = zen.distributed.Options(dense="topk" if args.dense == "topk" else None, topk_ratio=args.topk)
    rank, world = join_job(args.seed, args.backend, options)
    model = TinyGPT(GPT2_VOCAB, args.dim, args.layers, args.heads, args.context, args.backend != "gloo-dense",
                    args.sampled)
    if rank == 0 and not args.json:
        sparse = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        total = sum(p.numel() for p in model.parameters())
        print(f"{total:,} parameters, {sparse / total:.0%} in embedding tables", flush=True)
    ddp, client, hook = wrap(model, args.backend, dense=args.dense, topk_ratio=args.topk)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    trace = TokenTrace.default(seqs=args.batch, seq_len=args.context + 1, seed=args.seed)

    def batch_of(step: int) -> torch.Tensor:
        return torch.from_numpy(trace.batch(rank, step).astype("int64"))

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = ddp(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        return loss

    def wire_of(client: Any) -> dict[str, Any]:
        stats = last_stats(args.backend, client, model, "tokens.weight")
        return {"wire_bytes": float(stats.bytes_sent) if stats is not None else 0.0}

    dense_bytes = 2 * (world - 1) / world * GPT2_VOCAB * args.dim * 4
    return train_steps(args, rank, client, batch_of, loss_of, wire_of, dense_bytes, "embedding", hook,
                       *model_state(model, opt))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--sampled", type=int, default=0,
                   help="sampled softmax with this many negatives: the output layer a sparse embedding too")
    p.add_argument("--dense", choices=["torch", "topk"], default="torch",
                   help="zen: dense buckets by gloo allreduce (torch) or top-k through the daemon (topk)")
    p.add_argument("--topk", type=float, default=0.01, help="fraction of dense values kept with --dense topk")
    args = p.parse_args(argv)
    if args.launch:
        return launch(__file__, args, "gpt")
    train(args)
    return 0


if __name__ == "__main__":
    exit_process(main())
