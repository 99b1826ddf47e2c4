"""The image's prebuilt numba kernels, checked without an engine (test_containers.py runs them in the image).

deploy/warm_kernels.py compiles the kernels into a cache folder at the image's build; here it fills a
folder the same way, and real daemons (the schemes the image's users run, every value type, sliced
and whole rows, COO and bitmap messages) then load every kernel from it and compile none. And
deploy/entrypoint.sh, the image's entry point, copies the prebuilt folder into numba's writable one
once, and asks for the CPU level it was compiled for only where this CPU has it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.subprocess_env import with_project
from zend.cluster.local import LocalCluster
from zend.core import dtypes, kernels

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.daemon,
              pytest.mark.skipif(not kernels.INSTALLED, reason="numba is not installed (the daemon extra)")]


def cpu_flags() -> set[str]:
    line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ":")
    return set(line.split(":", 1)[1].split())


# what deploy/entrypoint.sh asks of the CPU for each level
V3 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
      "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# as the image does (deploy/Dockerfile's NUMBA_CPU, deploy/entrypoint.sh): a CPU level, not this CPU's model
LEVEL = {"NUMBA_CPU_NAME": "x86-64-v3" if cpu_flags() >= V3 else "generic", "NUMBA_CPU_FEATURES": ""}


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder`, by its path, with a digest of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder filled by deploy/warm_kernels.py, as the image's build fills /opt/zen/numba-cache."""
    folder = tmp_path_factory.mktemp("numba-prebuilt")
    run = subprocess.run([sys.executable, str(ROOT / "deploy/warm_kernels.py")], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=with_project(NUMBA_CACHE_DIR=str(folder), **LEVEL))
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(list(folder.rglob("*.nbc"))) >= 13, run.stdout  # every kernel, some for several signatures
    return folder


def gradient(rank: int, num_rows: int, row_len: int, touched: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    rows = torch.randperm(num_rows, generator=g)[:touched].sort().values
    values = torch.randn(touched, row_len, generator=g).to(dtype)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (num_rows, row_len), check_invariants=True)


@pytest.mark.parametrize("scheme", ["auto", "zen", "dense"])
def test_daemons_load_every_kernel_from_the_prebuilt_cache_and_compile_none(
        prebuilt: Path, tmp_path: Path, scheme: str) -> None:
    import zen  # the trainers' client

    cache = tmp_path / "numba"
    shutil.copytree(prebuilt, cache)  # what the entry point does
    before = snapshot(cache)
    env = {"NUMBA_CACHE_DIR": str(cache), "NUMBA_DEBUG_CACHE": "1", **LEVEL}
    shapes = [(50_257, 64, 300), (1_000, 4, 3), (4_096, 1, 2_000), (512, 16, 500)]
    with LocalCluster(2, tmp_path / "c", extra=["--scheme", scheme, "--log-format", "text"], env=env) as c:
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                with zen.Client(c.socket_dir(r), job="warm", token=c.token("warm")) as client:
                    for value_type in dtypes.VALUE_TYPES:
                        for i, shape in enumerate(shapes):
                            for _ in range(2):
                                name = f"t{i}.{value_type.short}"
                                out = client.allreduce(gradient(r, *shape, value_type.torch), name=name)
                                expected = sum(gradient(k, *shape, value_type.torch).to_dense() for k in range(2))
                                assert torch.equal(out.to_dense(), expected), (shape, value_type)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        logs = [c.log_path(n).read_text(errors="replace") for n in range(2)]
    assert snapshot(cache) == before, "a daemon compiled a kernel the prebuilt cache lacks: " + ", ".join(
        sorted(set(snapshot(cache)) - set(before)))
    assert all("[cache] data loaded from" in log for log in logs), "the daemons ran no kernel from the cache"
    assert not any("[cache] data saved to" in log for log in logs)


ENTRYPOINT = ROOT / "deploy/entrypoint.sh"


def entrypoint(tmp_path: Path, **env: str) -> dict[str, str]:
    """Run deploy/entrypoint.sh with a `zend` on PATH that prints the environment it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "zend").write_text('#!/bin/sh\necho "args=$*"\nenv\n')
    (bin_dir / "zend").chmod(0o755)
    run = subprocess.run(["sh", str(ENTRYPOINT), "serve", "--x"], capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "args=serve --x"
    return dict(line.split("=", 1) for line in lines[1:] if "=" in line)


def test_entrypoint_copies_the_prebuilt_kernels_once_and_asks_for_their_cpu_level(tmp_path: Path) -> None:
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "tmp" / "numba"
    (prebuilt / "core_x").mkdir(parents=True)
    (prebuilt / "core_x" / "k.nbi").write_text("index")
    (prebuilt / "CPU_LEVEL").write_text("generic\n")  # every CPU runs it
    env = entrypoint(tmp_path, ZEN_NUMBA_PREBUILT=str(prebuilt), NUMBA_CACHE_DIR=str(cache))
    assert env["NUMBA_CPU_NAME"] == "generic" and env["NUMBA_CPU_FEATURES"] == ""
    assert (cache / "core_x" / "k.nbi").read_text() == "index"
    (cache / "core_x" / "k.nbi").write_text("numba added to it")  # a restart with the same folder keeps that
    entrypoint(tmp_path, ZEN_NUMBA_PREBUILT=str(prebuilt), NUMBA_CACHE_DIR=str(cache))
    assert (cache / "core_x" / "k.nbi").read_text() == "numba added to it"
    # the operator's choice stands; empty ZEN_NUMBA_PREBUILT: numba compiles, as with no prebuilt kernels
    assert entrypoint(tmp_path, ZEN_NUMBA_PREBUILT=str(prebuilt), NUMBA_CACHE_DIR=str(cache),
                      NUMBA_CPU_NAME="haswell")["NUMBA_CPU_NAME"] == "haswell"
    other = tmp_path / "other"
    assert "NUMBA_CPU_NAME" not in entrypoint(tmp_path, ZEN_NUMBA_PREBUILT="", NUMBA_CACHE_DIR=str(other))
    assert not other.exists()
    # a level this CPU lacks is not asked for (numba compiles for the CPU instead of crashing on it)
    (prebuilt / "CPU_LEVEL").write_text("x86-64-v4\n")
    got = entrypoint(tmp_path, ZEN_NUMBA_PREBUILT=str(prebuilt), NUMBA_CACHE_DIR=str(cache)).get("NUMBA_CPU_NAME")
    assert got == ("x86-64-v4" if cpu_flags() >= V4 else None)
    (prebuilt / "CPU_LEVEL").write_text("x86-64-v3\n")
    got = entrypoint(tmp_path, ZEN_NUMBA_PREBUILT=str(prebuilt), NUMBA_CACHE_DIR=str(cache)).get("NUMBA_CPU_NAME")
    assert got == ("x86-64-v3" if cpu_flags() >= V3 else None)
    assert os.access(ENTRYPOINT, os.X_OK), "the image copies it with its mode"
