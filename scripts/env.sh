# Shared paths for titan.cpp scripts; sourced, not executed.
# TITAN_CACHE holds the Python venv with the PyPI torch wheel (LibTorch) and the ccache store, outside the repo,
# so fresh clones and CI reuse them.
TITAN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TITAN_CACHE="${TITAN_CACHE:-$HOME/.cache/titan}"
TITAN_VENV="$TITAN_CACHE/venv"
TITAN_PYTHON="$TITAN_VENV/bin/python"
TITAN_TORCH_VERSION="${TITAN_TORCH_VERSION:-2.15.0}"
TITAN_PYARROW_VERSION="${TITAN_PYARROW_VERSION:-26.0.1}"
TITAN_BUILD="${TITAN_BUILD:-$TITAN_ROOT/build}"
export CCACHE_DIR="${CCACHE_DIR:-$TITAN_CACHE/ccache}"
# Paths under the repository are hashed relative to it, so separate clones share cache entries.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$TITAN_ROOT}"
export TITAN_ROOT TITAN_CACHE TITAN_VENV TITAN_PYTHON TITAN_BUILD
