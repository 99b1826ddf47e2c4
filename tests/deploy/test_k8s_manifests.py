"""The Kubernetes manifests in deploy/k8s: valid for Kubernetes, and consistent with zend itself.

Every document of a core kind is validated offline, strictly (an unknown field fails), against
the Kubernetes schemas bundled in kubernetes-validate, for the oldest Kubernetes the manifests
support (1.29: native sidecars on by default, the pod-index label) and the newest bundled. The
PodMonitor is a prometheus-operator CRD whose schema is not bundled: it gets a structural check
of its own here (its apiVersion, a selector that matches every pod running zend, a port that
exists on them, the job label it gives fires the alert rules, with promtool). Beyond the schemas,
the checks tie the manifests to the code: zend's settings resolve from each pod's environment and
the ConfigMap, the probes hit the gRPC port zend listens on, the cluster secret arrives as a file,
and the DaemonSet's rank step works.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')")
import yaml  # noqa: E402  (a dependency of kubernetes-validate)

from zend.daemon.membership import NODE_RANK_VARIABLES  # noqa: E402
from zend.daemon.secret import SecretError, load_secret  # noqa: E402
from zend.daemon.settings import ENV_PREFIX, FIELDS, resolve  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
VERSIONS = ("1.29", "1.37")  # the oldest supported; the newest kubernetes-validate 1.37.0 bundles
CRDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}  # no bundled
# schema: checked structurally below
IMAGE = "ghcr.io/zen-sync/zend:0.1.0"
ZEND_UID = 10001
# what the downward API would give a pod: the second pod / node of the cluster
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.namespace": "zen", "spec.nodeName": "gpu-b",
                "metadata.labels['apps.kubernetes.io/pod-index']": "1",
                "metadata.annotations['batch.kubernetes.io/job-completion-index']": "1"}
RANK0_NODE_IP = "192.0.2.10"
JOB_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


FILES = sorted(p.relative_to(K8S).as_posix() for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))
DOCS = [(name, i, doc) for name in FILES for i, doc in enumerate(load(name))]


def one(name: str, kind: str, named: str | None = None) -> dict[str, Any]:
    found = [doc for doc in load(name) if doc["kind"] == kind and named in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"{name}: expected one {kind} {named or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def zend_container(spec: dict[str, Any]) -> dict[str, Any]:
    """The container that runs `zend serve` (a DaemonSet's main container or the native sidecar)."""
    found = [c for c in containers(spec) if c.get("args", [])[:1] == ["serve"]]
    assert len(found) == 1, f"expected one zend serve container, found {[c['name'] for c in found]}"
    return found[0]


def workloads() -> dict[str, dict[str, Any]]:
    return {"daemonset.yaml": one("daemonset.yaml", "DaemonSet"),
            "daemonset-hostnetwork.yaml": one("daemonset-hostnetwork.yaml", "DaemonSet"),
            "sidecar-statefulset.yaml": one("sidecar-statefulset.yaml", "StatefulSet"),
            "sidecar-job.yaml": one("sidecar-job.yaml", "Job")}


def config_toml() -> str:
    text: str = one("configmap.yaml", "ConfigMap")["data"]["zend.toml"]
    return text


def node_rank_module() -> dict[str, Any]:
    """The DaemonSet's init script, from the ConfigMap, as a module (its main() not run)."""
    namespace: dict[str, Any] = {"__name__": "node_rank"}
    exec(compile(one("configmap.yaml", "ConfigMap")["data"]["node-rank.py"], "node-rank.py", "exec"), namespace)
    return namespace


def node(name: str, rank: str | None, ip: str = "192.0.2.99") -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, **({"zen.dev/rank": rank} if rank is not None else {})}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"addresses": [{"type": "Hostname", "address": name}, {"type": "InternalIP", "address": ip}]}}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would set it: downward API values, $(VAR) expanded."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = FIELD_VALUES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = f"<{entry['name']} from a Secret>"
    return env


def pod_env(workload: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """env_of, plus what an Indexed Job's controller appends to every container (init ones too):
    JOB_COMPLETION_INDEX, from the pod's index annotation, unless the container sets it."""
    env = env_of(container)
    if workload["kind"] == "Job" and workload["spec"].get("completionMode") == "Indexed":
        env.setdefault("JOB_COMPLETION_INDEX", FIELD_VALUES[JOB_INDEX])
    return env


def zend_settings(name: str, workload: dict[str, Any], tmp_path: Path) -> Any:
    """zend's settings in this workload's pod: its environment, and the file ZEND_CONFIG names."""
    spec = pod_spec(workload)
    env = pod_env(workload, zend_container(spec))
    config = tmp_path / f"{name}.toml"
    if env["ZEND_CONFIG"] == "/etc/zend/zend.toml":
        config.write_text(config_toml())
    else:  # the DaemonSet: written by the node-rank init step
        init = next(c for c in spec["initContainers"] if c["name"] == "node-rank")
        assert init["command"][-1] == env["ZEND_CONFIG"]
        init_env = env_of(init)
        nodes = [node("gpu-a", "0", RANK0_NODE_IP), node(init_env["NODE_NAME"], "1")]
        config.write_text(node_rank_module()["node_config"](config_toml(), init_env["NODE_NAME"], nodes,
                                                            int(init_env["ZEND_WORLD_SIZE"]),
                                                            int(init_env["RENDEZVOUS_PORT"])))
    return resolve({}, env={**env, "ZEND_CONFIG": str(config)})


def ports(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in container.get("ports", [])}


def quantity(text: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert match, f"unreadable quantity {text!r}"
    return float(match.group(1)) * units.get(match.group(2), 1)


# ---------------------------------------------------------------------------------- schemas
@pytest.mark.inprocess
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "index", "doc"), DOCS, ids=[f"{n}:{i}:{d['kind']}" for n, i, d in DOCS])
def test_document_validates_against_the_kubernetes_schema(name: str, index: int, doc: dict, version: str) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # still true: else validate it here
            kubernetes_validate.validate(doc, version, strict=True)
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name} document {index} ({doc['kind']}): {'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.inprocess
def test_strict_validation_rejects_an_unknown_field() -> None:
    doc = copy.deepcopy(one("daemonset.yaml", "DaemonSet"))
    doc["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 7070}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[0], strict=True)


@pytest.mark.inprocess
def test_the_rdma_lines_uncommented_still_validate(tmp_path: Path) -> None:
    text = (K8S / "daemonset-hostnetwork.yaml").read_text()
    marked = [line for line in text.splitlines() if line.rstrip().endswith("# RDMA")]
    assert len(marked) >= 6, "the RDMA lines (transport, UCX library, device, IPC_LOCK) are marked # RDMA"
    uncommented = re.sub(r"(?m)^(\s*)# (.*?)\s*# RDMA$", r"\1\2", text)
    doc = next(d for d in yaml.safe_load_all(uncommented) if d and d["kind"] == "DaemonSet")
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)
    zend = zend_container(pod_spec(doc))
    assert zend["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    assert zend["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = env_of(zend)
    assert env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
    assert zend_settings("rdma", doc, tmp_path).transport == "ucx"


@pytest.mark.inprocess
def test_the_expected_resources_are_there() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, _, d in DOCS}
    assert {("Namespace", "zen"), ("ConfigMap", "zend-config"), ("Secret", "zen-cluster-secret"),
            ("DaemonSet", "zend"), ("StatefulSet", "zen-trainer"), ("Service", "zen-trainer"),
            ("Job", "zen-trainer-job"), ("Service", "zen-trainer-job"),
            ("PodMonitor", "zend"), ("PrometheusRule", "zend"), ("ServiceAccount", "zend"),
            ("ClusterRole", "zend-node-reader"),
            ("ClusterRoleBinding", "zend-node-reader")} <= kinds
    for _, _, doc in DOCS:
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "zen", f"{doc['kind']}/{doc['metadata']['name']}"


# ---------------------------------------------------------------------------------- PodMonitor
@pytest.mark.inprocess
def test_podmonitor_scrapes_every_zend_pod_on_its_metrics_port(tmp_path: Path) -> None:
    monitor = one("podmonitor.yaml", "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}, "only matchLabels is checked here"
    assert "zen" in monitor["spec"]["namespaceSelector"]["matchNames"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for name, workload in workloads().items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items(), f"{name}: the PodMonitor does not select its pods"
        port = ports(zend_container(pod_spec(workload))).get(endpoint["port"])
        assert port is not None, f"{name}: zend has no port named {endpoint['port']!r}"
        assert port["containerPort"] == zend_settings(name, workload, tmp_path).metrics_port
        assert port["containerPort"] != 9400, f"{name}: 9400 is the NVIDIA DCGM exporter's port on GPU nodes"
    for name in FILES:  # pods without zend are not selected
        for doc in load(name):
            if doc["kind"] in ("Job", "Deployment") and name not in workloads():
                labels = doc["spec"]["template"]["metadata"].get("labels", {})
                assert not selector["matchLabels"].items() <= labels.items(), f"{name} has no zend to scrape"


def scrape_job(monitor: dict[str, Any], pod_labels: dict[str, str]) -> str:
    """The job label prometheus-operator gives a PodMonitor's targets on a pod with these labels:
    the value of the pod label spec.jobLabel names, where that is set and not empty, else
    "<namespace>/<PodMonitor name>"."""
    default = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    label = monitor["spec"].get("jobLabel")
    return (pod_labels.get(label) or default) if label else default


@pytest.mark.daemon
@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package 'prometheus')")
def test_zen_daemon_down_fires_on_the_job_label_the_podmonitor_gives(tmp_path: Path) -> None:
    monitor = one("podmonitor.yaml", "PodMonitor")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [rule] = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]
              if r.get("alert") == "ZenDaemonDown"]
    series, expected = [], []
    for i, workload in enumerate(workloads().values()):
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        zend = zend_container(pod_spec(workload))
        # the target labels the operator writes for a PodMonitor: job, instance, namespace, pod, container
        labels = {"job": scrape_job(monitor, pod_labels),
                  "instance": f"10.1.2.{i + 1}:{ports(zend)[endpoint['port']]['containerPort']}",
                  "namespace": workload["metadata"]["namespace"], "pod": f"{workload['metadata']['name']}-{i}",
                  "container": zend["name"], "endpoint": endpoint["port"]}
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        series.append({"series": f"up{{{text}}}", "values": "1 1 0x5"})  # scraped, then down from 2m
        firing = {**labels, **rule["labels"], "alertname": rule["alert"], "alertstate": "firing"}
        expected.append({"labels": "ALERTS{" + ",".join(f'{k}="{v}"' for k, v in firing.items()) + "}",
                         "value": 1})
    tests = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
             "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
                 {"expr": f'ALERTS{{alertname="{rule["alert"]}",alertstate="firing"}}', "eval_time": "5m",
                  "exp_samples": expected}]}]}
    path = tmp_path / "podmonitor_alerts_test.yml"
    path.write_text(json.dumps(tests, indent=1))  # JSON is YAML
    assert PROMTOOL is not None
    run = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (f"{rule['alert']} ({rule['expr']}) does not fire on the PodMonitor's targets, "
                                 f"{[s['series'] for s in series]}:\n{run.stdout}{run.stderr}")


@pytest.mark.inprocess
def test_podmonitor_relabelings_keep_zends_own_labels() -> None:
    from zend.daemon.metrics import DaemonMetrics

    own = {label for metric in vars(DaemonMetrics(0)).values() for label in getattr(metric, "_labelnames", ())}
    assert "node" in own, "zen_node_info{node}: the daemon's labels are read here"
    monitor = one("podmonitor.yaml", "PodMonitor")
    targets = {r["targetLabel"] for e in monitor["spec"]["podMetricsEndpoints"] for r in e.get("relabelings", [])
               if "targetLabel" in r}
    assert "node" not in targets, "Prometheus would rename zen_node_info's node to exported_node"
    assert not targets & own, f"relabelled onto zend's own labels (they become exported_*): {targets & own}"
    # the operator's own target labels: job comes from jobLabel (scrape_job above reads it there)
    assert not targets & {"job", "instance", "namespace", "pod", "container", "endpoint"}


# ---------------------------------------------------------------------------------- settings
@pytest.mark.inprocess
def test_every_zend_and_zen_variable_named_is_one_the_code_reads() -> None:
    settings_vars = {ENV_PREFIX + name.upper() for name in FIELDS} | {ENV_PREFIX + "CONFIG"}
    sources = "\n".join(p.read_text() for d in ("zend", "client") for p in (ROOT / d).rglob("*.py"))
    for path in [*(K8S / name for name in FILES), K8S / "README.md"]:
        text = path.read_text()  # comments included: what operators are told to set must exist too
        for var in sorted(set(re.findall(r"\bZEND_[A-Z0-9_]+", text))):
            assert var in settings_vars, f"{path.name}: {var} is not a zend setting"
        for var in sorted(set(re.findall(r"\bZEN_[A-Z0-9_]+", text))):
            assert f'"{var}"' in sources, f"{path.name}: {var} is read nowhere in zend or the client"


@pytest.mark.inprocess
def test_the_configmap_toml_holds_only_settings_and_resolves(tmp_path: Path) -> None:
    data = tomllib.loads(config_toml())
    assert set(data) <= set(FIELDS), f"not settings: {sorted(set(data) - set(FIELDS))}"
    assert {"scheme", "socket_dir", "metrics_port", "step_timeout_s", "peer_timeout_s",
            "connect_timeout_s"} <= set(data)
    (tmp_path / "zend.toml").write_text(config_toml())
    settings = resolve({}, env={}, config_file=str(tmp_path / "zend.toml"))
    assert settings.socket_dir == "/run/zend"


@pytest.mark.inprocess
@pytest.mark.parametrize("name", sorted(workloads()))
def test_zend_resolves_its_settings_in_the_pod(name: str, tmp_path: Path) -> None:
    workload = workloads()[name]
    spec = pod_spec(workload)
    zend = zend_container(spec)
    s = zend_settings(name, workload, tmp_path)
    assert s.rank == 1 and s.listen == "tcp://10.1.2.3:7000"
    own = ports(zend)
    assert own["zen-data"]["containerPort"] == int(s.listen.rsplit(":", 1)[1])
    store_host, _, store_port = s.rendezvous.rpartition(":")
    assert own["zen-rdzv"]["containerPort"] == int(store_port)
    if workload["kind"] == "StatefulSet":
        sts, service = workload["metadata"]["name"], workload["spec"]["serviceName"]
        assert store_host == f"{sts}-0.{service}.{FIELD_VALUES['metadata.namespace']}.svc"
        assert s.world_size == workload["spec"]["replicas"]
    elif workload["kind"] == "Job":  # indexed pods are named <job>-<index>, in DNS under their subdomain
        job, subdomain = workload["metadata"]["name"], spec["subdomain"]
        assert store_host == f"{job}-0.{subdomain}.{FIELD_VALUES['metadata.namespace']}.svc"
        assert s.world_size == workload["spec"]["completions"]
    else:
        assert store_host == RANK0_NODE_IP and s.world_size == 2
        assert spec.get("hostNetwork", False) or own["zen-rdzv"]["hostPort"] == int(store_port), \
            "on the pod network, rank 0's store is reached at its node's IP through a hostPort"
    # Prometheus scrapes from another pod: the metrics must not stay on zend's default, 127.0.0.1
    assert s.metrics_host in ("0.0.0.0", FIELD_VALUES["status.podIP"]), s.metrics_host
    # the kubelet's gRPC probes: the port zend serves gRPC on, service "" (the overall health); the Trainer
    # service stays on the unix socket (trainers share /run/zend), never on that TCP port
    assert s.grpc_listen_trainers == 0
    grpc_port = int(s.grpc_listen.rsplit(":", 1)[1])
    assert own["zen-grpc"]["containerPort"] == grpc_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert zend[probe]["grpc"]["port"] == grpc_port, f"{probe} port is not ZEND_GRPC_LISTEN's"
        assert zend[probe]["grpc"].get("service", "") == ""
    startup = zend["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > s.connect_timeout_s, \
        "the startupProbe must outwait the rendezvous"
    assert spec["terminationGracePeriodSeconds"] > s.drain_timeout_s
    assert quantity(zend["resources"]["limits"]["memory"]) > s.max_pool_bytes
    assert s.threads <= quantity(zend["resources"]["requests"]["cpu"])


# ---------------------------------------------------------------------------------- the secret
@pytest.mark.inprocess
@pytest.mark.parametrize("name", sorted(workloads()))
def test_the_cluster_secret_is_a_mounted_file(name: str) -> None:
    secret = one("secret.yaml", "Secret", "zen-cluster-secret")
    spec = pod_spec(workloads()[name])
    zend = zend_container(spec)
    path = env_of(zend)["ZEN_CLUSTER_SECRET_FILE"]
    folder, _, key = path.rpartition("/")
    [mount] = [m for m in zend["volumeMounts"] if m["mountPath"] == folder]
    assert mount.get("readOnly") is True
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert key in {**secret.get("data", {}), **secret.get("stringData", {})}
    assert volume["secret"]["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"] == ZEND_UID
    for container in containers(spec):  # never in the environment, never on a command line
        assert "ZEN_CLUSTER_SECRET" not in {e["name"] for e in container.get("env", [])}
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            assert ref is None or ref["name"] != secret["metadata"]["name"], f"{container['name']}: {entry['name']}"
        assert "secret" not in " ".join(container.get("command", []) + container.get("args", [])).lower()


@pytest.mark.inprocess
def test_the_placeholder_secret_cannot_be_used_by_mistake(tmp_path: Path) -> None:
    placeholder = one("secret.yaml", "Secret", "zen-cluster-secret")["stringData"]["cluster-secret"]
    (tmp_path / "secret").write_text(placeholder)
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(str(tmp_path / "secret"))


# ---------------------------------------------------------------------------------- pods
@pytest.mark.inprocess
@pytest.mark.parametrize("name", [n for n in FILES if any(d["kind"] in ("DaemonSet", "StatefulSet", "Job")
                                                          for d in load(n))])
def test_pods_are_locked_down_and_sized(name: str) -> None:
    [workload] = [d for d in load(name) if d["kind"] in ("DaemonSet", "StatefulSet", "Job")]
    spec = pod_spec(workload)
    pod_security = spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["seccompProfile"]["type"] == "RuntimeDefault"
    for container in containers(spec):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        if container["image"] == IMAGE:
            assert security["readOnlyRootFilesystem"] is True
        if security.get("runAsUser", pod_security.get("runAsUser")) == 0:  # only the socket folder's chown
            assert container["name"] == "socket-dir" and security["capabilities"]["add"] == ["CHOWN"]
        else:
            assert security.get("capabilities", {}).get("add") is None
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
        assert "cpu" not in resources["limits"], "a CPU limit throttles the step"
    names = [c["name"] for c in containers(spec)]
    assert len(names) == len(set(names))
    port_names = [p["name"] for c in containers(spec) for p in c.get("ports", [])]
    assert len(port_names) == len(set(port_names))
    for port in port_names:  # IANA_SVC_NAME, which the schemas do not check
        assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", port) and len(port) <= 15 and re.search("[a-z]", port)
    volumes = {v["name"] for v in spec["volumes"]}
    for container in containers(spec):
        assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes, container["name"]
        defined: set[str] = set()
        for entry in container.get("env", []):  # the kubelet leaves an unknown $(VAR) as it is
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", entry.get("value", "")):
                assert ref in defined, f"{container['name']}: {entry['name']} uses $({ref}) before it is set"
            assert entry["name"] not in defined, f"{container['name']}: {entry['name']} twice"
            defined.add(entry["name"])
    for container in containers(spec):
        if container["image"].startswith("ghcr.io/zen-sync/"):
            assert container["image"] == IMAGE


def trainer_env_checks(trainer: dict[str, Any], socket_dir: str) -> None:
    env = env_of(trainer)
    assert env["ZEN_SOCKET_DIR"] == socket_dir
    token = next(e for e in trainer["env"] if e["name"] == "ZEN_JOB_TOKEN")["valueFrom"]["secretKeyRef"]
    secrets = {d["metadata"]["name"]: d for d in load("secret.yaml")}
    assert token["name"] in secrets, "the job token Secret is the one secret.yaml documents"
    assert secrets[token["name"]]["metadata"]["labels"]["zen.dev/job"] == env["ZEN_JOB"]
    assert token["key"] in secrets[token["name"]]["stringData"]
    assert {"LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= set(env)


@pytest.mark.inprocess
def test_the_sidecar_statefulset(tmp_path: Path) -> None:
    sts = one("sidecar-statefulset.yaml", "StatefulSet")
    spec = pod_spec(sts)
    zend = zend_container(spec)
    assert zend in spec["initContainers"] and zend["restartPolicy"] == "Always", "a native sidecar"
    assert sts["spec"]["podManagementPolicy"] == "Parallel", "pod 0 is ready only once every peer has joined"
    assert spec["automountServiceAccountToken"] is False
    service = one("service-headless.yaml", "Service")
    assert service["metadata"]["name"] == sts["spec"]["serviceName"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod_ports = {p["name"] for c in containers(spec) for p in c.get("ports", [])}
    for port in service["spec"]["ports"]:
        assert isinstance(port["targetPort"], int) or port["targetPort"] in pod_ports
    s = zend_settings("sidecar-statefulset.yaml", sts, tmp_path)
    [trainer] = spec["containers"]
    trainer_env_checks(trainer, s.socket_dir)
    env = env_of(trainer)
    assert int(env["WORLD_SIZE"]) == s.world_size == sts["spec"]["replicas"] and env["RANK"] == str(s.rank)
    # one folder shared by both containers, the sockets' group (0660) the trainer's too
    [zend_mount] = [m for m in zend["volumeMounts"] if m["mountPath"] == s.socket_dir]
    assert any(m["name"] == zend_mount["name"] for m in trainer["volumeMounts"])
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == zend_mount["name"])
    assert ZEND_UID in spec["securityContext"]["supplementalGroups"]
    assert not spec.get("hostIPC") and not spec.get("hostNetwork"), "a pod shares its IPC namespace already"


@pytest.mark.inprocess
def test_the_sidecar_job(tmp_path: Path) -> None:
    job = one("sidecar-job.yaml", "Job")
    spec = pod_spec(job)
    s = zend_settings("sidecar-job.yaml", job, tmp_path)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == s.world_size, "every node at once"
    assert spec["restartPolicy"] == "Never" or (spec["restartPolicy"] == "OnFailure" and "backoffLimit" in job["spec"])
    assert job["spec"]["backoffLimit"] == 0, "a pod retried alone cannot rejoin its peers"
    # zend as a native sidecar: the pod completes when the trainer exits
    zend = zend_container(spec)
    assert zend in spec["initContainers"] and zend["restartPolicy"] == "Always", "a native sidecar"
    assert spec["automountServiceAccountToken"] is False
    # the node rank is the completion index: --rendezvous env, no variable that would win over it
    zend_env = env_of(zend)
    assert zend_env["ZEND_RENDEZVOUS"] == "env" and "ZEND_RANK" not in zend_env
    first_set = next(v for v in NODE_RANK_VARIABLES if pod_env(job, zend).get(v))
    assert first_set == "JOB_COMPLETION_INDEX" and s.rank == int(FIELD_VALUES[JOB_INDEX])
    # stable hostnames: the headless Service named as the pods' subdomain, selecting them
    service = one("sidecar-job.yaml", "Service")
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["metadata"]["name"] == spec["subdomain"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= labels.items()
    pod_ports = {p["name"] for c in containers(spec) for p in c.get("ports", [])}
    for port in service["spec"]["ports"]:
        assert isinstance(port["targetPort"], int) or port["targetPort"] in pod_ports
    store = f"{job['metadata']['name']}-0.{spec['subdomain']}.{FIELD_VALUES['metadata.namespace']}.svc"
    assert s.rendezvous == f"{store}:{ports(zend)['zen-rdzv']['containerPort']}"
    # the trainer: the same rank and world, MASTER_ADDR on index 0's pod
    [trainer] = spec["containers"]
    trainer_env_checks(trainer, s.socket_dir)
    env = env_of(trainer)
    assert int(env["WORLD_SIZE"]) == s.world_size and env["RANK"] == str(s.rank)
    assert env["MASTER_ADDR"] == s.rendezvous.rpartition(":")[0]
    # the sidecar StatefulSet's volumes, mounts and security, unchanged
    sts = pod_spec(one("sidecar-statefulset.yaml", "StatefulSet"))
    assert spec["volumes"] == sts["volumes"]
    assert zend["volumeMounts"] == zend_container(sts)["volumeMounts"]
    assert trainer["volumeMounts"] == sts["containers"][0]["volumeMounts"]
    assert spec["securityContext"] == sts["securityContext"]
    for key in ("securityContext", "ports", "startupProbe", "readinessProbe", "livenessProbe", "resources", "image"):
        assert zend[key] == zend_container(sts)[key], key
    assert not spec.get("hostIPC") and not spec.get("hostNetwork")


@pytest.mark.inprocess
@pytest.mark.parametrize("name", ["daemonset.yaml", "daemonset-hostnetwork.yaml"])
def test_the_daemonset_and_its_trainers(name: str, tmp_path: Path) -> None:
    ds = workloads()[name]
    spec = pod_spec(ds)
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete", "a daemon restarted alone cannot rejoin"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "zen.dev/rank", "operator": "Exists"} in terms[0]["matchExpressions"]
    assert spec["hostIPC"] is True and spec["serviceAccountName"] == "zend"
    if spec.get("hostNetwork"):
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    binding = one("rbac.yaml", "ClusterRoleBinding")
    assert {"kind": "ServiceAccount", "name": "zend", "namespace": "zen"} in binding["subjects"]
    assert one("rbac.yaml", "ClusterRole")["rules"] == [{"apiGroups": [""], "resources": ["nodes"],
                                                         "verbs": ["list"]}]
    s = zend_settings(name, ds, tmp_path)
    [socket_volume] = [v for v in spec["volumes"]
                       if v["name"] == next(m["name"] for m in zend_container(spec)["volumeMounts"]
                                            if m["mountPath"] == s.socket_dir)]
    job = one("daemonset-trainer-job.yaml", "Job")
    job_spec = pod_spec(job)
    [trainer] = job_spec["containers"]
    trainer_env_checks(trainer, s.socket_dir)
    [mount] = [m for m in trainer["volumeMounts"] if m["mountPath"] == s.socket_dir]
    [volume] = [v for v in job_spec["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"]["path"] == socket_volume["hostPath"]["path"]
    assert job_spec["hostIPC"] is True and ZEND_UID in job_spec["securityContext"]["supplementalGroups"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == s.world_size
    chown = next(c for c in spec["initContainers"] if c["name"] == "socket-dir")
    assert str(ZEND_UID) in chown["args"][0] and socket_volume["hostPath"]["path"] in chown["args"][0]


# ---------------------------------------------------------------------------------- the rank step
@pytest.mark.inprocess
def test_node_rank_writes_rank_world_size_and_rendezvous(tmp_path: Path) -> None:
    node_config = node_rank_module()["node_config"]
    nodes = [node("gpu-b", "1"), node("gpu-a", "0", RANK0_NODE_IP), node("gpu-c", "2")]
    text = node_config(config_toml(), "gpu-c", nodes, 3, 7001)
    (tmp_path / "zend.toml").write_text(text)
    s = resolve({}, env={"ZEND_LISTEN": "tcp://10.1.2.4:7000"}, config_file=str(tmp_path / "zend.toml"))
    assert (s.rank, s.world_size, s.rendezvous) == (2, 3, f"{RANK0_NODE_IP}:7001")
    assert tomllib.loads(text).items() >= tomllib.loads(config_toml()).items()


@pytest.mark.inprocess
@pytest.mark.parametrize(("nodes", "world_size", "message"), [
    ([node("gpu-a", "0")], 2, "gpu-b has no zen.dev/rank label"),  # the API lists labelled nodes only
    ([node("gpu-a", "0"), node("gpu-b", None)], 2, "gpu-b has no zen.dev/rank label"),
    ([node("gpu-a", "0"), node("gpu-b", "2")], 2, r"gpu-b has zen.dev/rank='2': not a rank in \[0, 2\)"),
    ([node("gpu-a", "0"), node("gpu-b", "one")], 2, "not a rank"),
    ([node("gpu-a", "1"), node("gpu-b", "1")], 2, "nodes gpu-a, gpu-b all have zen.dev/rank=1"),
    ([node("gpu-a", "0"), node("gpu-c", "0"), node("gpu-b", "1")], 3, "nodes gpu-a, gpu-c all have zen.dev/rank=0"),
    ([node("gpu-c", "2"), node("gpu-b", "1")], 3, "no node has zen.dev/rank=0"),
])
def test_node_rank_refuses_bad_labels_naming_the_node(nodes: list, world_size: int, message: str) -> None:
    module = node_rank_module()
    with pytest.raises(module["NodeConfigError"], match=message):
        module["node_config"](config_toml(), "gpu-b", nodes, world_size, 7001)


@pytest.mark.inprocess
def test_node_rank_refuses_a_config_that_sets_the_rank() -> None:
    module = node_rank_module()
    with pytest.raises(module["NodeConfigError"], match=r"zend\.toml sets rank"):
        module["node_config"]("rank = 0\n" + config_toml(), "gpu-a", [node("gpu-a", "0")], 1, 7001)


@pytest.mark.inprocess
def test_node_rank_main_writes_the_file_or_says_why_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import urllib.error

    module = node_rank_module()
    base, out = tmp_path / "base.toml", tmp_path / "zend.toml"
    base.write_text(config_toml())
    monkeypatch.setenv("NODE_NAME", "gpu-b")
    monkeypatch.setenv("ZEND_WORLD_SIZE", "2")
    monkeypatch.setenv("RENDEZVOUS_PORT", "7001")
    module["labelled_nodes"] = lambda: [node("gpu-a", "0", RANK0_NODE_IP), node("gpu-b", "1")]
    assert module["main"]([str(base), str(out)]) == 0
    assert tomllib.loads(out.read_text())["rendezvous"] == f"{RANK0_NODE_IP}:7001"

    def forbidden() -> list:
        raise urllib.error.HTTPError("https://api/api/v1/nodes", 403, "Forbidden", {}, None)  # type: ignore[arg-type]

    module["labelled_nodes"] = forbidden
    assert module["main"]([str(base), str(tmp_path / "other.toml")]) == 1
    assert "HTTP 403" in capsys.readouterr().err and not (tmp_path / "other.toml").exists()


@pytest.mark.inprocess
def test_the_daemonset_init_steps_read_and_write_where_zend_looks() -> None:
    spec = pod_spec(workloads()["daemonset.yaml"])
    step = next(c for c in spec["initContainers"] if c["name"] == "node-rank")
    mounts = {m["mountPath"]: m["name"] for m in step["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    script, base, out = step["command"][1:]
    config = volumes[mounts[script.rpartition("/")[0]]]["configMap"]["name"]
    assert config == "zend-config" and {"node-rank.py", "zend.toml"} == {script.rpartition("/")[2],
                                                                          base.rpartition("/")[2]}
    zend = zend_container(spec)
    assert env_of(zend)["ZEND_CONFIG"] == out
    shared = mounts[out.rpartition("/")[0]]
    assert "emptyDir" in volumes[shared]
    assert any(m["name"] == shared and m["mountPath"] == out.rpartition("/")[0] for m in zend["volumeMounts"])


@pytest.mark.daemon
def test_the_prometheusrule_holds_exactly_the_compose_alert_rules(tmp_path: Path) -> None:
    rule = one("prometheusrule.yaml", "PrometheusRule")
    assert rule["metadata"]["namespace"] == one("podmonitor.yaml", "PodMonitor")["metadata"]["namespace"]
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    check = subprocess.run([sys.executable, str(K8S / "build_prometheusrule.py"), "--check"], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
    if PROMTOOL is not None:  # the rules promtool reads out of the manifest are valid rules
        (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        run = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
