"""What `pip install zen-sync` gives a trainer: the torch range CI tests (vendor builds of it kept), no
daemon dependency, no simulator trace; an SPDX license and its file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIRES = {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}


def _pinned(name: str) -> Version:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.split("#")[0].strip().startswith(f"{name}=="):
            return Version(line.split("==")[1].split("#")[0].strip())
    raise AssertionError(f"{name} is not pinned in constraints.txt")


@pytest.mark.inprocess
def test_the_torch_range_is_the_tested_one_and_keeps_vendor_builds_of_it() -> None:
    spec = REQUIRES["torch"].specifier
    tested = _pinned("torch")
    assert spec.contains(tested)
    for vendor in (f"{tested.base_version}a0+git1a2b3c4", f"{tested.base_version}+cpu", f"{tested.base_version}+cu130"):
        assert spec.contains(vendor, prereleases=True), vendor
    top = Version(re.search(r"^TORCH_TOP\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1))
    assert spec.contains(top)  # the torch_matrix.sh run of make test
    nxt = Version(f"{top.major}.{top.minor + 1}.0")
    assert not spec.contains(nxt) and not spec.contains(f"{nxt}a0", prereleases=True)  # untested: not declared


@pytest.mark.inprocess
def test_a_trainer_installs_no_daemon_dependency() -> None:
    daemon_only = {"numba", "llvmlite", "cryptography", "prometheus-client", "grpcio-reflection"}
    assert not daemon_only & set(REQUIRES), sorted(daemon_only & set(REQUIRES))
    extra = {Requirement(r).name for r in PROJECT["optional-dependencies"]["daemon"]}
    assert {"numba", "cryptography", "prometheus-client", "grpcio-reflection"} <= extra


@pytest.mark.inprocess
def test_the_wheel_leaves_the_trace_out_and_carries_the_license() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["exclude-package-data"]["zend.simulator"] == ["data/*"]
    assert not any(".npy" in p for pats in tool["package-data"].values() for p in pats)
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
