#!/usr/bin/env bash
# Every wheel the zend image installs, into one folder, for a build that reaches no package index
# (air-gapped clusters, and our own machines, whose containers cannot reach PyPI):
#   scripts/build_wheelhouse.sh build/wheelhouse
#   docker build -f deploy/Dockerfile --build-arg WHEELHOUSE=build/wheelhouse -t zend:0.1.0 .
# The folder must lie inside the build context (the repository). Wheels are for this machine's
# Python (3.11) and architecture, as the image's are. setuptools is the project's build backend.
# The project's own wheel carries the native engine (zend._engine), compiled here with this machine's g++
# and OpenSSL headers: the image installs that wheel and needs no compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/build_wheelhouse.sh FOLDER}
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$out"
"$python" -m pip wheel -q --wheel-dir "$out" -c constraints.txt "setuptools>=77" ".[daemon,ucx]"
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
