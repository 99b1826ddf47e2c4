"""`zend simulate`: every scheme on a real embedding-gradient trace, in one process (for zend.cli)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from zend.runtime.arguments import LazyChoices

# torch, numpy and numba only inside cmd_simulate and the argument checks: `zend --help` builds this parser too


def _dtype_names() -> list[str]:
    from zend.core import dtypes

    return sorted(dtypes.BY_SHORT)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: world sizes must be positive integers")
    return values


def _scheme_list(text: str) -> list[str]:
    from zend.core.schemes import SCHEMES

    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in SCHEMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scheme(s) {unknown or text!r}; choose from {', '.join(SCHEMES)}")
    return names


def _batch(text: str) -> tuple[int, int]:
    try:
        seqs, seq_len = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch {text!r} is not SEQSxLEN, e.g. 8x512") from None
    if seqs < 1 or seq_len < 1:
        raise argparse.ArgumentTypeError(f"batch {text!r}: both numbers must be positive")
    return seqs, seq_len


def add_commands(sub: Any) -> None:
    """Add `simulate` to the `zend` command's subparsers."""
    sim = sub.add_parser("simulate", help="run every scheme on a real embedding-gradient trace, in one process",
                         description="Run every scheme for several world sizes on traced embedding gradients "
                                     "and print the bottleneck traffic per scheme.")
    sim.add_argument("--tokens", default=None,
                     help=".npy of integer token ids (default: Jane Austen in GPT-2 BPE, bundled)")
    sim.add_argument("--vocab", type=int, default=None,
                     help="vocabulary size = embedding rows (default: GPT-2's, that of the bundled trace)")
    sim.add_argument("--batch", type=_batch, default=(8, 512), help="sequences x tokens per worker (default 8x512)")
    sim.add_argument("--dim", type=int, default=64, help="embedding width: values per row (default 64)")
    sim.add_argument("--dtype", choices=LazyChoices(_dtype_names), metavar="DTYPE", default="fp32",
                     help="value type: %(choices)s (default %(default)s)")
    sim.add_argument("--nodes", type=_int_list, default=None,
                     help="comma-separated world sizes (default 4,8,16,32,64,128)")
    sim.add_argument("--schemes", type=_scheme_list, default=None, help="comma-separated schemes (default: all)")
    sim.add_argument("--steps", type=int, default=2, help="steps per world size; bytes are averaged (default 2)")
    sim.add_argument("--seed", type=int, default=0, help="seeds the batches and the hash")
    sim.add_argument("--method", choices=["auto", "exact", "model"], default="auto",
                     help="exact: every rank exchanges real messages in this process; model: count every "
                          "message's size instead (any n, same bytes); auto (default): exact up to 128 ranks")
    sim.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    sim.set_defaults(run=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from zend.core import dtypes
    from zend.runtime.tuning import tune_allocator
    from zend.simulator.simulation import DEFAULT_SCHEMES, DEFAULT_WORLD_SIZES, as_json_rows, format_table, simulate
    from zend.simulator.traces import GPT2_VOCAB, TokenTrace, default_tokens_path, load_tokens

    if args.dim < 1 or args.steps < 1:
        raise SystemExit(f"zend simulate: --dim {args.dim} and --steps {args.steps} must be at least 1")
    if args.tokens is not None and args.vocab is None:
        raise SystemExit("zend simulate: --tokens needs --vocab (the embedding's number of rows)")
    try:
        tokens_path, vocab = (default_tokens_path(), args.vocab or GPT2_VOCAB) if args.tokens is None \
            else (args.tokens, args.vocab)
        tokens = load_tokens(tokens_path, vocab)
        trace = TokenTrace(tokens, vocab, seqs=args.batch[0], seq_len=args.batch[1], seed=args.seed)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"zend simulate: {exc}") from None
    tune_allocator()
    start = time.perf_counter()
    rows = simulate(trace, args.nodes or DEFAULT_WORLD_SIZES, args.schemes or DEFAULT_SCHEMES, args.dim,
                    dtypes.BY_SHORT[args.dtype].torch, args.steps, args.seed, args.method)
    if args.json:
        print(json.dumps(as_json_rows(rows), indent=1))
    else:
        print(f"trace {tokens_path}: vocab {vocab}, batch {args.batch[0]}x{args.batch[1]} per worker, "
              f"rows of {args.dim} x {args.dtype}, {args.steps} step(s), seed {args.seed}")
        print(format_table(rows))
        print("recv/sent: max over ranks (MB per step); /dense, /bound: bottleneck over dense ring allreduce and over "
              "the lower bound (docs/SCHEMES.md); push/load/pull: imbalance ratios (1.00 = even); "
              "same: every rank got identical bits (- where counted); how: exact (exchanged) or model "
              f"(counted, zend/simulator/traffic_model.py). {time.perf_counter() - start:.1f} s")
    return 0
