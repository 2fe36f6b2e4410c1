#!/usr/bin/env bash
# Every test on a fresh machine: install what is missing (Debian packages, LibTorch via PyPI torch, the Python
# references), build everything, then run the C++ unit tests and the Python parity/CLI tests through CTest.
# Extra arguments go to ctest (for example: -R parity -V).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
start=$(date +%s)
"$TITAN_ROOT/scripts/setup.sh"
"$TITAN_ROOT/scripts/build.sh"
# The sanitized build (clang, ASan + UBSan + libFuzzer): unit tests and short fuzz runs. TITAN_SKIP_SANITIZE=1 skips it.
sanitize_build="$TITAN_ROOT/build-asan"
if [[ "${TITAN_SKIP_SANITIZE:-0}" != 1 ]]; then
  TITAN_BUILD="$sanitize_build" TITAN_BUILD_TYPE=Sanitize \
    TITAN_CMAKE_ARGS="-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTITAN_SANITIZE=ON" "$TITAN_ROOT/scripts/build.sh"
fi
status=0
# The sources must keep compiling against LibTorch 2.11 (the GPU machines'): the version-dependent files, syntax only.
"$TITAN_ROOT/scripts/check_oldest_libtorch.sh" || status=$?
(cd "$TITAN_BUILD" && ctest --output-on-failure -j "$(nproc)" "$@") || status=$?
if [[ "${TITAN_SKIP_SANITIZE:-0}" != 1 ]]; then
  (cd "$sanitize_build" && ctest --output-on-failure -j "$(nproc)" "$@") || status=$?
fi
echo "[test] finished in $(( $(date +%s) - start ))s with status $status"
exit $status
