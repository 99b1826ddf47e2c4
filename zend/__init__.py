"""zen: sparse gradient synchronisation with the ZEN scheme."""

from zend.protocol.version import DAEMON_VERSION as __version__

__all__ = ["__version__"]
