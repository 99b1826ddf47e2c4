"""deploy/k8s/components/monitoring/prometheusrule.yaml from deploy/prometheus/alerts.yml: the same
alert rules as a prometheus-operator PrometheusRule, so Kubernetes users load exactly what compose
users do.

    python deploy/k8s/build_prometheusrule.py          # rewrite the manifest
    python deploy/k8s/build_prometheusrule.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parent / "prometheus" / "alerts.yml"
OUTPUT = HERE / "components" / "monitoring" / "prometheusrule.yaml"
HEADER = """\
# The zend alert rules for prometheus-operator: generated from deploy/prometheus/alerts.yml by
# deploy/k8s/build_prometheusrule.py (do not edit; tests/deploy/test_k8s_manifests.py checks it).
# Your Prometheus must select it (kube-prometheus-stack's selects by the label release: <its
# release name> unless ruleSelectorNilUsesHelmValues is false). ZenDaemonDown selects
# up{job="zend"}: podmonitor.yaml's jobLabel gives the daemons' targets that job. No namespace: the
# overlay that includes components/monitoring sets it.
"""


def render() -> str:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "zend",
                         "labels": {"app.kubernetes.io/name": "zend", "app.kubernetes.io/part-of": "zen"}},
            "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the manifest is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python {Path(__file__).relative_to(HERE.parent.parent)}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
