"""The `zend` command: each package contributes its subcommands; this only assembles them.

- zend.daemon.commands: `serve`, `status`, `health`, `token` (one node's daemon);
- zend.cluster.command: `cluster` (N daemons on this machine);
- zend.simulator.command: `simulate` (every scheme in one process).
Each `add_commands(subparsers)` gives its parsers a `run(args) -> exit code`.

Building the parser must stay cheap: `zend --help`, `zend --version` and `zend token` build all of
it, so the command modules import torch, numpy, numba and gRPC only inside the `run` that needs
them (tests/test_cli_ergonomics.py checks; benchmarks/cli_startup.py times it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

CONTRIBUTORS = ("zend.simulator.command", "zend.daemon.commands", "zend.cluster.command", "zend.cluster.launch")
# what the daemon's commands import that a trainer's install (`pip install zen-sync`) lacks
DAEMON_EXTRA = frozenset({"numba", "llvmlite", "cryptography", "prometheus_client", "grpc_reflection"})


def build_parser() -> argparse.ArgumentParser:
    from zend.protocol.version import daemon_version

    parser = argparse.ArgumentParser(prog="zend", description="zen: sparse gradient synchronisation (ZEN scheme)")
    parser.add_argument("--version", action="version", version=f"zend {daemon_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in CONTRIBUTORS:  # imported when the parser is built, not when zend.cli is imported
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in DAEMON_EXTRA:
            raise
        print(f"zend {args.command}: needs the daemon's dependencies, and {exc.name} is not installed: "
              "pip install 'zen-sync[daemon]'", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
