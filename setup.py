"""Build of zend._engine, the native data plane (zend/transport/native). Optional: where it cannot be
built (no compiler, no OpenSSL headers) the install goes on without it and zen uses the Python data plane."""

from __future__ import annotations

import os

from setuptools import Extension, setup

try:
    import pybind11

    INCLUDE = [pybind11.get_include()]
except ImportError:  # no pybind11: the optional extension fails to build, the install goes on
    INCLUDE = []

NATIVE = "zend/transport/native"
SOURCES = ["text", "pool", "seal", "wire", "abort_notice", "admission", "mailboxes", "engine", "bindings"]

# ZEN_NATIVE_BUILD=0: no engine build, for a second venv over a tree whose engine is already built in place
# (scripts/torch_matrix.sh, scripts/floor_check.sh: same Python, another torch or grpc)
BUILD = os.environ.get("ZEN_NATIVE_BUILD", "1") != "0"

setup(
    ext_modules=[] if not BUILD else [
        Extension(
            "zend._engine",
            sources=[f"{NATIVE}/{name}.cpp" for name in SOURCES],
            include_dirs=INCLUDE,
            libraries=["crypto"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
            optional=True,
        )
    ],
)
