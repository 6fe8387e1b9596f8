#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz_reader, fuzz_pipeline) from csrc/ with clang, ASan and
# UBSan, into build/fuzz-san/ (or $1). Needs clang with its fuzzer runtime (Debian: apt-get
# install clang). Exits 3 without building when clang++ is absent, so callers can skip.
#
#   tests/fuzz/build.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${1:-build/fuzz-san}"
cxx="${CXX_FUZZ:-clang++}"
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "build.sh: $cxx not found; the fuzzers need clang (apt-get install clang)" >&2
  exit 3
fi
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S . -B "$build" "${generator[@]}" -DFASTOPT_FUZZ=ON -DFASTOPT_WERROR=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
fi
cmake --build "$build" --target fuzz_reader fuzz_pipeline -j "${FUZZ_BUILD_JOBS:-2}"
echo "built: $build/fuzz_reader $build/fuzz_pipeline"
