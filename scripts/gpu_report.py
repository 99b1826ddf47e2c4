"""The GPU checks' table: every test, its result and time (pytest's JUnit XML), and the GPU figures the
tests recorded ($ZEN_GPU_FIGURES, one JSON object a line: test, figure, value, unit).

    python scripts/gpu_report.py OUT/gpu-checks.xml [OUT/gpu-figures.jsonl ...]
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def results(xml_path: Path) -> list[tuple[str, str, float]]:
    """(test id, result, seconds) of each test case, or a row per file pytest could not collect."""
    rows = []
    for case in ET.parse(xml_path).iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = f"{kind}: {(found.get('message') or '').splitlines()[0][:70] if found.get('message') else ''}"
        rows.append((test, outcome, float(case.get("time", 0.0))))
    return rows


def figures(paths: list[Path]) -> dict[str, list[str]]:
    by_test: dict[str, list[str]] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            f = json.loads(line)
            by_test.setdefault(f["test"], []).append(f"{f['figure']} {f['value']:.4g} {f['unit']}")
    return by_test


def main() -> int:
    xml = Path(sys.argv[1])
    if not xml.exists():
        print(f"no JUnit report at {xml}: pytest did not get to write one")
        return 1
    rows, figs = results(xml), figures([Path(p) for p in sys.argv[2:]])
    print(f"{'test':<92} {'result':<28} {'s':>7}  GPU figures")
    for test, outcome, seconds in rows:
        short = test.replace("tests.gpu.", "")
        shown = figs.get(test.split("::")[-1], []) + figs.get(short, [])
        print(f"{short[:92]:<92} {outcome[:28]:<28} {seconds:7.1f}  {'; '.join(shown)}")
    counts: dict[str, int] = {}
    for _, outcome, _ in rows:
        counts[outcome.split(":")[0]] = counts.get(outcome.split(":")[0], 0) + 1
    print("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
