"""The daemon fixtures, shared."""

from tests.daemon.conftest import fresh_cluster  # noqa: F401
