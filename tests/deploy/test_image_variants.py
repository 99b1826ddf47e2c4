"""deploy/Dockerfile's three variants (CPU, UCX, CUDA), checked as far as it goes without an engine and a GPU.

test_containers.py builds and runs the default (CPU) variant for real, from a wheelhouse. Here: each
variant's stages, read from the Dockerfile with its build arguments (all start from a base with
Python 3.11 and install none; the extras and torch's index each variant asks for; the documented
commands name only arguments the Dockerfile has), and the UCX and CUDA variants' wheel sets,
resolved by pip exactly as their build asks (`pip install --dry-run --report`, from the package
index that pip is configured with here, its local mirror included; wheels are not fetched, only
their metadata). Not run here: building or starting the UCX and CUDA images (no index inside our
containers, no GPU and no RDMA NIC on CI), so neither a CUDA IPC transfer nor UCX in a container
is tested. The CPU variant's torch comes from torch's own CPU index, which our machines cannot
reach: its wheel set is the wheelhouse test_containers.py builds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy/Dockerfile"
VARIANTS = {"cpu": {}, "ucx": {"EXTRAS": "daemon,ucx"}, "cuda": {"TORCH_INDEX": ""}}
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # the Dockerfile's default TORCH_INDEX
GLIBC_OF_BASE = (2, 36)  # python:3.11-slim and the test's debootstrapped base: Debian bookworm


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def stages(build_args: dict[str, str]) -> list[dict[str, object]]:
    """Each stage of the Dockerfile under these build arguments: its base image, and its RUN commands
    with the build arguments in scope put in (as the shell would have them)."""
    result: list[dict[str, object]] = []
    global_args: dict[str, str] = {}
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "ARG":
            name, _, default = rest.partition("=")
            value = build_args.get(name, default)
            if not result:
                global_args[name] = value
            else:
                result[-1]["args"][name] = value  # type: ignore[index]
        elif word == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m[1]], rest.split()[0])
            result.append({"image": image, "args": {}, "runs": []})
        elif word == "RUN":
            scope: dict[str, str] = result[-1]["args"]  # type: ignore[assignment]
            result[-1]["runs"].append(expand(rest, scope))  # type: ignore[attr-defined]
    return result


def expand(command: str, scope: dict[str, str]) -> str:
    """The shell's ${NAME}, ${NAME:+word} and $NAME for the build arguments in scope."""
    def alternative(m: re.Match[str]) -> str:
        return expand(m[2], scope) if scope.get(m[1]) else ""

    command = re.sub(r"\$\{(\w+):\+([^}]*)\}", alternative, command)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: scope.get(m[1] or m[2], m[0]), command)


def pip_installs(variant: str) -> list[list[str]]:
    """The `pip install` commands of the build stage's index branch (no wheelhouse), as argument lists."""
    build = stages(VARIANTS[variant])[0]
    commands = []
    for run in build["runs"]:  # type: ignore[attr-defined]
        for part in re.split(r"&&|;|\bthen\b|\belse\b", run):
            words = shlex.split(part)
            if words[:2] == ["pip", "install"] and "--no-index" not in words:
                commands.append(words[2:])
    return commands


@pytest.mark.inprocess
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_starts_from_a_python_311_base_and_installs_no_python(variant: str) -> None:
    found = stages(VARIANTS[variant])
    assert len(found) == 2, "a build stage and the image"
    for stage in found:
        assert stage["image"] == "python:3.11-slim", stage["image"]
        for run in stage["runs"]:  # type: ignore[attr-defined]
            assert not re.search(r"apt-get install[^&;]*python", run), run  # Ubuntu 24.04 has no python3.11
    assert "command -v python3.11" in found[0]["runs"][0]  # type: ignore[index]  # a base without it: a clear error


@pytest.mark.inprocess
def test_variants_differ_only_in_extras_and_torchs_index() -> None:
    installs = {variant: pip_installs(variant) for variant in VARIANTS}
    assert installs["cpu"] == [
        ["--no-cache-dir", "--extra-index-url", CPU_INDEX, "-c", "constraints.txt", "torch"],
        ["--no-cache-dir", "-c", "constraints.txt", ".[daemon]"]], installs["cpu"]
    assert installs["ucx"] == [installs["cpu"][0], ["--no-cache-dir", "-c", "constraints.txt", ".[daemon,ucx]"]]
    assert installs["cuda"] == [["--no-cache-dir", "-c", "constraints.txt", "torch"], installs["cpu"][1]]
    # from a wheelhouse, the same extras
    wheelhouse_runs = [r for r in stages(VARIANTS["ucx"])[0]["runs"] if "--no-index" in r]  # type: ignore[attr-defined]
    assert len(wheelhouse_runs) == 1 and '"zen-sync[daemon,ucx]"' in wheelhouse_runs[0]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("ucxx") for r in extras["ucx"]) and not any("ucx" in r for r in extras["daemon"])


@pytest.mark.inprocess
def test_documented_commands_name_only_arguments_the_dockerfile_and_the_wheelhouse_script_take() -> None:
    text = DOCKERFILE.read_text()
    declared = {rest.partition("=")[0] for word, rest in instructions(text) if word == "ARG"}
    documented = set(re.findall(r"--build-arg (\w+)=", text))
    assert {"EXTRAS", "TORCH_INDEX", "WHEELHOUSE", "BASE_IMAGE"} <= documented <= declared, (documented, declared)
    defaults = {m[1]: m[2] for m in re.finditer(r"^ARG (\w+)=(\S*)$", text, flags=re.M)}
    script = (ROOT / "scripts/build_wheelhouse.sh").read_text()
    # the wheelhouse script takes the variant by the same names, with the same defaults
    assert f"extras=${{EXTRAS:-{defaults['EXTRAS']}}}" in script
    assert f"torch_index=${{TORCH_INDEX-{defaults['TORCH_INDEX']}}}" in script
    compose = (ROOT / "docker-compose.yml").read_text()
    assert set(re.findall(r"^\s+([A-Z_]+): \$\{ZEND_", compose, flags=re.M)) <= declared


def project_requirements(extras: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    return [*project["dependencies"], *(r for extra in extras.split(",") for r in optional[extra])]


def pip_configured(key: str) -> list[str]:
    """The values this machine's pip is configured with for `key` (extra-index-url, find-links)."""
    run = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    found = re.findall(rf"{key}='([^']*)'", run.stdout) + os.environ.get(f"PIP_{key.upper().replace('-', '_')}",
                                                                           "").split()
    return list(dict.fromkeys(url for value in found for url in value.split()))


def resolve(variant: str, tmp_path: Path) -> list[dict]:  # type: ignore[type-arg]
    """The wheels `pip install` would take for the variant's build from the index: torch under the
    variant's index, then the project's requirements with its extras, under constraints.txt. The
    package index and this machine's local mirror of it serve them. Torch's CPU index cannot be
    reached from our machines: the CPU build of the pinned torch stands in for it where pip's
    find-links here hold it; the other variants get no find-links (the image's pip has none)."""
    args = VARIANTS[variant]
    extras = args.get("EXTRAS", "daemon")
    torch_index = args.get("TORCH_INDEX", CPU_INDEX)
    local = [*(f"--extra-index-url={url}" for url in pip_configured("extra-index-url"))]
    if torch_index == CPU_INDEX:
        pinned = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), flags=re.M)
        links = [d for d in pip_configured("find-links")
                 if pinned and list(Path(d).glob(f"torch-{pinned[1]}+cpu-*.whl"))]
        if not links:
            pytest.skip("torch's CPU index cannot be reached from here, and pip's find-links hold no CPU build of "
                        "the pinned torch")
        local += [f"--find-links={d}" for d in links]
    elif torch_index:
        local.append(f"--extra-index-url={torch_index}")
    report = tmp_path / f"{variant}.json"
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
            str(report), "--only-binary", ":all:", "-c", str(ROOT / "constraints.txt"), *local,
            "torch", *project_requirements(extras)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_DEFAULT_TIMEOUT="60")
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    if run.returncode != 0 and "ResolutionImpossible" not in run.stderr and re.search(
            r"NewConnectionError|NameResolutionError|Could not fetch URL|Max retries exceeded", run.stderr):
        pytest.skip(f"the package index cannot be reached from here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(report.read_text())["install"]  # type: ignore[no-any-return]


def installable_on_the_base(wheel_url: str) -> bool:
    """A wheel for CPython 3.11 on x86_64 glibc <= the base's (or pure Python)."""
    name = wheel_url.rsplit("/", 1)[-1].split("#")[0]
    tags = name[:-4].split("-")[-3:]
    python, abi, platforms = tags
    if platforms == "any":
        return True
    ok_python = any(p in ("cp311", "py3", "py2.py3") or (p.startswith("cp3") and abi == "abi3")
                    for p in python.split("."))
    glibc = []
    for platform in platforms.split("."):
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", platform)
        if m:
            glibc.append((int(m[1]), int(m[2])))
        elif platform in ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"):
            glibc.append((2, 17))
    return ok_python and bool(glibc) and min(glibc) <= GLIBC_OF_BASE


@pytest.mark.daemon
def test_cuda_variant_resolves_to_torchs_cuda_build_with_the_cuda_runtime_as_wheels(tmp_path: Path) -> None:
    wheels = resolve("cuda", tmp_path)
    by_name = {w["metadata"]["name"].lower().replace("_", "-"): w for w in wheels}
    torch = by_name["torch"]["metadata"]
    pinned = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pinned and torch["version"] == pinned[1], torch["version"]  # no +cpu: the index's own build
    needs = " ".join(torch.get("requires_dist", []))
    assert "cuda" in needs and "nvidia" in needs, needs
    # the CUDA runtime, NCCL and cuDNN come as wheels: no CUDA base image is needed
    names = set(by_name)
    assert any(n.startswith("nvidia-cuda-runtime") for n in names), sorted(names)
    assert any(n.startswith("nvidia-nccl") for n in names) and any(n.startswith("nvidia-cudnn") for n in names)
    assert not any(n.startswith(("ucxx", "libucx")) for n in names)  # UCX only in the UCX variant
    assert {"numba", "cryptography", "prometheus-client", "grpcio-reflection"} <= names
    wrong = [w["download_info"]["url"] for w in wheels if not installable_on_the_base(w["download_info"]["url"])]
    assert not wrong, f"not installable on the Python 3.11 bookworm base: {wrong}"
    local = sorted(n for n, w in by_name.items() if w["download_info"]["url"].startswith("file:"))
    print(f"cuda variant: {len(wheels)} wheels, {len(local)} from the local mirror: {local}")


@pytest.mark.daemon
def test_ucx_variant_resolves_with_ucxx_and_its_ucx_libraries(tmp_path: Path) -> None:
    wheels = resolve("ucx", tmp_path)
    names = {w["metadata"]["name"].lower().replace("_", "-"): w["metadata"]["version"] for w in wheels}
    assert any(n.startswith("ucxx") for n in names) and any(n.startswith("libucx") for n in names), sorted(names)
    assert names["torch"].endswith("+cpu"), names["torch"]  # torch's CUDA 13 build conflicts with ucxx-cu12
    wrong = [w["download_info"]["url"] for w in wheels if not installable_on_the_base(w["download_info"]["url"])]
    assert not wrong, f"not installable on the Python 3.11 bookworm base: {wrong}"
