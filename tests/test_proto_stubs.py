"""The generated gRPC stubs in zend/api match proto/ (regenerate with scripts/gen_protos.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parent.parent
TOOLS_VENV = ROOT / "build" / "protos-venv"


@pytest.fixture(scope="module")
def protoc_python() -> str:
    """A Python with the `protos` extra's grpcio-tools (the oldest supported: it pins protobuf<5, so
    not beside the project's own), in a venv of its own, made once."""
    (tools,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["protos"]
    python = TOOLS_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TOOLS_VENV)], check=True, timeout=120)
    subprocess.run([str(python), "-m", "pip", "install", "-q", tools], check=True, timeout=600)
    return str(python)


def test_generated_stubs_are_current(protoc_python):
    run = subprocess.run([protoc_python, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout


def test_the_check_fails_on_a_stale_stub(tmp_path, protoc_python):
    # a copy of the repository's proto/ and stubs with one stub edited must be caught
    import shutil

    for part in ("proto", "scripts", "zend/api"):
        shutil.copytree(ROOT / part, tmp_path / part)
    stub = tmp_path / "zend/api/zen/v1/zen_pb2.pyi"
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    run = subprocess.run([protoc_python, str(tmp_path / "scripts" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "zen_pb2.pyi" in run.stderr
