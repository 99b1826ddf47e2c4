"""The wheels the lent GPU machine lacks for scripts/gpu_checks.sh, fetched here into .whl/ (ignored).

The machine (one H200; Python 3.12 at /opt/torch/.venv/bin/python3, torch 2.11, no package registry)
has torch, numpy, numba, pytest, pytest-timeout, hypothesis, grpcio, protobuf and prometheus-client,
but not grpcio-health-checking, grpcio-reflection, cryptography or expecttest; and its grpcio and
protobuf may be older than the stubs in zend/api were generated for. So the check carries, as
CPython 3.12 manylinux wheels, the versions this checkout's own environment runs (CI tests those):

    python scripts/gpu_wheels.py            # into .whl/ (a few MB); `device run` carries it
    python scripts/gpu_wheels.py --list     # what it would fetch, one NAME==VERSION a line

`LENT_MACHINE_HAS` is what the machine's image holds (read from the device tool's KINDS.md,
2026-11-17); tests/test_gpu_readiness.py checks that every module the GPU checks import is in the
standard library, the project, that list, or the wheels fetched here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the checks need from outside the machine's image (the dependencies of those, named too: pip's
# --no-deps fetches none), at this environment's versions
CARRIED = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "cryptography", "cffi",
           "pycparser", "expecttest")
LENT_MACHINE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp""".split())  # noqa: SIM905  (as KINDS.md lists them)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux1_x86_64")


def pinned() -> list[str]:
    """NAME==VERSION of each carried package, as installed here."""
    return [f"{name}=={metadata.version(name)}" for name in CARRIED]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print what would be fetched and stop")
    p.add_argument("--dest", default=str(ROOT / ".whl"))
    args = p.parse_args()
    wanted = pinned()
    if args.list:
        print("\n".join(wanted))
        return 0
    dest = Path(args.dest)
    dest.mkdir(exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: two stop the machine's whole install
        old.unlink()
    platforms = [arg for plat in PLATFORMS for arg in ("--platform", plat)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
                           *wanted], check=False)
    if done.returncode:
        return done.returncode
    got = sorted(p.name for p in dest.glob("*.whl"))
    print(f"{len(got)} wheels in {dest} ({sum(p.stat().st_size for p in dest.glob('*.whl')) >> 20} MiB):")
    print("\n".join(f"  {name}" for name in got))
    return 0 if len(got) == len(wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
