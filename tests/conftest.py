import os

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)  # rank threads share two cores; intra-op threads only contend
settings.register_profile("zen", deadline=None, max_examples=40, print_blob=True)
# CI replays a fixed set of examples so that a landing never depends on the draw; local runs
# keep exploring new ones (that is how the empty-domain codec bug was found).
settings.register_profile("ci", parent=settings.get_profile("zen"), derandomize=True)
# `make test-fast`: the in-process tier in seconds, fewer examples a property; the whole suite
# (`make test`, plain pytest) keeps the profiles above.
settings.register_profile("fast", parent=settings.get_profile("zen"), max_examples=5)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "zen"))

# Every test is in exactly one tier (tests/test_tiers.py checks it): `inprocess` (pure and in-process:
# no subprocess, no daemon, no network namespace; `make test-fast` runs these), `daemon` (starts zend
# daemons or other processes), `netns` (network namespaces and tc, as root), `docker` (containers).
TIERS = ("inprocess", "daemon", "netns", "docker")
COLLECTED_TIERS = pytest.StashKey[dict[str, list[str]]]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the record covers every test collected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[COLLECTED_TIERS] = {
        item.nodeid: [m.name for m in item.iter_markers() if m.name in TIERS] for item in items}
