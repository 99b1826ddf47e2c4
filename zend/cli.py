"""The `zend` command: each package contributes its subcommands; this only assembles them.

- zend.daemon.commands: `serve`, `status`, `health`, `token` (one node's daemon);
- zend.cluster.command: `cluster` (N daemons on this machine);
- zend.simulator.command: `simulate` (every scheme in one process).
Each `add_commands(subparsers)` gives its parsers a `run(args) -> exit code`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zend.cluster import command as cluster_command
from zend.daemon import commands as daemon_commands
from zend.simulator import command as simulator_command

CONTRIBUTORS = (simulator_command, daemon_commands, cluster_command)


def build_parser() -> argparse.ArgumentParser:
    from zend.protocol.version import daemon_version

    parser = argparse.ArgumentParser(prog="zend", description="zen: sparse gradient synchronisation (ZEN scheme)")
    parser.add_argument("--version", action="version", version=f"zend {daemon_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for contributor in CONTRIBUTORS:
        contributor.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
