"""zen: sparse gradient synchronisation with the ZEN scheme."""

__version__ = "0.1.0"
