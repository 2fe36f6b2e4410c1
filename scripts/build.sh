#!/usr/bin/env bash
# Configures (once) and builds titan.cpp into $TITAN_BUILD (default ./build) with Ninja, ccache and
# precompiled headers. Extra arguments go to cmake --build (for example: --target titan); TITAN_CMAKE_ARGS adds
# configure options (scripts/test.sh uses it for the sanitized build in build-asan).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
torch_cmake=$("$TITAN_PYTHON" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'share', 'cmake'))")
if [[ ! -f "$TITAN_BUILD/build.ninja" ]]; then
  cmake -S "$TITAN_ROOT" -B "$TITAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE="${TITAN_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$torch_cmake" -DTITAN_PYTHON="$TITAN_PYTHON" ${TITAN_CMAKE_ARGS:-}
fi
start=$(date +%s)
cmake --build "$TITAN_BUILD" -j "$(nproc)" "$@"
echo "[build] done in $(( $(date +%s) - start ))s"
