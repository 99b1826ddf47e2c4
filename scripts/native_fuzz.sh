#!/usr/bin/env bash
# Fuzzes zend._engine's parsers (the frame parser, clear and sealed, and the abort notice parser:
# zend/transport/native/fuzz_frames.cpp) for SECONDS, starting from zend/transport/native/corpus/
# (scripts/native_corpus.py writes it).
#
#   scripts/native_fuzz.sh SECONDS
#
# With clang++: libFuzzer (-fsanitize=fuzzer,address,undefined), new inputs kept in a scratch copy
# of the corpus (the committed corpus is not touched). Without clang++: says so, and builds the same
# target with g++ and fuzz_main.cpp under -fsanitize=address,undefined, which replays the corpus and
# then runs random mutations of it (a fixed seed) until SECONDS are up. Exit status: non-zero on a crash.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 SECONDS" >&2
    exit 2
fi
seconds=$1
root=$(cd "$(dirname "$0")/.." && pwd)
src=$root/zend/transport/native
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sources=("$src/fuzz_frames.cpp" "$src/wire.cpp" "$src/seal.cpp" "$src/abort_notice.cpp" "$src/text.cpp")
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -Wall -Wextra)

if command -v clang++ >/dev/null; then
    clang++ "${flags[@]}" -fsanitize=fuzzer,address,undefined "${sources[@]}" -lcrypto -o "$work/fuzz_frames"
    cp -r "$src/corpus" "$work/corpus"
    "$work/fuzz_frames" -max_total_time="$seconds" -rss_limit_mb=2048 "$work/corpus"
else
    echo "clang++ not found: no libFuzzer; replaying the corpus and random mutations with a g++ build instead"
    g++ "${flags[@]}" -fsanitize=address,undefined -fno-sanitize-recover=undefined "${sources[@]}" \
        "$src/fuzz_main.cpp" -lcrypto -o "$work/fuzz_frames_replay"
    "$work/fuzz_frames_replay" "$seconds" "$src/corpus"
fi
