#!/usr/bin/env bash
# The backend's and the client's tests on another torch than the one .venv pins (constraints.txt):
# `scripts/torch_matrix.sh 2.14.1` (a CUDA build of about 5.5 GB, from this machine's local index; it
# runs on the CPU). Its own venv (build/torch-VERSION), the project editable in it with the daemon's
# extra, every other pin as in constraints.txt. `make test` runs it for the torch range's top.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/torch_matrix.sh TORCH_VERSION}
venv=build/torch-$version
python=${PYTHON:-python3}
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
grep -v '^torch==' constraints.txt > "$venv/constraints.txt"
"$venv/bin/python" -m pip install -q -c "$venv/constraints.txt" "torch==$version" -e '.[daemon]' \
    pytest pytest-timeout hypothesis expecttest
"$venv/bin/python" -c "import torch, zen; print('torch', torch.__version__, 'zen', zen.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/client/test_torch_backend.py tests/client/test_client.py \
    tests/cluster/test_launch.py
