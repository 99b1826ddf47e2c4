"""The layers of docs/ARCHITECTURE.md, checked on the source: no import runs back up.

Every module's imports are read from its syntax tree (function-level and TYPE_CHECKING imports
included), and the packages a few entry points really load are checked in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the zen packages it may import (besides itself)
ALLOWED = {
    "zend.api": set(),
    "zend.core": set(),
    "zend.runtime": set(),
    "zend.buffers": set(),
    "zend.transport": {"zend.core"},
    "zend.protocol": {"zend.api", "zend.buffers", "zend.core"},
    "zend.daemon": {"zend.api", "zend.buffers", "zend.core", "zend.protocol", "zend.runtime", "zend.transport"},
    "zend.simulator": {"zend.core", "zend.runtime", "zend.transport"},
    "zend.cluster": {"zend.core", "zend.daemon", "zend.protocol", "zend.runtime", "zend.simulator"},
    "zen": {"zend.core", "zend.protocol"},
}
# what pure algorithm code must never reach: the network, gRPC, metrics, processes
NOT_IN_CORE = {"socket", "ssl", "selectors", "asyncio", "http", "urllib", "grpc", "grpc_health", "grpc_reflection",
               "prometheus_client", "ucxx", "subprocess", "multiprocessing", "google"}


def modules() -> dict[str, Path]:
    found = {}
    for base, top in ((ROOT, "zend"), (ROOT / "client", "zen")):
        for path in (base / top).rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module or "")
    return names


def package_of(module: str) -> str | None:
    """The layer a module belongs to: the longest ALLOWED key that is its prefix."""
    keys = [k for k in ALLOWED if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


@pytest.mark.inprocess
def test_every_module_of_zend_is_in_a_package_named_for_one_role():
    loose = sorted(m for m in modules() if package_of(m) is None)
    assert loose == ["zend", "zend.__main__", "zend.cli"], f"modules outside the packages: {loose}"


@pytest.mark.inprocess
@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    wrong = []
    for module, path in modules().items():
        if package_of(module) != package:
            continue
        for name in imports_of(path):
            if name.split(".")[0] not in ("zend", "zen"):
                continue  # the standard library and third parties: see the core test below
            target = package_of(name)
            if target is None:
                wrong.append(f"{module} imports {name}, which is in no package")
            elif target != package and target not in ALLOWED[package]:
                wrong.append(f"{module} imports {name} ({target})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.inprocess
def test_core_imports_no_network_grpc_or_prometheus_module():
    wrong = [f"{m} imports {name}" for m, path in modules().items() if package_of(m) == "zend.core"
             for name in imports_of(path) if name.split(".")[0] in NOT_IN_CORE]
    assert not wrong, "\n".join(wrong)


def _loaded_after(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    loaded: list[str] = json.loads(run.stdout.splitlines()[-1])
    return loaded


@pytest.mark.daemon
def test_the_client_never_loads_the_daemon():
    loaded = _loaded_after("import zen")
    assert "zend.protocol.session" in loaded
    assert not [m for m in loaded if m.startswith(("zend.daemon", "zend.transport", "zend.cluster"))]


@pytest.mark.daemon
def test_nothing_below_the_daemon_loads_it():
    loaded = _loaded_after("import zend.core.schemes, zend.transport.tcp, zend.transport.inproc, zend.buffers, "
                           "zend.protocol.session, zend.runtime.tuning")
    assert "zend.transport.tcp" in loaded
    assert not [m for m in loaded if m.startswith(("zend.daemon", "zend.cluster", "zend.simulator"))]
    core_only = _loaded_after("import zend.core, zend.core.schemes, zend.core.topk, zend.core.costmodel")
    above_core = ("zend.transport", "zend.daemon", "zend.buffers", "zend.protocol.session", "zend.protocol.layout")
    assert not [m for m in core_only if m.split(".")[0] in {"grpc", "prometheus_client", "ucxx"}
                or m.startswith(above_core)]


@pytest.mark.inprocess
def test_architecture_lists_every_module() -> None:
    """docs/ARCHITECTURE.md's "Every module" names each module of zend/ and client/zen (the generated
    gRPC stubs aside), and nothing that is gone."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    listed = set(re.findall(r"^\| `((?:zend|client/zen)/[\w/]+\.py)` \|", doc, re.MULTILINE))
    present = {str(p.relative_to(ROOT)) for top in (ROOT / "zend", ROOT / "client" / "zen") for p in top.rglob("*.py")
               if "api" not in p.relative_to(ROOT).parts[:2] and (p.name != "__init__.py" or p.read_text().strip())}
    assert not present - listed, f"modules missing from docs/ARCHITECTURE.md: {sorted(present - listed)}"
    assert not listed - present, f"docs/ARCHITECTURE.md lists modules that are gone: {sorted(listed - present)}"
