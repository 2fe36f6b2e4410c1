#!/usr/bin/env bash
# Every test on a fresh machine: install what is missing (Debian packages, LibTorch via PyPI torch, the Python
# references), build everything, then run the C++ unit tests and the Python parity/CLI tests through CTest.
# Extra arguments go to ctest (for example: -R parity -V).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
start=$(date +%s)
"$TITAN_ROOT/scripts/setup.sh"
"$TITAN_ROOT/scripts/build.sh"
cd "$TITAN_BUILD"
status=0
ctest --output-on-failure -j "$(nproc)" "$@" || status=$?
echo "[test] finished in $(( $(date +%s) - start ))s with status $status"
exit $status
