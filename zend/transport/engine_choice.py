"""Which data plane moves a tcp:// link's frames: the native engine (`zend._engine`, C++) or Python.

Both speak the same wire format, so a native node and a Python node interoperate. The native engine is
optional: it is built at install where a C++ compiler and OpenSSL's headers are present; where it cannot be
built or loaded, the Python data plane runs and the reason is said once (log, `zend status`, metrics).
Setting: `--data-plane-engine` / ZEND_DATA_PLANE_ENGINE: `auto` (native if it loads), `native` (required)
or `python`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

ENGINES = ("auto", "native", "python")


def load_native() -> tuple[ModuleType | None, str]:
    """The native engine module, or None and why it cannot be loaded. ZEN_NATIVE_ENGINE names another
    build of it to load instead (the sanitizer job's: scripts/native_build.sh --sanitize)."""
    try:
        path = os.environ.get("ZEN_NATIVE_ENGINE")
        if path and "zend._engine" not in sys.modules:
            spec = importlib.util.spec_from_file_location("zend._engine", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"ZEN_NATIVE_ENGINE={path!r} is not a loadable extension module")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules["zend._engine"] = module
        return importlib.import_module("zend._engine"), "the native engine loaded"
    except (ImportError, OSError) as exc:
        return None, f"the native engine is not available ({exc}); the Python data plane runs"


def choose_engine(setting: str, transport: str) -> tuple[str, str]:
    """Resolve an engine setting for a transport scheme to 'native' or 'python', with the reason.
    ValueError if the setting is unknown, or `native` is required and cannot be had."""
    if setting not in ENGINES:
        raise ValueError(f"data-plane engine {setting!r} is not one of {list(ENGINES)}")
    if setting == "python":
        return "python", "set to python"
    if transport != "tcp":
        if setting == "native":
            raise ValueError(f"data-plane engine 'native' serves tcp:// links only, not {transport}://")
        return "python", f"{transport}:// runs its own data plane"
    module, why = load_native()
    if module is None:
        if setting == "native":
            raise ValueError(f"data-plane engine 'native' was asked for, but {why.split(';')[0]}")
        return "python", why
    return "native", why if setting == "auto" else "set to native"
