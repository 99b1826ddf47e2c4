#!/usr/bin/env bash
# Every wheel the zend image installs, into one folder, for a build that reaches no package index
# (air-gapped clusters, and our own machines, whose containers cannot reach PyPI):
#   scripts/build_wheelhouse.sh build/wheelhouse
#   docker build -f deploy/Dockerfile --build-arg WHEELHOUSE=build/wheelhouse -t zend:0.1.0 .
# The variant is chosen as deploy/Dockerfile's build arguments choose it, by the same names:
#   EXTRAS=daemon,ucx scripts/build_wheelhouse.sh FOLDER                          # the UCX variant
#   TORCH_INDEX= scripts/build_wheelhouse.sh FOLDER        # CUDA: torch from pip's own indexes (the Linux wheel
#                                                            # of torch 2.13 on the package index is the CUDA build)
# (then pass the same EXTRAS to docker build). EXTRAS defaults to daemon, TORCH_INDEX to torch's CPU
# index (an extra index, as in the Dockerfile).
# The folder must lie inside the build context (the repository). Wheels are for this machine's
# Python (3.11) and architecture, as the image's are. setuptools is the project's build backend.
# The project's own wheel carries the native engine (zend._engine), compiled here with this machine's g++
# and OpenSSL headers: the image installs that wheel and needs no compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: [EXTRAS=daemon,ucx] [TORCH_INDEX=URL] scripts/build_wheelhouse.sh FOLDER}
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
extras=${EXTRAS:-daemon}
torch_index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
mkdir -p "$out"
"$python" -m pip wheel -q --wheel-dir "$out" ${torch_index:+--extra-index-url "$torch_index"} -c constraints.txt \
    "setuptools>=77" ".[$extras]"
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out ([$extras])"
