"""The daemon's version, one place: the installed distribution's metadata (pyproject.toml).

Read on first use, not at import: importlib.metadata costs tens of milliseconds to load.
"""

from __future__ import annotations

import functools
from importlib import metadata

DISTRIBUTION = "zen-sync"


@functools.cache
def daemon_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
