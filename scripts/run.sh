#!/usr/bin/env bash
# The README's main job: install what is needed, build, and run the main program.
# Until replayssm-server exists (issue 5) the main program is replayssm-kernels-demo, which
# prints what this build will serve (backends, the tiny-gdn demo model, bytes per slot) and
# self-checks replay decode against the baseline on the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# The CUDA backend is built only where a GPU can run it; elsewhere the CPU backend serves.
preset=cpu
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then preset=cuda; fi
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" --target replayssm-kernels-demo
exec "./build-$preset/kernels/replayssm-kernels-demo"
