#!/usr/bin/env bash
# The README's main job: install what is needed, build, and run the main program.
# Until replayssm-server exists (issue 5) the main program is replayssm-kernels-demo, which
# prints what this build will serve (backends, the tiny-gdn demo model, bytes per slot) and
# self-checks replay decode against the baseline on the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
preset=default
[ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null || preset=cpu
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" --target replayssm-kernels-demo
dir=build
[ "$preset" = cpu ] && dir=build-cpu
exec "./$dir/kernels/replayssm-kernels-demo"
