#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build titan, and train the debug model on the built-in
# corpus (configs/debug_model.toml). Extra arguments are passed to `titan train`, e.g. --training.steps 100.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$TITAN_ROOT/scripts/setup.sh" --no-test-deps
"$TITAN_ROOT/scripts/build.sh" --target titan
cd "$TITAN_ROOT"
exec "$TITAN_BUILD/bin/titan" train --job.config_file configs/debug_model.toml "$@"
