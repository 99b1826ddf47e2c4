"""How long the `zend` command takes to answer the commands that do no work: --help, --version, token.

Each command runs --runs times in a fresh `python -m zend` process (this interpreter; a throwaway
cluster secret for `token`), after one untimed run that warms the page cache; the table shows the
median, min and max wall time, beside a bare `python -c pass` for the interpreter's own start.
They stay fast only while building the parser imports no torch, numpy, numba or gRPC
(tests/test_cli_ergonomics.py checks that; this shows what it is worth). To time another
checkout, run this from outside the current one with that one's root on PYTHONPATH
(`python -m` looks in the working folder first).

    .venv/bin/python benchmarks/cli_startup.py [--runs 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "zend --help": ["-m", "zend", "--help"],
    "zend --version": ["-m", "zend", "--version"],
    "zend token": ["-m", "zend", "token", "--job", "bench"],
}


def time_once(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9, help="timed runs per command (default 9)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    env = {**os.environ, "ZEN_CLUSTER_SECRET": "cli-startup-benchmark-secret"}
    env.pop("ZEN_CLUSTER_SECRET_FILE", None)  # it would win over the variable
    rows = []
    for name, argv in COMMANDS.items():
        time_once(argv, env)  # warm-up: the first run reads the files from disk
        seconds = [time_once(argv, env) for _ in range(args.runs)]
        rows.append({"command": name, "runs": args.runs, "median_ms": statistics.median(seconds) * 1e3,
                     "min_ms": min(seconds) * 1e3, "max_ms": max(seconds) * 1e3})
    if args.json:
        print(json.dumps({"python": sys.version.split()[0], "cpus": os.cpu_count(), "rows": rows}))
        return 0
    print(f"wall time of a fresh process, {args.runs} runs each (python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cores)")
    print(f"{'command':<16} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for r in rows:
        print(f"{r['command']:<16} {r['median_ms']:>10.0f} {r['min_ms']:>8.0f} {r['max_ms']:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
