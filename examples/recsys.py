"""A recommendation model on MovieLens-100k with sparse embedding tables, trained data-parallel.

Real ratings (943 users, 1,682 movies), real side features: the user's gender, age band and
occupation, the movie's genres, and the movie's neighbours in a Freebase knowledge graph
(actors, directors, writers, awards...: 34,628 entities). Five embedding tables, each
`sparse=True`, feed an MLP that predicts the rating (MSE), or with `--objective click` whether
the user liked the movie (rating >= 4, BCE). DDP on every rank, plain SGD.

  --backend zen         torch.distributed's "zen" backend: sparse tables through the node's zend
                        daemon, dense buckets (the MLP) through gloo
  --backend zen-hook    the same through zen.comm_hook on a gloo group
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
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


def wire_bytes(backend: str, client: Any, model: nn.Module, prefix: str) -> dict[str, int]:
    """The bytes this node sent for each table at the step just done (the daemon's figures).
    Each table is a DDP bucket of its own."""
    out = {}
    for table in TABLES:
        stats = last_stats(backend, client, model, f"{table}.weight", prefix)
        if stats is not None:
            out[table] = int(stats.bytes_sent)
    return out


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    data = MovieLens.load(Path(args.data))
    rank, world = join_job(args.seed, args.backend)
    nodes = max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    model = Recommender(data.sizes, args.dim, args.hidden, sparse=args.backend != "gloo-dense")
    ddp, client, hook = wrap(model, args.backend, prefix="recsys")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    # what a dense allreduce of each table would send from one node (the daemon's own reference)
    dense = {name: 2 * (nodes - 1) * data.sizes[name] * args.dim * 4 // nodes for name in TABLES}

    def batch_of(step: int) -> dict[str, torch.Tensor]:
        return data.batch(rank, step, args.batch, args.seed)

    def loss_of(b: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        out = ddp(b)
        if args.objective == "click":
            loss = nn.functional.binary_cross_entropy_with_logits(out, (b["rating"] >= 4).float())
        else:
            loss = nn.functional.mse_loss(out, b["rating"])
        loss.backward()
        opt.step()
        return loss

    def wire_of(client: Any) -> dict[str, Any]:
        sent = wire_bytes(args.backend, client, model, "recsys")
        return {"wire_bytes": float(sum(sent.values())),
                "tables": {name: {"wire_bytes": sent.get(name, 0), "dense_bytes": dense[name]} for name in TABLES}}

    return train_steps(args, rank, client, batch_of, loss_of, wire_of, float(sum(dense.values())), "tables", hook,
                       *model_state(model, opt))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--objective", choices=["rating", "click"], default="rating",
                   help="rating: MSE on the rating (1-5); click: BCE on rating >= 4")
    p.add_argument("--batch", type=int, default=64, help="ratings per rank and step")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="SGD's; default 0.1 for rating, 1.0 for click")
    p.add_argument("--data", default=str(DATA), help="the directory scripts/fetch_movielens.py fills")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 0.1 if args.objective == "rating" else 1.0
    if args.launch:
        MovieLens.load(Path(args.data))  # fail here, once, if the data is not there
        return launch(__file__, args, "recsys")
    train(args)
    return 0


if __name__ == "__main__":
    exit_process(main())
