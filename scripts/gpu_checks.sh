#!/usr/bin/env bash
# Every GPU check in one run, for a lent GPU machine (the session's `device` tool), never CI.
#   here:  python scripts/gpu_wheels.py             (the cp312 wheels the machine lacks, into .whl/)
#   there: device run, carry [".whl"]: bash scripts/gpu_checks.sh
# Covers: GPU hashing and partition identical to the CPU (and their speed on 11 M non-zeros), every scheme
# on CUDA tensors, CUDA IPC buffers between a trainer and the buffer server (and the hand-off's latency),
# GPU buffers in real daemons, and the "zen" torch.distributed backend: CUDA sparse all_reduce through
# zend with the dense ops on NCCL beside it, timed against gloo's host-staged sparse all_reduce.
# Prints one table (test, result, time, GPU figure); the log, JUnit reports and figures go to $OUT.
# The project is not installed there: PYTHONPATH carries it, ahead of the carried wheels.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/zen-gpu-checks}"
mkdir -p "$out"
log="$out/gpu-checks.log"
started=$SECONDS
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tee "$log" && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo ZEN_GPU_FIGURES="$out/gpu-figures.jsonl"
rm -f "$ZEN_GPU_FIGURES"
{ nvidia-smi -L; echo "allocator configuration as found: PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-(unset)}"; } \
    2>&1 | tee -a "$log"
unset PYTORCH_CUDA_ALLOC_CONF  # the first run with torch's defaults
python3 scripts/gpu_preflight.py 2>&1 | tee -a "$log"
# every GPU test: a file that fails to collect does not stop the others; 3 minutes a test; the whole under 9
timeout 420 python3 -m pytest -q -s -p no:cacheprovider -rs --continue-on-collection-errors --timeout=180 \
    tests/gpu --junitxml="$out/gpu-checks.xml" 2>&1 | tee -a "$log"
# then the buffer paths again with expandable segments asked for (the daemon must turn them off)
left=$(( 500 - (SECONDS - started) ))
if [ "$left" -gt 60 ]; then
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$left" python3 -m pytest -q -s -p no:cacheprovider \
        --timeout=120 tests/gpu/test_cuda_buffers.py tests/gpu/test_daemon_gpu.py \
        --junitxml="$out/gpu-checks-expandable.xml" 2>&1 | tee -a "$log"
fi
{ echo; echo "== GPU checks, default allocator"; python3 scripts/gpu_report.py "$out/gpu-checks.xml" "$ZEN_GPU_FIGURES"
  if [ -f "$out/gpu-checks-expandable.xml" ]; then
      echo; echo "== buffer paths with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
      python3 scripts/gpu_report.py "$out/gpu-checks-expandable.xml"
  fi
  echo "took $(( SECONDS - started )) s"; } 2>&1 | tee -a "$log"
