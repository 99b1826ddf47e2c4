"""The GPU check must work the first time a GPU is lent (issue 31): what it imports is on that machine, or
carried in. Here, without a GPU: every module the checks import comes from the standard library, the
project, the lent machine's image (scripts/gpu_wheels.py LENT_MACHINE_HAS) or the wheels
scripts/gpu_wheels.py fetches; and those wheels are recent enough for the generated stubs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.subprocess_env import with_project

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_preflight  # noqa: E402
import gpu_wheels  # noqa: E402

PROJECT = {"zend", "zen", "tests", "gpu_preflight", "gpu_wheels"}
# imported when present, and gone without when not (so absent on the machine is fine)
OPTIONAL = {"grpc_tools": "grpc._runtime_protos tries it", "cython_runtime": "made by any Cython extension"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.daemon
def test_every_module_the_gpu_checks_import_is_on_the_lent_machine_or_carried() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {list(gpu_preflight.NEEDED)!r}:\n    importlib.import_module(m)\n"
            "where = {m: getattr(sys.modules[m], '__file__', None)"
            " or next(iter(getattr(sys.modules[m], '__path__', [])), None)"
            " for m in {m.split('.')[0] for m in sys.modules} if m in sys.modules}\n"
            "print(json.dumps(where))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=with_project())
    assert done.returncode == 0, done.stderr[-3000:]
    where = json.loads(done.stdout.splitlines()[-1])
    tops = set(where)
    dists = metadata.packages_distributions()
    available = {_normal(n) for n in gpu_wheels.LENT_MACHINE_HAS} | {_normal(n) for n in gpu_wheels.CARRIED}
    unmet = {}
    for top in sorted(tops - set(sys.stdlib_module_names) - PROJECT - set(sys.builtin_module_names)):
        if (top.startswith("_") and top not in dists) or top in OPTIONAL:  # CPython's own (_ssl, ...); optional
            continue
        owners = {_normal(d) for d in dists.get(top, [])}
        if not owners and where[top] and "/site-packages/" in where[top]:  # vendored inside a distribution
            owners = {_normal(d) for d in dists.get(where[top].split("/site-packages/")[1].split("/")[0], [])}
        if not owners & available:
            unmet[top] = sorted(owners) or ["(no distribution found)"]
    assert not unmet, f"imported by the GPU checks, but neither on the lent machine nor carried: {unmet}"


@pytest.mark.inprocess
def test_the_carried_grpcio_and_protobuf_are_what_the_stubs_were_generated_for() -> None:
    """The wheels carried to the GPU machine satisfy the project's own floors (pyproject.toml), which
    are those of the tools the stubs were generated with."""
    import tomllib

    from packaging.requirements import Requirement

    declared = {Requirement(r).name: Requirement(r).specifier
                for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    carried = dict(line.split("==") for line in gpu_wheels.pinned())
    for name in ("grpcio", "protobuf"):
        assert declared[name].contains(carried[name]), (name, carried[name], str(declared[name]))
    assert "Protobuf Python Version: 4.25" in (ROOT / "zend/api/zen/v1/zen_pb2.py").read_text()


@pytest.mark.daemon
def test_the_gpu_check_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_checks.sh")]).returncode == 0
