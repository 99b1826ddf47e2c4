"""Before the GPU checks: can this machine import what they need? Names every module that fails, and why.

Run by scripts/gpu_checks.sh after the carried wheels are installed; exit 1 if anything is missing (the
checks still run: pytest reports the collection errors test by test). Also prints the versions that
matter (the GPU path has been checked with the torch printed here) and the allocator configuration.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

# what the GPU tests, the daemons and the ranks they start import (beyond the standard library)
NEEDED = ("torch", "numpy", "numba", "grpc", "google.protobuf", "grpc_health.v1.health",
          "grpc_reflection.v1alpha.reflection", "cryptography.hazmat.primitives.ciphers.aead", "prometheus_client",
          "pytest", "pytest_timeout", "hypothesis", "expecttest", "torch.testing._internal.common_distributed",
          "zend.api.zen.v1.zen_pb2_grpc", "zend.daemon.daemon", "zend.daemon.commands", "zend.transport.tcp",
          "zend.core.kernels", "zen", "zen.distributed", "tests.gpu.test_cuda", "tests.gpu.test_cuda_buffers",
          "tests.gpu.test_daemon_gpu", "tests.gpu.test_torch_backend_gpu")
VERSIONS = ("torch", "numpy", "numba", "grpc", "google.protobuf", "cryptography", "prometheus_client")


def main() -> int:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a version check of generated code (a RuntimeError)
            missing.append(name)
            print(f"PREFLIGHT MISSING {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=2, file=sys.stdout)
    for name in VERSIONS:
        module = sys.modules.get(name)
        print(f"PREFLIGHT VERSION {name} {getattr(module, '__version__', '?') if module else 'absent'}")
    torch = sys.modules.get("torch")
    if torch is not None:
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"PREFLIGHT CUDA available={torch.cuda.is_available()} runtime={torch.version.cuda} gpus={gpus}")
        print(f"PREFLIGHT NCCL {torch.distributed.is_nccl_available()}")
    print(f"PREFLIGHT PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}")
    print(f"PREFLIGHT python {sys.version.split()[0]} at {sys.executable}")
    print("PREFLIGHT OK" if not missing else f"PREFLIGHT FAILED: {len(missing)} missing: {', '.join(missing)}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
