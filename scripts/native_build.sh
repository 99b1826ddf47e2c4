#!/usr/bin/env bash
# Builds zend._engine (zend/transport/native) into OUTDIR, one compile at a time.
#
#   scripts/native_build.sh [--sanitize] OUTDIR
#
# --sanitize builds it with -fsanitize=address,undefined -fno-omit-frame-pointer, for the sanitizer
# job. An uninstrumented python can import that build only with the ASan runtime loaded first, e.g.:
#
#   LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)" \
#   ASAN_OPTIONS=detect_leaks=0 ZEN_NATIVE_ENGINE=OUTDIR/_engine.cpython-311-x86_64-linux-gnu.so \
#   PYTHONPATH=.:client python -m pytest -q tests/native
#
# (detect_leaks=0: CPython itself leaks by LeakSanitizer's standards at exit; ZEN_NATIVE_ENGINE makes
# tests/native load that file as zend._engine.) PYTHON picks the interpreter (default: python3), CXX
# the compiler (default: g++).
set -euo pipefail

sanitize=0
if [[ "${1:-}" == "--sanitize" ]]; then
    sanitize=1
    shift
fi
if [[ $# -ne 1 ]]; then
    echo "usage: $0 [--sanitize] OUTDIR" >&2
    exit 2
fi
outdir=$1
root=$(cd "$(dirname "$0")/.." && pwd)
src=$root/zend/transport/native
python=${PYTHON:-python3}
cxx=${CXX:-g++}

read -r py_include pybind_include suffix < <("$python" - <<'PY'
import sysconfig
import pybind11
print(sysconfig.get_paths()["include"], pybind11.get_include(), sysconfig.get_config_var("EXT_SUFFIX"))
PY
)

flags=(-std=c++17 -O2 -Wall -Wextra -Werror -fPIC -fvisibility=hidden -I"$py_include" -I"$pybind_include")
if [[ $sanitize -eq 1 ]]; then
    flags+=(-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
fi

mkdir -p "$outdir/obj"
objects=()
for name in text pool seal wire abort_notice admission mailboxes engine bindings; do
    echo "compiling $name.cpp"
    "$cxx" "${flags[@]}" -c "$src/$name.cpp" -o "$outdir/obj/$name.o"
    objects+=("$outdir/obj/$name.o")
done
"$cxx" "${flags[@]}" -shared "${objects[@]}" -lcrypto -o "$outdir/_engine$suffix"
echo "built $outdir/_engine$suffix"
