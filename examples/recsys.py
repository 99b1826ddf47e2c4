"""A recommendation model on MovieLens-100k with sparse embedding tables, trained data-parallel.

Real ratings (943 users, 1,682 movies), real side features: the user's gender, age band and
occupation, the movie's genres, and the movie's neighbours in a Freebase knowledge graph
(actors, directors, writers, awards...: 34,628 entities). Five embedding tables, each
`sparse=True`, feed an MLP that predicts the rating (MSE), or with `--objective click` whether
the user liked the movie (rating >= 4, BCE). DDP on every rank, plain SGD.

  --backend zen         sparse tables through the node's zend daemon (zen.comm_hook), dense
                        buckets (the MLP) through gloo
  --backend gloo        plain DDP; torch's own sparse allreduce (an allgather) for the tables
  --backend gloo-dense  plain DDP with dense tables (sparse=False): every row, every step

    python scripts/fetch_movielens.py     # once: the data (MovieLens terms: examples/data/README.md)
    # everything on this machine: a local zend cluster and NODES x TRAINERS ranks
    python examples/recsys.py --launch --nodes 2 --trainers 2 --backend zen --steps 100
    # one rank of a real job (torchrun's variables, and the sidecar's ZEN_* ones)
    python examples/recsys.py --backend zen --steps 100

Each rank draws its own batches of ratings (seeded by seed, rank and step). Each step prints
(rank 0) the loss, the step time and, with zen, the bytes rank 0's node put on the wire for the
tables against a dense allreduce of them; `--json` prints one JSON line per step, with the
figures per table.
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from reporting import report_step, report_summary  # examples/reporting.py
from torch import nn

DATA = Path(__file__).resolve().parent / "data" / "ml-100k"
AGE_BANDS = (18, 25, 35, 45, 50, 56)  # MovieLens' own bands: under 18, 18-24, ..., 56 and over
TABLES = ("users", "items", "user_features", "genres", "entities")


# ---------------------------------------------------------------------------------------------- data
@dataclass
class Bags:
    """A variable-length list of ids per row, CSR style: row r's ids are ids[ptr[r]:ptr[r + 1]]."""

    ptr: np.ndarray
    ids: np.ndarray

    @classmethod
    def of(cls, lists: list[list[int]]) -> Bags:
        ptr = np.zeros(len(lists) + 1, dtype=np.int64)
        ptr[1:] = np.cumsum([len(x) for x in lists])
        return cls(ptr, np.fromiter((i for x in lists for i in x), dtype=np.int64, count=int(ptr[-1])))

    def take(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat ids, offsets) of `rows`, as nn.EmbeddingBag takes them."""
        starts, lengths = self.ptr[rows], self.ptr[rows + 1] - self.ptr[rows]
        offsets = np.zeros(len(rows), dtype=np.int64)
        offsets[1:] = np.cumsum(lengths)[:-1]
        flat = np.concatenate([self.ids[s:s + n] for s, n in zip(starts, lengths, strict=True)])
        return torch.from_numpy(flat), torch.from_numpy(offsets)


@dataclass
class MovieLens:
    ratings: np.ndarray        # (100000, 3) int64: user row, item row, rating 1..5
    user_features: np.ndarray  # (943, 3) int64: gender, age band, occupation (one id space of 30)
    genres: Bags               # per item: genre ids
    entities: Bags             # per item: its KG entity and the entity's neighbours (empty if unlinked)
    sizes: dict[str, int]      # rows of each table

    @classmethod
    def load(cls, root: Path = DATA) -> MovieLens:
        names = ["ml-100k.inter", "ml-100k.item", "ml-100k.user", "ml-100k.link", "ml-100k.kg"]
        absent = [n for n in names if not (root / n).is_file()]
        if absent:
            raise SystemExit(f"MovieLens-100k is not in {root} ({', '.join(absent)} missing): "
                             "run `python scripts/fetch_movielens.py` first")

        def rows(name: str) -> list[list[str]]:
            lines = (root / name).read_text(encoding="utf-8").splitlines()[1:]  # a typed header first
            return [line.split("\t") for line in lines if line]

        # user, item, rating, timestamp: all numbers; users and items become rows 0.. in id order
        body = (root / "ml-100k.inter").read_text(encoding="utf-8").split("\n", 1)[1]
        inter = np.array(body.split(), dtype=np.float64).astype(np.int64).reshape(-1, 4)
        user_ids, user_index = np.unique(inter[:, 0], return_inverse=True)
        users = {str(u): i for i, u in enumerate(user_ids)}
        item_rows = rows("ml-100k.item")
        items = {r[0]: i for i, r in enumerate(sorted(item_rows, key=lambda r: int(r[0])))}
        item_ids_sorted = np.array(sorted(int(m) for m in items))
        ratings = np.stack([user_index, np.searchsorted(item_ids_sorted, inter[:, 1]), inter[:, 2]], axis=1)

        genre_of = {r[0]: r[3].split() for r in item_rows}
        genre_ids = {g: i for i, g in enumerate(sorted({g for gs in genre_of.values() for g in gs}))}
        item_ids = sorted(items, key=items.__getitem__)
        genres = Bags.of([[genre_ids[g] for g in genre_of[m]] for m in item_ids])

        user_info = {r[0]: r for r in rows("ml-100k.user")}  # id: (id, age, gender, occupation, zip code)
        occupations = {o: i for i, o in enumerate(sorted({r[3] for r in user_info.values()}))}
        genders = {"F": 0, "M": 1}
        bands = len(AGE_BANDS) + 1
        features = np.array([(genders[user_info[u][2]],
                              len(genders) + bisect.bisect_right(AGE_BANDS, int(user_info[u][1])),
                              len(genders) + bands + occupations[user_info[u][3]])
                             for u in sorted(users, key=users.__getitem__)], dtype=np.int64)

        kg = rows("ml-100k.kg")
        entity_ids: dict[str, int] = {}
        neighbours: dict[int, set[int]] = {}
        for head, _, tail in kg:
            h, t = entity_ids.setdefault(head, len(entity_ids)), entity_ids.setdefault(tail, len(entity_ids))
            neighbours.setdefault(h, set()).add(t)
            neighbours.setdefault(t, set()).add(h)
        link = {m: entity_ids.setdefault(e, len(entity_ids)) for m, e in rows("ml-100k.link")}
        entities = Bags.of([[link[m], *sorted(neighbours.get(link[m], ()))] if m in link else [] for m in item_ids])

        sizes = {"users": len(users), "items": len(items), "user_features": len(genders) + bands + len(occupations),
                 "genres": len(genre_ids), "entities": len(entity_ids)}
        return cls(ratings, features, genres, entities, sizes)

    def batch(self, rank: int, step: int, size: int, seed: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s ratings for `step`: its own draw, the same on every run with this seed."""
        rng = np.random.default_rng([seed, rank, step])
        r = self.ratings[rng.integers(0, len(self.ratings), size)]
        user, item = r[:, 0], r[:, 1]
        genre_ids, genre_offsets = self.genres.take(item)
        entity_ids, entity_offsets = self.entities.take(item)
        return {"user": torch.from_numpy(user), "item": torch.from_numpy(item),
                "user_features": torch.from_numpy(self.user_features[user]),
                "genre_ids": genre_ids, "genre_offsets": genre_offsets,
                "entity_ids": entity_ids, "entity_offsets": entity_offsets,
                "rating": torch.from_numpy(r[:, 2]).float()}


# ---------------------------------------------------------------------------------------------- model
class Recommender(nn.Module):
    def __init__(self, sizes: dict[str, int], dim: int, hidden: int, sparse: bool):
        super().__init__()
        # the sparse gradients zen synchronises: one table per feature, each its own DDP bucket
        self.users = nn.Embedding(sizes["users"], dim, sparse=sparse)
        self.items = nn.Embedding(sizes["items"], dim, sparse=sparse)
        self.user_features = nn.EmbeddingBag(sizes["user_features"], dim, mode="mean", sparse=sparse)
        self.genres = nn.EmbeddingBag(sizes["genres"], dim, mode="mean", sparse=sparse)
        self.entities = nn.EmbeddingBag(sizes["entities"], dim, mode="mean", sparse=sparse)
        for name in TABLES:
            nn.init.normal_(getattr(self, name).weight, std=0.1)
        self.mlp = nn.Sequential(nn.Linear(5 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        x = torch.cat([self.users(b["user"]), self.items(b["item"]), self.user_features(b["user_features"]),
                       self.genres(b["genre_ids"], b["genre_offsets"]),
                       self.entities(b["entity_ids"], b["entity_offsets"])], dim=1)
        return self.mlp(x).squeeze(1)


def wire_bytes(client: Any, prefix: str) -> dict[str, int]:
    """The bytes this node sent for each table at the step just done (the daemon's figures).

    zen.comm_hook names a bucket PREFIX.<its parameters' names>; each table is a bucket of its own.
    """
    out = {}
    for table in TABLES:
        stats = client.last_stats(f"{prefix}.{table}.weight")
        if stats is not None:
            out[table] = int(stats.bytes_sent)
    return out


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nodes = max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    data = MovieLens.load(Path(args.data))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = Recommender(data.sizes, args.dim, args.hidden, sparse=args.backend != "gloo-dense")
    ddp = nn.parallel.DistributedDataParallel(model)
    client = None
    if args.backend == "zen":
        import zen

        client = zen.Client()
        ddp.register_comm_hook(zen.HookState(client, model, prefix="recsys"), zen.comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    # what a dense allreduce of each table would send from one node (the daemon's own reference)
    dense = {name: 2 * (nodes - 1) * data.sizes[name] * args.dim * 4 // nodes for name in TABLES}
    dense_bytes = float(sum(dense.values()))
    rows: list[dict[str, Any]] = []
    for step in range(args.steps):
        b = data.batch(rank, step, args.batch, args.seed)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = ddp(b)
        if args.objective == "click":
            loss = nn.functional.binary_cross_entropy_with_logits(out, (b["rating"] >= 4).float())
        else:
            loss = nn.functional.mse_loss(out, b["rating"])
        loss.backward()
        opt.step()
        seconds = time.perf_counter() - t0
        row: dict[str, Any] = {"step": step, "loss": loss.item(), "seconds": seconds}
        if client is not None:
            sent = wire_bytes(client, "recsys")
            row["wire_bytes"] = float(sum(sent.values()))
            row["tables"] = {name: {"wire_bytes": sent.get(name, 0), "dense_bytes": dense[name]} for name in TABLES}
        else:
            row["wire_bytes"] = float("nan")  # gloo: an allgather of indices and values, or every row
        row["dense_bytes"] = dense_bytes
        rows.append(row)
        if rank == 0:
            report_step(row, args.steps, "tables", args.json)
    if rank == 0 and not args.json:
        report_summary(rows, args.backend)
    if client is not None:
        client.close()
    dist.destroy_process_group()
    return rows


# ---------------------------------------------------------------------------------------------- launch
def launch(args: argparse.Namespace) -> int:
    """A local zend cluster (for --backend zen) and NODES x TRAINERS ranks of this script."""
    from zend.cluster import run_local_job

    MovieLens.load(Path(args.data))  # fail here, once, if the data is not there
    forward = [a for a in sys.argv[1:] if a != "--launch"]
    return run_local_job([sys.executable, __file__, *forward], args.nodes, args.trainers, "recsys",
                         with_zen=args.backend == "zen")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["zen", "gloo", "gloo-dense"], default="zen")
    p.add_argument("--objective", choices=["rating", "click"], default="rating",
                   help="rating: MSE on the rating (1-5); click: BCE on rating >= 4")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=64, help="ratings per rank and step")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="SGD's; default 0.1 for rating, 1.0 for click")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=str(DATA), help="the directory scripts/fetch_movielens.py fills")
    p.add_argument("--json", action="store_true")
    p.add_argument("--launch", action="store_true", help="start a local cluster and all ranks here")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2, help="ranks per node (with --launch)")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 0.1 if args.objective == "rating" else 1.0
    if args.launch:
        return launch(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
