#!/bin/sh
# The zend image's entry point (deploy/Dockerfile): `zend "$@"`, with the numba kernels the image
# compiled when it was built.
#
# They lie in $ZEN_NUMBA_PREBUILT (/opt/zen/numba-cache), read-only like the rest of the image,
# compiled for the CPU level its CPU_LEVEL file names (x86-64-v3 by default: any x86 CPU with AVX2,
# FMA and BMI2, Haswell and Zen on, as fast as code for the exact CPU in our benchmark; `host`: the
# build machine's CPU, which loads only on a CPU of the same model). numba wants a
# writable cache folder, so they are copied into $NUMBA_CACHE_DIR (on the /tmp tmpfs) on the
# folder's first use, and numba told to compile for that level: it loads them instead of compiling
# them at every start. On a CPU without that level, or with NUMBA_CPU_NAME set, numba compiles for
# the CPU at the first steps, as without them; ZEN_NUMBA_PREBUILT set empty does the same.
set -e
prebuilt=${ZEN_NUMBA_PREBUILT:-}
cache=${NUMBA_CACHE_DIR:-}

# whether this CPU runs code for LLVM's CPU name $1 (the levels of x86-64; any other name is trusted)
runs_level() {
    case $1 in
        x86-64-v2) need="cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3" ;;
        x86-64-v3) need="cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave" ;;
        x86-64-v4) need="cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave
                         avx512f avx512bw avx512cd avx512dq avx512vl" ;;
        *) return 0 ;;
    esac
    flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
    for flag in $need; do
        case $flags in *" $flag "*) ;; *) return 1 ;; esac
    done
}

if [ -n "$prebuilt" ] && [ -n "$cache" ] && [ -r "$prebuilt/CPU_LEVEL" ]; then
    level=$(cat "$prebuilt/CPU_LEVEL")
    if [ "$level" != host ] && [ -z "${NUMBA_CPU_NAME:-}" ] && runs_level "$level"; then
        export NUMBA_CPU_NAME="$level" NUMBA_CPU_FEATURES=""
    fi
    # once per cache folder (an emptyDir outlives a container's restart, with what numba added to it)
    if [ ! -e "$cache/CPU_LEVEL" ]; then
        mkdir -p "$cache" && cp -R "$prebuilt/." "$cache/" \
            || echo "zend entrypoint: could not copy $prebuilt into $cache: numba compiles the kernels" >&2
    fi
fi
exec zend "$@"
