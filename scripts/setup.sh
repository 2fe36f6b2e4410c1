#!/usr/bin/env bash
# Installs what a fresh Debian bookworm machine lacks to build and test titan.cpp; idempotent and quick when
# everything is already there. Usage: scripts/setup.sh [--no-test-deps]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

want_test_deps=1
[[ "${1:-}" == "--no-test-deps" ]] && want_test_deps=0

apt_packages=(g++ cmake ninja-build ccache pkg-config python3-venv
  libtomlplusplus-dev nlohmann-json3-dev libpcre2-dev libgtest-dev
  libopenmpi-dev openmpi-bin fortunes zlib1g-dev libzstd-dev libsentencepiece-dev zstd dict-gcide libicu-dev
  clang libclang-rt-14-dev)  # clang: the sanitized unit tests and libFuzzer harnesses (build-asan)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

mkdir -p "$TITAN_CACHE"
if [[ ! -x "$TITAN_PYTHON" ]]; then
  echo "[setup] creating Python venv at $TITAN_VENV"
  python3 -m venv "$TITAN_VENV"
  "$TITAN_PYTHON" -m pip install -q --upgrade pip
fi
have_torch=$("$TITAN_PYTHON" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
if [[ "$have_torch" != "$TITAN_TORCH_VERSION" ]]; then
  echo "[setup] installing PyPI torch==$TITAN_TORCH_VERSION (LibTorch for the build; several GB, once)"
  "$TITAN_PYTHON" -m pip install -q "torch==$TITAN_TORCH_VERSION"
fi
have_pyarrow=$("$TITAN_PYTHON" -c "import importlib.metadata as m; print(m.version('pyarrow'))" 2>/dev/null || true)
if [[ "$have_pyarrow" != "$TITAN_PYARROW_VERSION" ]]; then
  echo "[setup] installing PyPI pyarrow==$TITAN_PYARROW_VERSION (Arrow C++ for reading Parquet)"
  "$TITAN_PYTHON" -m pip install -q "pyarrow==$TITAN_PYARROW_VERSION"
fi
if ((want_test_deps)); then
  req="$TITAN_ROOT/scripts/requirements-test.txt"
  stamp="$TITAN_CACHE/.test-deps-$(sha1sum "$req" | cut -c1-12)"
  if [[ ! -f "$stamp" ]]; then
    echo "[setup] installing test references from PyPI (transformers, tokenizers, tiktoken, ...)"
    "$TITAN_PYTHON" -m pip install -q -r "$req"
    touch "$stamp"
  fi
fi
echo "[setup] ok: torch $("$TITAN_PYTHON" -c 'import torch; print(torch.__version__)') in $TITAN_VENV"
