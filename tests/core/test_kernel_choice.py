"""One place per twin (issue 25): every hot operation picks the compiled kernel or its torch twin
in one function, which asks kernels.serves; nothing else asks whether the kernels run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from zend.core import kernels

pytestmark = pytest.mark.inprocess

ROOT = Path(__file__).resolve().parents[2]


def _asks_whether_kernels_run(path: Path) -> list[str]:
    """Calls of kernels.available() and imports of it, in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "available" and getattr(node.value, "id", "") == "kernels":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        if isinstance(node, ast.ImportFrom) and node.module == "zend.core.kernels" and any(
                a.name == "available" for a in node.names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_only_the_kernels_module_asks_whether_the_kernels_run():
    """Every hot operation asks kernels.serves, once, in its one dispatcher (kernels.py's table)."""
    askers = [hit for path in sorted((ROOT / "zend").rglob("*.py")) if path.name != "kernels.py"
              for hit in _asks_whether_kernels_run(path)]
    assert not askers, askers


def test_kernels_serve_cpu_tensors_unless_switched_off(monkeypatch):
    cpu = torch.zeros(3)
    assert kernels.INSTALLED and kernels.serves(cpu) and kernels.serves(cpu, cpu.long())
    assert not kernels.serves(cpu, torch.zeros(3, device="meta"))  # any tensor off the CPU: the twin
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    assert not kernels.serves(cpu)
