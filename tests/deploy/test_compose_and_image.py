"""docker-compose.yml and deploy/Dockerfile, checked without an engine (test_containers.py runs them).

The compose file is validated by Debian's docker-compose (`config` needs no engine), with its
images overridable by environment variables; the image's health check command runs against a
live daemon; every path the Dockerfile copies exists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def source(volume: str | dict) -> str:  # type: ignore[type-arg]
    """A volume's source, in docker-compose 1.x's short form (`src:dst[:mode]`) or the long one."""
    return volume["source"] if isinstance(volume, dict) else volume.split(":")[0]


@pytest.mark.daemon
@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="needs Debian's docker-compose (.ci/run installs it)")
def test_compose_file_validates_and_wires_daemons_trainers_prometheus_grafana():
    run = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    config = yaml.safe_load(run.stdout)
    services = config["services"]
    assert {"zend-store", "zend-0", "zend-1", "trainer-0", "trainer-1", "prometheus", "grafana"} <= set(services)
    assert services["zend-store"]["command"] == ["store", "--listen", "0.0.0.0:29500"]
    for i in range(2):
        daemon, trainer = services[f"zend-{i}"], services[f"trainer-{i}"]
        env = daemon["environment"]  # elastic: a daemon container that restarts alone rejoins
        assert (env["ZEND_ELASTIC"], env["ZEND_RENDEZVOUS"]) == ("1", "zend-store:29500"), env
        assert env["ZEND_LISTEN"] == f"tcp://zend-{i}:7000" and "ZEND_PEERS" not in env, env
        assert daemon["restart"] == "unless-stopped" and "zend-store" in daemon["depends_on"]
        assert daemon["environment"]["ZEND_RANK"] == str(i)
        # a trainer shares its own node's socket folder, and starts once that daemon is healthy
        assert [source(v) for v in daemon["volumes"]] == [source(v) for v in trainer["volumes"]]
        assert trainer["depends_on"][f"zend-{i}"]["condition"] == "service_healthy"
    for mount in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        assert Path(source(mount)).exists(), mount
    assert (ROOT / "deploy/compose/dev-cluster.secret").read_text().strip()
    assert services["zend-0"]["image"] == "zend:0.1.0" and services["prometheus"]["image"].startswith("prom/")
    assert services["zend-0"]["read_only"] is True and services["trainer-0"]["read_only"] is True


@pytest.mark.daemon
@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="needs Debian's docker-compose (.ci/run installs it)")
def test_compose_images_and_build_are_set_by_environment_variables():
    env = {"ZEND_IMAGE": "local/zend:x", "PROMETHEUS_IMAGE": "local/prom:y", "ZEND_BASE_IMAGE": "local/base:z",
           "ZEND_WHEELHOUSE": "build/wheelhouse", "PROMETHEUS_PORT": "19090", "ZEN_TRAIN_STEPS": "7"}
    run = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    assert services["zend-1"]["image"] == services["trainer-1"]["image"] == "local/zend:x"
    assert services["prometheus"]["image"] == "local/prom:y"
    assert services["zend-0"]["build"]["args"] == {"BASE_IMAGE": "local/base:z", "WHEELHOUSE": "build/wheelhouse"}
    assert "--steps 7 " in services["trainer-0"]["entrypoint"][-1]
    assert any("19090" in str(p) for p in services["prometheus"]["ports"])


@pytest.mark.inprocess
def test_compose_daemons_serve_metrics_to_prometheus_in_another_container():
    """zend binds its metrics to 127.0.0.1 unless told otherwise: Prometheus' container needs them on 0.0.0.0,
    and no daemon serves its Trainer service on TCP."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert any(f"zend-{i}:7071" in str(scrape) for i in range(2)), "prometheus.yml scrapes no zend"
    for i in range(2):
        env = services[f"zend-{i}"]["environment"]
        assert env["ZEND_METRICS_HOST"] == "0.0.0.0"
        assert env.get("ZEND_GRPC_LISTEN_TRAINERS", "0") == "0"


@pytest.mark.inprocess
def test_dockerfile_copies_what_exists_runs_as_non_root_and_checks_health():
    text = (ROOT / "deploy/Dockerfile").read_text()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.M):
        *sources, _ = line.split()
        for source in sources:  # a build argument stands for its default
            source = re.sub(r"\$\{(\w+)\}", lambda m: re.findall(rf"^ARG {m[1]}=(\S+)", text, flags=re.M)[0], source)
            assert (ROOT / source).exists(), f"COPY {source}: missing"
    assert re.search(r"^USER 10001", text, flags=re.M)
    assert 'HEALTHCHECK' in text and '"zend", "health"' in text
    assert "ARG BASE_IMAGE=" in text and "TORCH_INDEX" in text and "ARG WHEELHOUSE=" in text


@pytest.mark.daemon
def test_zend_health_command_answers_from_a_live_daemon(fresh_cluster, tmp_path):
    c = fresh_cluster(1, extra=["--log-format", "text"])
    ok = subprocess.run([sys.executable, "-m", "zend", "health", "--socket-dir", c.socket_dir(0)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    absent = subprocess.run([sys.executable, "-m", "zend", "health", "--socket-dir", str(tmp_path),
                             "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert absent.returncode == 1 and "UNAVAILABLE" in absent.stderr
