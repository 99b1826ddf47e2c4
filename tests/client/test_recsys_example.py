"""Example (b), examples/recsys.py: MovieLens-100k, five sparse embedding tables, the same losses with zen as with gloo.

The data is fetched, not committed (its terms forbid redistribution): `python scripts/fetch_movielens.py`.
Without it this test fails, saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest

from tests.helpers import ROOT, RankCrashed, launch_ranks
from zend.cluster.local import LocalCluster

pytestmark = pytest.mark.daemon

STEPS = 50
RTOL = 1e-4  # relative, per step: both sum the same fp32 gradients, in different orders


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(2, tmp_path_factory.mktemp("recsys"), extra=["--log-format", "text", "--step-timeout-s",
                                                                   "60"]) as c:
        yield c


def reference_run(cluster: LocalCluster, command: list[str]) -> list[str]:
    """torch's own DDP + gloo, the reference the zen run is compared with. It crashed twice in CI, once
    with SIGSEGV inside torch and once with a rank gone (no zen code runs in those processes; 41
    reruns here were clean): a reference rank that dies by a signal gets one more run, and the
    warning says so. zen's run is never retried."""
    try:
        return launch_ranks(cluster, command, "recsys", per_node=2, timeout_s=300)
    except RankCrashed as crash:
        warnings.warn(f"the DDP+gloo reference crashed, run again: {crash}", stacklevel=1)
        return launch_ranks(cluster, command, "recsys", per_node=2, timeout_s=300)


def test_recsys_example_same_loss_with_zen_and_with_ddp_gloo(cluster: LocalCluster) -> None:
    """4 ranks (2 nodes x 2), 50 steps, same seed: rank 0's loss agrees at every step, and falls."""
    check = subprocess.run([sys.executable, str(ROOT / "scripts/fetch_movielens.py"), "--check"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        pytest.fail(f"MovieLens-100k is not fetched ({check.stderr.strip()}): run "
                    "`python scripts/fetch_movielens.py` (pip downloads the pinned recbole wheel and extracts it)",
                    pytrace=False)
    args = ["--steps", str(STEPS), "--batch", "32", "--dim", "8", "--hidden", "16", "--seed", "3", "--json"]
    script = [str(ROOT / "examples/recsys.py")]
    zen_out = launch_ranks(cluster, [*script, "--backend", "zen", *args], "recsys", per_node=2, timeout_s=300)
    gloo_out = reference_run(cluster, [*script, "--backend", "gloo", *args])
    zen_rows, gloo_rows = ([json.loads(line) for line in out[0].splitlines() if line.startswith("{")]
                           for out in (zen_out, gloo_out))  # rank 0's
    zen_losses, gloo_losses = [r["loss"] for r in zen_rows], [r["loss"] for r in gloo_rows]
    assert len(zen_losses) == len(gloo_losses) == STEPS
    for step, (a, b) in enumerate(zip(zen_losses, gloo_losses, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: zen {a} vs gloo {b}"
    first, last = sum(zen_losses[:10]) / 10, sum(zen_losses[-10:]) / 10
    assert last < first / 2, f"it does not learn: mean loss {first:.3f} over the first 10 steps, {last:.3f} last 10"
    # every table went through the daemon, sparse: the big KG table far below its dense size
    for row in zen_rows:
        assert set(row["tables"]) == {"users", "items", "user_features", "genres", "entities"}
        entities = row["tables"]["entities"]
        assert 0 < entities["wire_bytes"] < entities["dense_bytes"] / 4, row
