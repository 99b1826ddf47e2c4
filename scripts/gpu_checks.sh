#!/usr/bin/env bash
# Every GPU check in one run, for a lent GPU machine (the session's `device` tool), never CI.
#   device run: bash scripts/gpu_checks.sh        (carry .whl if packages are missing there)
# Covers: GPU hashing and partition identical to the CPU, every scheme on CUDA tensors (in-process
# and over tcp://), CUDA IPC buffers between a trainer and the buffer server, GPU buffers in real
# daemons, and the "zen" torch.distributed backend: CUDA sparse all_reduce through zend with the
# dense ops on NCCL beside it, timed against gloo's host-staged sparse all_reduce (tests/gpu,
# run with -s so those timings reach the log). The log and a JUnit report go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/zen-gpu-checks}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then  # what the image lacks (grpcio-health-checking, cryptography, ...)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; } \
    2>&1 | tee "$out/gpu-checks.log"
python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu --junitxml="$out/gpu-checks.xml" 2>&1 | tee -a "$out/gpu-checks.log"
