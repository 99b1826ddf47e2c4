"""The daemon's version, one place: the installed distribution's metadata (pyproject.toml)."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "zen-sync"


def _installed_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


DAEMON_VERSION = _installed_version()
