"""The environment a test gives the processes it starts: the project on their path, ahead of what was there.

Replacing PYTHONPATH would drop what the caller had on it: on the lent GPU machine, the wheels carried
in for the check (grpcio-health-checking, cryptography, ...) live only there, and the project is not
installed, so a rank started without them cannot import zen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_path(env: Mapping[str, str] | None = None) -> str:
    """PYTHONPATH with the repository and its client package first, then whatever `env` (or ours) had."""
    had = (os.environ if env is None else env).get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(ROOT), str(ROOT / "client"), had) if p)


def with_project(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A copy of `env` (default: ours) with `project_path` and `extra` set."""
    base = dict(os.environ if env is None else env)
    return {**base, "PYTHONPATH": project_path(base), **extra}
