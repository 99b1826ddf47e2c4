"""zen: sparse gradient synchronisation with the ZEN scheme."""

from typing import Any

__all__ = ["__version__"]


def __getattr__(name: str) -> Any:  # zend.__version__, read from the distribution's metadata when asked
    if name == "__version__":
        from zend.protocol.version import daemon_version

        return daemon_version()
    raise AttributeError(f"module 'zend' has no attribute {name!r}")
