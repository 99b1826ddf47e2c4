#!/usr/bin/env bash
# The backend's and the client's tests on another torch than the one .venv pins (constraints.txt):
# `scripts/torch_matrix.sh 2.14.1 [install|test|all]` (2.14.1 is a CUDA build of about 5.5 GB, from this
# machine's local index; it runs on the CPU). A venv of its own (build/torch-VERSION), the project editable in
# it with the daemon's extra (the engine built in place by .venv is reused: same Python), every other pin as in
# constraints.txt. `make test` runs it for the top of the torch range.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/torch_matrix.sh TORCH_VERSION [install|test|all]}
phase=${2:-all}
venv=build/torch-$version
if [ "$phase" != test ]; then
    mkdir -p "$venv"
    grep -v '^torch==' constraints.txt > "$venv/constraints.txt"
    scripts/compat_venv.sh "$venv" "$venv/constraints.txt" "torch==$version"
fi
if [ "$phase" != install ]; then
    "$venv/bin/python" -c "import torch, zen; print('torch', torch.__version__, 'zen', zen.__version__)"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/client/test_torch_backend.py \
        tests/client/test_client.py -k 'not gpt_example'  # the example: its losses on 2.13 are the suite's
fi
