"""A Docker engine for the container test, made to work offline, and the host left as it was found.

Nothing can be pulled from a registry on our machines, so the base image is made locally
(debootstrap of Debian bookworm with Python 3.11, then `docker import`) and kept in the engine's
store between runs; the zend image is built from a wheelhouse (scripts/build_wheelhouse.sh), and a
Prometheus image from Debian's prometheus package. A dockerd this module starts is stopped again,
and what it changed on the host (iptables, forwarding sysctls, the docker0 bridge) is put back.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BASE_IMAGE = "zen-ci-base:bookworm-py311"
BASE_PACKAGES = "python3.11,python3.11-venv,python3-distutils,ca-certificates"  # venv needs distutils to resolve
TABLES = ("filter", "nat", "mangle", "raw")
SYSCTLS = ("net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables")


def why_no_docker() -> str | None:
    """None where the container test can run here, else why not (and what installs it)."""
    if os.geteuid() != 0:
        return "needs root (it starts dockerd and debootstraps a base image)"
    missing = [tool for tool in ("docker", "docker-compose", "debootstrap", "iptables-save")
               if shutil.which(tool) is None]
    if shutil.which("dockerd") is None and not engine_answers():
        missing.append("dockerd")
    if missing:
        return f"needs {', '.join(missing)} (apt-get install docker.io docker-compose debootstrap; .ci/run does)"
    return None


def engine_answers() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=30).returncode == 0


def docker(*args: str, timeout: float = 600, check: bool = True, **kwargs: object) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    if check and run.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return run  # type: ignore[no-any-return]


@dataclass
class HostState:
    """What dockerd changes on the host, as it was before."""

    iptables: dict[str, str] = field(default_factory=dict)  # table -> iptables-save of it ("" if absent)
    sysctls: dict[str, str | None] = field(default_factory=dict)  # None: the key did not exist
    had_docker0: bool = False

    @classmethod
    def capture(cls) -> HostState:
        state = cls(had_docker0=Path("/sys/class/net/docker0").exists())
        for table in TABLES:
            dump = subprocess.run(["iptables-save", "-t", table], capture_output=True, text=True)
            state.iptables[table] = dump.stdout if dump.returncode == 0 and "*" + table in dump.stdout else ""
        for key in SYSCTLS:
            path = Path("/proc/sys") / key
            state.sysctls[key] = path.read_text().strip() if path.exists() else None
        return state

    def restore(self) -> list[str]:
        """Put the host back; returns what could not be (empty when all was)."""
        problems = []
        for table, dump in self.iptables.items():
            if dump:
                run = subprocess.run(["iptables-restore", "-T", table], input=dump, capture_output=True, text=True)
            else:  # the table did not exist before: empty it, policies back to ACCEPT
                run = subprocess.run(["sh", "-c", f"iptables -t {table} -F && iptables -t {table} -X"],
                                     capture_output=True, text=True)
                for chain in ("INPUT", "FORWARD", "OUTPUT", "PREROUTING", "POSTROUTING"):
                    subprocess.run(["iptables", "-t", table, "-P", chain, "ACCEPT"], capture_output=True)
            if run.returncode != 0:
                problems.append(f"iptables {table}: {run.stderr.strip()}")
        for key, value in self.sysctls.items():
            path = Path("/proc/sys") / key
            if path.exists():  # a bridge key that did not exist before: br_netfilter's filtering off again
                path.write_text(value if value is not None else "0")
        if not self.had_docker0 and Path("/sys/class/net/docker0").exists():
            subprocess.run(["ip", "link", "delete", "docker0"], capture_output=True)
        return problems


@contextlib.contextmanager
def docker_engine(log_dir: Path) -> Iterator[bool]:
    """A Docker engine that answers; yields whether this context started it. One it started is
    stopped at the end, and the host restored (HostState), also when the test fails."""
    if engine_answers():
        yield False
        return
    before = HostState.capture()
    with open(log_dir / "dockerd.log", "w") as log:
        dockerd = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not engine_answers():
                if dockerd.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"dockerd did not come up:\n{(log_dir / 'dockerd.log').read_text()[-3000:]}")
                time.sleep(0.5)
            yield True
        finally:
            dockerd.terminate()
            try:
                dockerd.wait(60)
            except subprocess.TimeoutExpired:
                dockerd.kill()
                dockerd.wait()
            problems = before.restore()
            if problems:
                raise RuntimeError(f"the host could not be restored after dockerd: {problems}")


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses (the only one reachable here)."""
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*.sources")]:
        if path.exists():
            match = re.search(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+/debian)/?\s*$", path.read_text(), flags=re.M)
            if match:
                return match.group(1)
    return "http://deb.debian.org/debian"


def ensure_base_image(work: Path) -> bool:
    """BASE_IMAGE in the engine's store; returns True if it was cached (made in an earlier run)."""
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return True
    rootfs = work / "rootfs"
    run = subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs),
                          debian_mirror()], capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"debootstrap failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    for junk in ("var/lib/apt/lists", "var/cache/apt", "usr/share/doc", "usr/share/man"):
        shutil.rmtree(rootfs / junk, ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    docker("import", "-", BASE_IMAGE, stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    return False


def build_prometheus_image(tag: str) -> None:
    """Debian's prometheus binary on BASE_IMAGE (tests/deploy/prometheus.Dockerfile)."""
    with tempfile.TemporaryDirectory(prefix="zen-prometheus-") as context:
        run = subprocess.run(["apt-get", "download", "prometheus"], cwd=context, capture_output=True, text=True,
                             timeout=300)
        debs = list(Path(context).glob("prometheus_*.deb"))
        if run.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download prometheus failed:\n{run.stderr[-2000:]}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), context], check=True)
        dockerfile = Path(__file__).with_name("prometheus.Dockerfile")
        docker("build", "-q", "-f", str(dockerfile), "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", tag, context)
