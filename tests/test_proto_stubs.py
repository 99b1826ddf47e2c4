"""The generated gRPC stubs in zend/api match proto/ (regenerate with scripts/gen_protos.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_current():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout


def test_the_check_fails_on_a_stale_stub(tmp_path):
    # a copy of the repository's proto/ and stubs with one stub edited must be caught
    import shutil

    for part in ("proto", "scripts", "zend/api"):
        shutil.copytree(ROOT / part, tmp_path / part)
    stub = tmp_path / "zend/api/zen/v1/zen_pb2.pyi"
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    run = subprocess.run([sys.executable, str(tmp_path / "scripts" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "zen_pb2.pyi" in run.stderr
