"""Init step of the zend DaemonSet: this node's rank, from node labels.

DaemonSet pods have no ordinal, so the operator numbers the nodes: each zen node carries the
label zen.dev/rank=<0..N-1> (the DaemonSet runs only where it exists). This step lists the
labelled nodes through the Kubernetes API (ClusterRole zend-node-reader: list nodes), takes
this node's rank from its label, and writes rank and world_size followed by the shared zend.toml
to the file that `zend serve` reads through ZEND_CONFIG. The rendezvous is not here: the daemons
are elastic around the store zend-store (its Service, in ZEND_RENDEZVOUS), and a daemon that
restarts rejoins with the rank its node's label gives it again. A bad, duplicated or missing
label stops here with a message naming the node; the kubelet retries the step.

Usage: python node-rank.py BASE_TOML OUT_TOML, with NODE_NAME and ZEND_WORLD_SIZE in the environment.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request

LABEL = "zen.dev/rank"
ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
SET_HERE = ("rank", "world_size")


class NodeConfigError(ValueError):
    """The node labels cannot give this node a rank; the message says what to fix."""


def node_config(base_toml: str, node_name: str, nodes: list[dict], world_size: int) -> str:
    """The settings file of `node_name`: its rank and the world size, then `base_toml`."""
    clash = sorted(set(tomllib.loads(base_toml)) & set(SET_HERE))
    if clash:
        raise NodeConfigError(f"zend.toml sets {', '.join(clash)}; in the DaemonSet these come from node labels")
    if world_size < 1:
        raise NodeConfigError(f"ZEND_WORLD_SIZE={world_size} must be at least 1")
    by_rank: dict[int, list[str]] = {}
    for node in nodes:
        name, text = node["metadata"]["name"], node["metadata"].get("labels", {}).get(LABEL)
        if text is None:
            continue
        try:
            rank = int(text)
        except ValueError:
            rank = -1
        if not 0 <= rank < world_size:
            if name == node_name:
                raise NodeConfigError(f"node {name} has {LABEL}={text!r}: not a rank in [0, {world_size}) "
                                      f"for ZEND_WORLD_SIZE={world_size}")
            print(f"node-rank: ignoring node {name} with {LABEL}={text!r} (not in [0, {world_size}))",
                  file=sys.stderr)
            continue
        by_rank.setdefault(rank, []).append(name)
    own = [r for r, names in by_rank.items() if node_name in names]
    if not own:
        raise NodeConfigError(f"node {node_name} has no {LABEL} label: label it, e.g. "
                              f"kubectl label node {node_name} {LABEL}=<0..{world_size - 1}>")
    names = sorted(by_rank[own[0]])
    if len(names) > 1:  # the rendezvous would refuse the second daemon of a rank anyway: say which nodes
        raise NodeConfigError(f"nodes {', '.join(names)} all have {LABEL}={own[0]}: ranks must be unique")
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        print(f"node-rank: no node has {LABEL} = {', '.join(map(str, missing))} yet; the first generation "
              f"waits for them", file=sys.stderr)
    return f"# written by node-rank.py for node {node_name}\nrank = {own[0]}\nworld_size = {world_size}\n\n" + base_toml


def labelled_nodes() -> list[dict]:
    """Every node with the rank label, as the API server lists them (this pod's ServiceAccount)."""
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    host = f"[{host}]" if ":" in host else host
    url = f"https://{host}:{port}/api/v1/nodes?labelSelector={urllib.parse.quote(LABEL)}"
    with open(f"{ACCOUNT}/token") as f:
        token = f.read().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                                   "Accept": "application/json"})
    context = ssl.create_default_context(cafile=f"{ACCOUNT}/ca.crt")
    with urllib.request.urlopen(request, context=context, timeout=30) as reply:
        return list(json.load(reply)["items"])


def main(argv: list[str]) -> int:
    base_path, out_path = argv
    try:
        with open(base_path) as f:
            base = f.read()
        text = node_config(base, os.environ["NODE_NAME"], labelled_nodes(), int(os.environ["ZEND_WORLD_SIZE"]))
    except urllib.error.HTTPError as exc:
        print(f"node-rank: cannot list nodes: HTTP {exc.code} {exc.reason} (is the ClusterRole "
              f"zend-node-reader bound to this pod's ServiceAccount?)", file=sys.stderr)
        return 1
    except (OSError, KeyError, ValueError) as exc:
        print(f"node-rank: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    with open(out_path + ".tmp", "w") as f:
        f.write(text)
    os.replace(out_path + ".tmp", out_path)
    print(text.split("\n\n", 1)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
