"""What the examples print on rank 0: a row per step (or a progress bar on a terminal), a summary."""

from __future__ import annotations

import json
import math
import sys
from typing import Any


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
