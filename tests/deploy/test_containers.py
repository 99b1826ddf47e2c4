"""The real image and the real docker-compose.yml, run: daemons, trainers and Prometheus in containers.

Builds the base image offline (cached between runs), the zend image from a wheelhouse and a
Prometheus image from Debian's package, then brings up the compose file's daemons, trainers and
Prometheus (Grafana has no offline source and stays out). Checks: the daemons turn healthy, run
non-root on a read-only root filesystem, the default image has no UCX and its daemons take TCP
under `--transport auto`, the trainers train to the end with falling loss, a known gradient from a
trainer container comes back as its exact sum (through the daemon's memfd buffers on the shared
/run/zend volume), Prometheus has both daemons' step and byte series and the alert rules, and the
daemons compiled no numba kernel (they load those the image compiled when it was built). Then
`down -v`, the test's images removed, and a dockerd it started stopped with the host restored
(docker_host). Run by `make test` after the rest of the suite; its figures are written to
build/deploy_test.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import docker_host
from tests.deploy.docker_host import docker
from tests.helpers import poll_for
from zend.cluster.local import free_port

ROOT = Path(__file__).resolve().parents[2]
ZEND_IMAGE, PROMETHEUS_IMAGE = "zen-ci-zend:test", "zen-ci-prometheus:test"
STEPS = 30
WHEELHOUSE = "build/wheelhouse"  # inside the build context, which is the repository
# a container or Prometheus not answering yet: poll again a second later
RETRY: dict[str, Any] = {"interval_s": 1.0, "ignore": (OSError, AssertionError, KeyError)}

# pytest-timeout counts the fixtures' setup: the first test builds the base, the wheelhouse and both images
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800),
              pytest.mark.skipif(docker_host.why_no_docker() is not None, reason=str(docker_host.why_no_docker()))]


class Compose:
    """docker-compose (Debian's 1.29) on the repository's docker-compose.yml, as project `name`."""

    def __init__(self, name: str, env: dict[str, str]):
        self.name, self.env = name, {**os.environ, **env}

    def argv(self, *args: str) -> list[str]:
        return ["docker-compose", "-p", self.name, "-f", str(ROOT / "docker-compose.yml"), *args]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        run = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, env=self.env, cwd=ROOT)
        if check and run.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args[:2])} failed:\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
        return run

    def container(self, service: str) -> str:
        ids = self("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]


def health(container: str) -> str:
    return docker("inspect", "-f", "{{.State.Health.Status}}", container).stdout.strip()


def prometheus_query(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The engine, the cached base, the zend and Prometheus images; removed again at the end
    (the base stays cached). Yields the build figures."""
    work = tmp_path_factory.mktemp("docker")
    with docker_host.docker_engine(work) as started:
        figures: dict[str, Any] = {"dockerd_started_by_test": started}
        try:
            t = time.monotonic()
            figures["base_cached"] = docker_host.ensure_base_image(work)
            figures["base_s"] = round(time.monotonic() - t, 1)
            t = time.monotonic()
            # TORCH_INDEX empty: torch's CPU index cannot be reached from our machines (pip would retry it for
            # every package); their pip finds torch's CPU build in its own configuration, as asserted below
            wheels = subprocess.run([str(ROOT / "scripts/build_wheelhouse.sh"), WHEELHOUSE], capture_output=True,
                                    text=True, timeout=900, cwd=ROOT, env={**os.environ, "TORCH_INDEX": ""})
            assert wheels.returncode == 0, wheels.stderr[-3000:]
            assert list((ROOT / WHEELHOUSE).glob("torch-*+cpu-*.whl")), "the default image's torch is the CPU build"
            figures["wheelhouse_s"] = round(time.monotonic() - t, 1)
            t = time.monotonic()
            docker("build", "-q", "-f", "deploy/Dockerfile", "--build-arg", f"BASE_IMAGE={docker_host.BASE_IMAGE}",
                   "--build-arg", f"WHEELHOUSE={WHEELHOUSE}", "-t", ZEND_IMAGE, ".", cwd=ROOT, timeout=1200)
            figures["zend_build_s"] = round(time.monotonic() - t, 1)
            figures["zend_image_mb"] = round(int(docker("image", "inspect", "-f", "{{.Size}}", ZEND_IMAGE).stdout)
                                             / 1e6)
            docker_host.build_prometheus_image(PROMETHEUS_IMAGE)
            yield figures
        finally:
            docker("image", "rm", "-f", ZEND_IMAGE, PROMETHEUS_IMAGE, check=False)
            docker("image", "prune", "-f", check=False)  # the build stage's layers: the image cache stays bounded


@pytest.fixture(scope="module")
def stack(images: dict[str, Any]) -> Iterator[tuple[Compose, int, dict[str, Any]]]:
    """The compose file's daemons, trainers and Prometheus, up; always `down -v` at the end."""
    port = free_port()
    compose = Compose(f"zendeploy{os.getpid()}", {
        "ZEND_IMAGE": ZEND_IMAGE, "PROMETHEUS_IMAGE": PROMETHEUS_IMAGE, "PROMETHEUS_PORT": str(port),
        "ZEN_TRAIN_STEPS": str(STEPS)})
    try:
        t = time.monotonic()
        compose("up", "-d", "--no-build", "zend-0", "zend-1", "prometheus")
        for service in ("zend-0", "zend-1"):
            container = compose.container(service)
            poll_for(lambda c=container: health(c) == "healthy", 120, f"{service} healthy", **RETRY)
        images["up_to_healthy_s"] = round(time.monotonic() - t, 1)
        yield compose, port, images
    finally:
        try:
            logs = compose("logs", "--no-color", "--tail", "200", check=False).stdout
            (ROOT / "build").mkdir(exist_ok=True)
            (ROOT / "build/deploy_test.log").write_text(logs)
        finally:
            compose("down", "-v", "--remove-orphans", "-t", "5", check=False)
            (ROOT / "build/deploy_test.json").write_text(json.dumps(images, indent=2))
        label = f"label=com.docker.compose.project={compose.name}"
        left, networks, volumes = (docker(*kind, "-q", "--filter", label).stdout.split()
                                   for kind in (("ps", "-a"), ("network", "ls"), ("volume", "ls")))
        assert not left and not networks and not volumes, \
            f"left behind: containers {left}, networks {networks}, volumes {volumes}"


def test_daemons_run_non_root_on_a_read_only_root_filesystem(stack: tuple[Compose, int, dict[str, Any]]) -> None:
    compose, _, _ = stack
    for service in ("zend-0", "zend-1"):
        container = compose.container(service)
        config = json.loads(docker("inspect", container).stdout)[0]
        assert config["HostConfig"]["ReadonlyRootfs"] is True
        assert docker("exec", container, "id", "-u").stdout.strip() == "10001"
        write = docker("exec", container, "touch", "/opt/zen/probe", check=False)
        assert write.returncode != 0 and "Read-only file system" in write.stderr, write


def test_trainer_containers_get_the_exact_sum_through_the_daemons_memfd_buffers(
        stack: tuple[Compose, int, dict[str, Any]]) -> None:
    compose, _, _ = stack
    check = ROOT / "tests/deploy/sum_check.py"
    procs = [subprocess.Popen(
        compose.argv("run", "--rm", "-T", "--no-deps", "-e", f"RANK={rank}", "-e", "ZEN_JOB=deploy-check",
                     "-v", f"{check}:/check/sum_check.py:ro", "--entrypoint", "sh", f"trainer-{rank}", "-c",
                     "export ZEN_JOB_TOKEN=$(zend token --job $ZEN_JOB) && exec python /check/sum_check.py"),
        env=compose.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, f"rank {rank}: {out}\n{err[-3000:]}"
        line = json.loads([x for x in out.splitlines() if x.startswith("{")][-1])
        assert line["sum_ok"] and line["row7"] == 3.0 and line["bytes_sent"] > 0, line  # 1 + 2, over the wire


def test_trainers_train_to_the_end_and_prometheus_sees_both_daemons(
        stack: tuple[Compose, int, dict[str, Any]]) -> None:
    compose, port, figures = stack
    t = time.monotonic()
    compose("up", "-d", "--no-build", "trainer-0", "trainer-1")
    trainers = [compose.container(f"trainer-{rank}") for rank in range(2)]
    codes = [int(docker("wait", c, timeout=900).stdout.strip()) for c in trainers]
    figures["trainers_s"] = round(time.monotonic() - t, 1)
    logs = [docker("logs", c) for c in trainers]
    assert codes == [0, 0], [f"exit {code}: {log.stderr[-2000:]}" for code, log in zip(codes, logs, strict=True)]
    rows = [json.loads(line) for line in logs[0].stdout.splitlines() if line.startswith("{")]  # rank 0 reports
    assert [r["step"] for r in rows] == list(range(STEPS))
    first, last = (sum(r["loss"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last < first, f"the loss does not fall: {first:.3f} over the first 5 steps, {last:.3f} over the last 5"
    assert all(0 < r["wire_bytes"] < r["dense_bytes"] for r in rows), "the embedding did not go through zend"
    figures["trainer_step_ms_median"] = round(sorted(r["seconds"] for r in rows[2:])[(STEPS - 2) // 2] * 1e3, 1)

    instances = {"zend-0:7071", "zend-1:7071"}

    def series(query: str) -> set[str]:
        result = prometheus_query(port, "query", query=query)["result"]
        return {r["metric"]["instance"] for r in result if float(r["value"][1]) > 0}

    # zen_tensor_steps_total counts tensor-steps; both daemons' series, after the trainers' last scrape
    poll_for(lambda: series("zen_tensor_steps_total") >= instances, 60, "both daemons' tensor-steps in Prometheus",
             **RETRY)
    poll_for(lambda: series("zen_sent_bytes_total") >= instances, 60, "both daemons' sent bytes in Prometheus", **RETRY)
    assert series('up{job="zend"}') >= instances
    rules = {rule["name"] for group in prometheus_query(port, "rules")["groups"] for rule in group["rules"]}
    assert {"ZenDaemonDown", "ZenPeerDown"} <= rules, rules


def test_the_default_image_has_no_ucx_and_its_daemons_take_tcp_under_auto(
        stack: tuple[Compose, int, dict[str, Any]]) -> None:
    compose, _, _ = stack
    for service in ("zend-0", "zend-1"):
        container = compose.container(service)
        probe = docker("exec", container, "python", "-c",
                       "import importlib.util; print(importlib.util.find_spec('ucxx'))")
        assert probe.stdout.strip() == "None", probe.stdout
        logs = docker("logs", container)
        assert "transport auto -> tcp: ucxx is not installed" in logs.stdout + logs.stderr, logs.stderr[-2000:]


def kernel_run(*env: str) -> tuple[float, str]:
    """`zend simulate` (every kernel a 2- and 4-node step runs) in a read-only container as compose runs the
    daemons, through the image's entry point; (seconds, numba's cache log)."""
    t = time.monotonic()
    run = docker("run", "--rm", "--read-only", "--tmpfs", "/tmp", "-e", "NUMBA_DEBUG_CACHE=1", *env, ZEND_IMAGE,
                 "simulate", "--nodes", "2,4", "--steps", "1", "--method", "exact", "--json", timeout=300)
    return time.monotonic() - t, run.stdout


def test_the_daemons_load_the_kernels_the_image_compiled_and_compile_none(
        stack: tuple[Compose, int, dict[str, Any]]) -> None:
    """Last: after the trainers' steps. The entry point copied the prebuilt kernels into the tmpfs
    cache; a compiled kernel would have been added to it."""
    compose, _, figures = stack
    for service in ("zend-0", "zend-1"):
        same = docker("exec", compose.container(service), "diff", "-r", "/opt/zen/numba-cache", "/tmp/numba",
                      check=False)
        assert same.returncode == 0, f"{service} compiled kernels:\n{same.stdout[-2000:]}{same.stderr[-500:]}"
    seconds, log = kernel_run()
    assert "[cache] data loaded" in log and "[cache] data saved" not in log, log[-2000:]
    figures["kernels_prebuilt_s"] = round(seconds, 1)
    # on a CPU they were not compiled for (here: numba told to compile for another), numba compiles them
    seconds, log = kernel_run("-e", "NUMBA_CPU_NAME=generic")
    assert "[cache] data saved" in log, log[-2000:]
    figures["kernels_compiled_s"] = round(seconds, 1)


def _status(container: str) -> dict[str, Any]:
    return dict(json.loads(docker("exec", container, "zend", "status", "--json").stdout))


def test_a_daemon_container_killed_alone_is_restarted_and_rejoins_while_the_other_runs_on(
        stack: tuple[Compose, int, dict[str, Any]]) -> None:
    """Elastic by default: zend-1's process killed -9, docker restarts that container alone (restart:
    unless-stopped), it rejoins through `zend store`, and zend-0 moves to a new generation of both nodes
    without restarting. Last in the file: it changes the stack's generation."""
    compose, _, figures = stack
    zend0, zend1 = compose.container("zend-0"), compose.container("zend-1")
    for c in (zend0, zend1):
        poll_for(lambda c=c: health(c) == "healthy", 120, f"{c[:12]} healthy before the kill", **RETRY)
    started0 = docker("inspect", "-f", "{{.State.StartedAt}}", zend0).stdout.strip()
    before = _status(zend0)["generation"]
    pid = int(docker("inspect", "-f", "{{.State.Pid}}", zend1).stdout)
    t = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # a crash, as docker sees it (a `docker kill` is a stop it would not undo)
    poll_for(lambda: int(docker("inspect", "-f", "{{.RestartCount}}", zend1).stdout) >= 1, 60,
             "docker restarting zend-1", **RETRY)
    poll_for(lambda: health(zend1) == "healthy", 180, "zend-1 healthy again", **RETRY)
    after = poll_for(lambda: (s := _status(zend0))["generation"] > before and s, 120,
                     "zend-0 in a new generation", **RETRY)
    figures["daemon_kill_to_new_generation_s"] = round(time.monotonic() - t, 1)
    assert after["node_count"] == 2 and _status(zend1)["generation"] == after["generation"], after
    assert docker("inspect", "-f", "{{.State.StartedAt}}", zend0).stdout.strip() == started0, "zend-0 restarted"
