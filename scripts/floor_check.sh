#!/usr/bin/env bash
# The oldest grpcio / protobuf the project declares (pyproject.toml's floors), with the stubs in zend/api:
# a venv of its own (build/floor-venv) pinned to them, then the trainer's and the operator's gRPC paths
# (the client, `zend status --json`, the fuzzed control plane). `scripts/floor_check.sh [install|test|all]`;
# `make test` runs it. The engine built in place by .venv is reused (same Python).
set -euo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
venv=build/floor-venv
if [ "$phase" != test ]; then
mkdir -p "$venv"
cat > "$venv/constraints.txt" <<PINS
$(grep '^torch==' constraints.txt)
grpcio==1.62.3
grpcio-health-checking==1.62.3
grpcio-reflection==1.62.3
protobuf==4.25.1
PINS
scripts/compat_venv.sh "$venv" "$venv/constraints.txt"
fi
[ "$phase" = install ] && exit 0
"$venv/bin/python" -c "import grpc, google.protobuf as pb, zen; print('grpcio', grpc.__version__, 'protobuf', pb.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/client/test_client.py tests/security/test_grpc_abuse.py \
    -k 'not gpt_example' "tests/daemon/test_daemon.py::test_status_and_health_find_the_daemon_through_zen_socket_dir"
