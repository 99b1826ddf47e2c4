"""What Kustomize adds to deploy/k8s: one home for each overlay's job name and node count (the job's
rendezvous store named after it), the components (operator TLS, monitoring, host network), the
NetworkPolicies (the daemons', the store's), the PodDisruptionBudget and the JobSet's structure. Each
overlay is built with kubectl's built-in kustomize, as `kubectl apply -k` would (test_k8s_manifests.py
validates everything it builds against the Kubernetes schemas).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.test_k8s_manifests import (
    ALL_VARIANTS,
    CRDS,
    K8S,
    NAMESPACE,
    OVERLAY_NAMES,
    OVERLAYS,
    TRAINER_ONLY,
    VARIANTS,
    VERSIONS,
    as_job,
    built,
    check_failed_pods_are_replaced_alone,
    check_settings_in_the_pod,
    containers,
    copy_tree,
    env_of,
    kubernetes_validate,
    kustomize,
    needs_kubectl,
    one,
    pod_labels,
    pod_spec,
    pod_workloads,
    ports,
    runs_store,
    store_address,
    store_parts,
    validation_errors,
    workload,
    yaml,
    zend_container,
    zend_settings,
)
from zend.cli import build_parser
from zend.protocol import paths

pytestmark = [pytest.mark.daemon, needs_kubectl]  # every test here runs kubectl kustomize

JOB_OVERLAYS = ("sidecar-job", "sidecar-statefulset", "jobset", "daemonset-trainer-job")  # values.yaml: name, nodes
TLS_SECRET = "zend-operator-tls"
TLS_MOUNT = "/etc/zen/tls"


def set_values(overlay: Path, **values: str) -> None:
    """Edit an overlay's values.yaml as an operator does: the values of its data lines, comments kept."""
    path = overlay / "values.yaml"
    head, marker, data = path.read_text().partition("\ndata:\n")
    for key, value in values.items():
        data, count = re.subn(rf'(?m)^(  {key}: )("?)[^"\s#]+\2', rf'\g<1>"{value}"', data)
        assert count == 1, f"{path}: no data line {key}"
    path.write_text(head + marker + data)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels is checked here"
    return selector["matchLabels"].items() <= labels.items()


# ---------------------------------------------------------------------------------- overlays and components
def test_every_overlay_is_built_here_with_and_without_operator_tls() -> None:
    assert set(OVERLAY_NAMES) == {"sidecar-job", "sidecar-statefulset", "jobset", "daemonset",
                                  "daemonset-trainer-job"}
    for overlay in OVERLAY_NAMES:  # test_k8s_manifests builds and validates every variant
        variants = [components for name, components in ALL_VARIANTS.values() if name == overlay]
        assert () in variants and any("operator-tls" in c for c in variants), overlay
    for overlay in OVERLAY_NAMES:
        text = (OVERLAYS / overlay / "kustomization.yaml").read_text()
        if overlay in TRAINER_ONLY:
            continue
        # what an operator switches on: monitoring on, TLS a commented line to uncomment
        assert re.search(r"(?m)^  - \.\./\.\./components/monitoring\b", text), overlay
        assert re.search(r"(?m)^  # - \.\./\.\./components/operator-tls\b", text), overlay
    text = (OVERLAYS / "daemonset" / "kustomization.yaml").read_text()
    for component in ("hostnetwork", "rdma"):
        assert re.search(rf"(?m)^  # - \.\./\.\./components/{component}\b", text), component


def test_the_trainer_only_overlay_has_no_zend_and_tls_changes_nothing_there() -> None:
    for name in TRAINER_ONLY:
        assert not any(c.get("args", [])[:1] == ["serve"] for w in pod_workloads(built(name))
                       for c in containers(pod_spec(w)))
        assert built(name) == built(f"{name}+tls")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_operator_tls_mounts_the_certificate_and_probes_over_the_unix_socket(variant: str, tmp_path: Path) -> None:
    docs = built(f"{variant}+tls")
    found = workload(docs)
    spec = pod_spec(found)
    zend = zend_container(spec)
    s = check_settings_in_the_pod(docs, tmp_path)  # the rest of the pod as without TLS
    # zend's two settings name the Secret's files, mounted read-only, readable by zend's group only
    assert (s.operator_tls_cert_file, s.operator_tls_key_file) == (f"{TLS_MOUNT}/tls.crt", f"{TLS_MOUNT}/tls.key")
    [mount] = [m for m in zend["volumeMounts"] if m["mountPath"] == TLS_MOUNT]
    assert mount.get("readOnly") is True and "subPath" not in mount, "a renewed Secret reaches a folder mount"
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == TLS_SECRET
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {"tls.crt": "tls.crt", "tls.key": "tls.key"}
    assert volume["secret"]["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"] == 10001
    others = [c for c in containers(spec) if c is not zend]
    assert not any(m["name"] == mount["name"] for c in others for m in c.get("volumeMounts", [])), "zend's only"
    # exec probes: `zend health` over the unix socket in zend's socket folder, within the probe's timeout
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        handler = zend[probe]
        assert "grpc" not in handler and handler["exec"]["command"][0] == "zend", probe
        args = build_parser().parse_args(handler["exec"]["command"][1:])
        assert args.command == "health" and args.address is None, "the unix socket: no TLS, no network"
        folder = args.socket_dir or paths.socket_dir_from_env(env_of(zend, pod_labels(found)))
        assert folder == s.socket_dir and any(m["mountPath"] == folder for m in zend["volumeMounts"])
        assert handler["timeoutSeconds"] > args.timeout, f"{probe}: zend health waits {args.timeout} s"
    startup = zend["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > s.connect_timeout_s
    # the probes were the only change to the container apart from TLS's own
    plain = zend_container(pod_spec(workload(built(variant))))
    for key in ("image", "args", "ports", "resources", "securityContext"):
        assert zend[key] == plain[key], key
    tls_env = {"ZEND_OPERATOR_TLS_CERT_FILE", "ZEND_OPERATOR_TLS_KEY_FILE"}
    assert [e for e in zend["env"] if e["name"] not in tls_env] == plain["env"]
    # Prometheus scrapes https, trusting the Secret's CA, checking the name the certificate carries
    [endpoint] = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"] == {"secret": {"name": TLS_SECRET, "key": "ca.crt"}}
    assert endpoint["tlsConfig"]["serverName"] and not endpoint["tlsConfig"].get("insecureSkipVerify")
    assert "scheme" not in one(built(variant), "PodMonitor")["spec"]["podMetricsEndpoints"][0]


def test_the_tls_component_documents_what_clients_check() -> None:
    text = (K8S / "components" / "operator-tls" / "kustomization.yaml").read_text()
    [endpoint] = one(built("daemonset+tls"), "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert f"--tls-server-name {endpoint['tlsConfig']['serverName']}" in text
    assert "kubernetes.io/tls" in text and TLS_SECRET in text


# ---------------------------------------------------------------------------------- one home for name and count
def job_places(docs: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    """Every place an overlay's job name or node count shows, as built."""
    [found] = pod_workloads(docs)
    spec = pod_spec(found)
    [trainer] = spec["containers"]
    trainer_env = env_of(trainer, pod_labels(found))
    token = next(e for e in trainer["env"] if e["name"] == "ZEN_JOB_TOKEN")["valueFrom"]["secretKeyRef"]["name"]
    [budget] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    places: dict[str, Any] = {
        "ZEN_JOB": trainer_env["ZEN_JOB"], "token": token.removeprefix("zen-job-token-"),
        "budget": budget["metadata"]["name"], "WORLD_SIZE": int(trainer_env["WORLD_SIZE"]),
        "budget minAvailable": budget["spec"]["minAvailable"],
        "LOCAL_WORLD_SIZE": trainer_env["LOCAL_WORLD_SIZE"],
    }
    if found["kind"] == "StatefulSet":
        places |= {"workload": found["metadata"]["name"], "serviceName": found["spec"]["serviceName"],
                   "replicas": found["spec"]["replicas"]}
    else:
        jobsets = [d for d in docs if d["kind"] == "JobSet"]
        places |= {"workload": jobsets[0]["metadata"]["name"] if jobsets else found["metadata"]["name"],
                   "completions": found["spec"]["completions"], "parallelism": found["spec"]["parallelism"]}
    if runs_zend_in(docs):
        s = zend_settings(docs, tmp_path)
        assert s.rendezvous == store_address(docs)
        store, store_service, _ = store_parts(docs)
        places |= {"zend world_size": s.world_size, "store host": s.rendezvous.rpartition(":")[0],
                   "MASTER_ADDR": trainer_env["MASTER_ADDR"], "store": store["metadata"]["name"],
                   "store Service": store_service["metadata"]["name"],
                   "store label": pod_labels(store)["zen.dev/store"]}
        policy, store_policy = daemon_and_store_policies(docs)
        places |= {"policy": policy["metadata"]["name"], "store policy": store_policy["metadata"]["name"]}
        for service in (d for d in docs if d["kind"] == "Service" and d is not store_service):
            places["service"] = service["metadata"]["name"]
            assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(found))
        assert selects({"matchLabels": store_service["spec"]["selector"]}, pod_labels(store))
        assert selects(store["spec"]["selector"], pod_labels(store))
        assert selects(policy["spec"]["podSelector"], pod_labels(found))
        assert selects(policy["spec"]["ingress"][0]["from"][0]["podSelector"], pod_labels(found))
        assert selects(store_policy["spec"]["podSelector"], pod_labels(store))
        assert selects(store_policy["spec"]["ingress"][0]["from"][0]["podSelector"], pod_labels(found))
        if found["kind"] == "Job":
            places["subdomain"] = spec["subdomain"]
    assert selects(budget["spec"]["selector"], pod_labels(found))
    return places


def daemon_and_store_policies(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The NetworkPolicy of zend's pods and the one of its rendezvous store, told apart by whom they select."""
    store, _, _ = store_parts(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    [store_policy] = [p for p in policies if selects(p["spec"]["podSelector"], pod_labels(store))]
    [policy] = [p for p in policies if p is not store_policy]
    return policy, store_policy


def runs_zend_in(docs: list[dict[str, Any]]) -> bool:
    return any(c.get("args", [])[:1] == ["serve"] for w in pod_workloads(docs) for c in containers(pod_spec(w)))


@pytest.mark.parametrize("overlay", JOB_OVERLAYS)
def test_the_job_name_and_node_count_are_set_once_and_reach_every_place(overlay: str, tmp_path: Path) -> None:
    default = job_places(built(overlay), tmp_path)
    root = copy_tree(tmp_path)
    set_values(root / "overlays" / overlay, name="run-0", nodes="5")  # "-0": a name that ends as an index does
    docs = kustomize(root / "overlays" / overlay)
    places = job_places(docs, tmp_path)
    assert places.keys() == default.keys()
    for key, value in places.items():
        if key == "LOCAL_WORLD_SIZE":  # the trainers on one node, not a node count
            assert value == default[key] == "1"
        elif key == "MASTER_ADDR":  # index 0's pod, by its DNS name
            assert value == default[key].replace("my-job", "run-0") != default[key]
            assert value.startswith("run-0-") and value.endswith(f".run-0.{NAMESPACE}.svc")
        elif key == "store host":  # the job's own store, by its Service's DNS name
            assert (default[key], value) == (f"my-job-store.{NAMESPACE}.svc", f"run-0-store.{NAMESPACE}.svc")
        elif key in ("store", "store Service", "store policy"):
            assert (default[key], value) == ("my-job-store", "run-0-store"), key
        elif isinstance(default[key], int):
            assert (default[key], value) == (2, 5), key
        else:
            assert (default[key], value) == ("my-job", "run-0"), key
    text = yaml.safe_dump_all(docs)
    assert "my-job" not in text, "a place the name did not reach"
    for version in VERSIONS:
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) not in CRDS:
                assert not validation_errors(doc, version)
    assert "local-config" not in text, "values.yaml is kustomize's, not the cluster's"


def test_the_daemonsets_node_count_is_set_once(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    set_values(root / "overlays" / "daemonset", nodes="5")
    docs = kustomize(root / "overlays" / "daemonset")
    assert zend_settings(docs, tmp_path).world_size == 5
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 5
    assert zend_settings(built("daemonset"), tmp_path).world_size == 2
    assert one(built("daemonset-trainer-job"), "Job")["spec"]["completions"] == 2, "the DaemonSet's count"


def test_the_overlays_namespace_reaches_every_object_and_the_role_binding(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    path = root / "overlays" / "daemonset" / "kustomization.yaml"
    text, count = re.subn(r"(?m)^namespace: zen$", "namespace: team-a", path.read_text())
    assert count == 1
    path.write_text(text)
    docs = kustomize(path.parent)
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "team-a", doc["kind"]
    assert one(docs, "ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": "zend", "namespace": "team-a"}]


# ---------------------------------------------------------------------------------- NetworkPolicy
def port_numbers(rule: dict[str, Any]) -> set[int]:
    assert all(p.get("protocol", "TCP") == "TCP" and isinstance(p["port"], int) for p in rule["ports"])
    return {p["port"] for p in rule["ports"]}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_networkpolicy_admits_the_job_to_data_and_monitoring_to_metrics(variant: str) -> None:
    docs = built(variant)
    found = workload(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if pod_spec(found).get("hostNetwork"):
        # not covered by a policy, and from the node as a source, which no podSelector matches: the store's
        # policy would refuse the daemons
        assert not policies, "a NetworkPolicy does not apply to pods on the host network"
        return
    policy, _ = daemon_and_store_policies(docs)
    assert len(policies) == 2
    labels = pod_labels(found)
    own = ports(zend_container(pod_spec(found)))
    data, grpc, metrics = (own[n]["containerPort"] for n in ("zen-data", "zen-grpc", "zen-metrics"))
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and selects(spec["podSelector"], labels)
    # the pods selected are this job's (or the daemons): the label names it
    assert spec["podSelector"]["matchLabels"] == {"zen.dev/cluster": labels["zen.dev/cluster"]}
    if found["kind"] != "DaemonSet":  # named after the job, as its pods' label
        [top] = [d for d in docs if d["kind"] in ("Job", "StatefulSet", "JobSet")]
        assert labels["zen.dev/cluster"] == top["metadata"]["name"] == policy["metadata"]["name"]
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in spec["ingress"]:
        assert rule.get("from") and rule.get("ports"), "every rule names its sources and its ports"
        for port in port_numbers(rule):
            admitted.setdefault(port, []).extend(rule["from"])
    peers = [{"podSelector": spec["podSelector"]}]
    assert admitted[data] == peers, "data plane: the job's pods only"
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert admitted[metrics] == [monitoring], "metrics: the monitoring namespace only"
    assert monitoring in admitted[grpc] and all("podSelector" not in source for source in admitted[grpc])
    assert all(set(source) == {"namespaceSelector"} for source in admitted[grpc]), "7070: whole namespaces"
    # and the trainers' own process group; no rendezvous port: an elastic daemon hosts no store
    assert set(admitted) == {data, grpc, metrics, 29500}
    assert admitted[29500] == peers
    # a pod of another job in the namespace is not a peer
    other = {**labels, "zen.dev/cluster": "another-job"}
    assert not selects(spec["ingress"][0]["from"][0]["podSelector"], other)


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if v != "daemonset-hostnetwork"))
def test_the_store_admits_its_own_daemons_and_nothing_else(variant: str) -> None:
    docs = built(variant)
    found = workload(docs)
    store, _, args = store_parts(docs)
    policy, store_policy = daemon_and_store_policies(docs)
    spec = store_policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"]["matchLabels"] == {"zen.dev/store": pod_labels(store)["zen.dev/store"]}
    [rule] = spec["ingress"]  # one rule: the daemons of its cluster, on the port the store listens on
    daemons = {"zen.dev/cluster": pod_labels(found)["zen.dev/cluster"]}
    assert rule["from"] == [{"podSelector": {"matchLabels": daemons}}]
    assert port_numbers(rule) == {int(args.listen.rpartition(":")[2])} == {int(store_address(docs).rpartition(":")[2])}
    # admitted: this cluster's daemons; not another job's, not the DaemonSet's trainer pods, not anyone else
    source = rule["from"][0]["podSelector"]
    assert selects(source, pod_labels(found))
    assert not selects(source, {**pod_labels(found), "zen.dev/cluster": "another-job"})
    for name in TRAINER_ONLY:
        assert not any(selects(source, pod_labels(w)) for w in pod_workloads(built(name)))
    assert not selects(source, pod_labels(store))
    # each policy selects its own pods only
    assert not selects(policy["spec"]["podSelector"], pod_labels(store))
    assert not selects(spec["podSelector"], pod_labels(found))


@pytest.mark.parametrize("overlay", ["sidecar-job", "sidecar-statefulset", "jobset"])
def test_two_jobs_in_one_namespace_share_no_store(overlay: str, tmp_path: Path) -> None:
    """They share cluster_id ("zen") and the cluster secret: one store would mix their rounds."""
    first = built(overlay)
    root = copy_tree(tmp_path)
    set_values(root / "overlays" / overlay, name="other")
    second = kustomize(root / "overlays" / overlay)

    def names(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(d["kind"], d["metadata"]["name"]) for d in docs}

    shared = names(first) & names(second)
    assert shared == {("ConfigMap", "zend-config"), ("PodMonitor", "zend"), ("PrometheusRule", "zend")}
    for kind, name in shared:  # applying one job leaves the other's shared objects as they were
        assert one(first, kind, name) == one(second, kind, name)
    assert store_address(first) != store_address(second)
    for mine, theirs in ((first, second), (second, first)):
        _, their_policy = daemon_and_store_policies(theirs)
        _, their_service, _ = store_parts(theirs)
        assert not selects(their_policy["spec"]["ingress"][0]["from"][0]["podSelector"], pod_labels(workload(mine)))
        assert not selects({"matchLabels": their_service["spec"]["selector"]}, pod_labels(store_parts(mine)[0]))


# ---------------------------------------------------------------------------------- PodDisruptionBudget
@pytest.mark.parametrize("variant", sorted([*VARIANTS, *TRAINER_ONLY]))
def test_the_disruption_budget_holds_every_pod_of_the_job(variant: str, tmp_path: Path) -> None:
    docs = built(variant)
    [budget] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    workloads = pod_workloads(docs)
    [found] = workloads
    spec = budget["spec"]
    assert selects(spec["selector"], pod_labels(found))
    # an integer minAvailable (maxUnavailable needs a scale subresource: Jobs, JobSets, DaemonSets have
    # none), the node count: no voluntary eviction while every pod is up
    assert "maxUnavailable" not in spec and isinstance(spec["minAvailable"], int)
    if found["kind"] == "DaemonSet":
        nodes = zend_settings(docs, tmp_path).world_size
    else:
        nodes = found["spec"].get("replicas") or found["spec"]["completions"]
    assert spec["minAvailable"] == nodes
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow", "a stuck job does not hold a drain forever"
    if found["kind"] == "Job":  # a lost pod is replaced and rejoins; until then every node's steps wait
        check_failed_pods_are_replaced_alone(found)
    for store in (d for d in docs if runs_store(d)):  # running generations do not need it: no budget holds it
        assert not selects(spec["selector"], pod_labels(store))
    # it selects this job's pods, not another job's in the same namespace
    key = next(k for k in ("zen.dev/cluster", "zen.dev/job") if k in spec["selector"]["matchLabels"])
    assert not selects(spec["selector"], {**pod_labels(found), key: "another-job"})


# ---------------------------------------------------------------------------------- JobSet
JOBSET_SPEC_FIELDS = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
                      "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"}
JOBSET_REPLICATED_JOB_FIELDS = {"name", "groupName", "template", "replicas", "dependsOn"}


def test_the_jobset_is_structurally_a_jobset_of_one_indexed_job(tmp_path: Path) -> None:
    docs = built("jobset")
    [jobset] = [d for d in docs if d["kind"] == "JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # still true: else validate it with the schema
        kubernetes_validate.validate(jobset, VERSIONS[0], strict=True)
    assert set(jobset) == {"apiVersion", "kind", "metadata", "spec"}
    spec = jobset["spec"]
    assert set(spec) <= JOBSET_SPEC_FIELDS, sorted(set(spec) - JOBSET_SPEC_FIELDS)
    assert set(spec["network"]) <= {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
    assert set(spec["failurePolicy"]) <= {"maxRestarts", "restartStrategy", "rules"}
    assert isinstance(spec["failurePolicy"]["maxRestarts"], int) and spec["failurePolicy"]["maxRestarts"] >= 1
    [replicated] = spec["replicatedJobs"]
    assert set(replicated) <= JOBSET_REPLICATED_JOB_FIELDS and replicated["replicas"] == 1
    assert set(replicated["template"]) <= {"metadata", "spec"}
    for version in VERSIONS:  # the template is a batch/v1 JobTemplateSpec: validate it as a Job
        job = {**as_job(jobset), "spec": replicated["template"]["spec"]}
        assert not validation_errors(job, version)
    # the pods' DNS names: <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>; the store, the JobSet's
    job = as_job(jobset)
    s = zend_settings(docs, tmp_path)
    name = jobset["metadata"]["name"]
    trainer_env = env_of(pod_spec(job)["containers"][0], pod_labels(job))
    assert trainer_env["MASTER_ADDR"] == f"{name}-{replicated['name']}-0-0.{name}.{NAMESPACE}.svc"
    assert s.rendezvous == store_address(docs) == f"{name}-store.{NAMESPACE}.svc:7001" and s.elastic == 1
    # a failed pod is retried alone (it rejoins); an index out of retries fails the Job, and the JobSet
    # then recreates every pod
    check_failed_pods_are_replaced_alone(job)
    assert "subdomain" not in replicated["template"]["spec"]["template"]["spec"], "the JobSet controller sets it"
