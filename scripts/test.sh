#!/usr/bin/env bash
# The README's test command: install what is needed, build, run every test with ctest.
#   scripts/test.sh          CPU backend build (what CI and machines without a GPU can run)
#   scripts/test.sh asan     the same suite under AddressSanitizer + UndefinedBehaviorSanitizer
# The CUDA tests need a GPU: see docs/gpu.md (built with the `cuda` preset, run on the H200).
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-cpu}
./scripts/install-deps.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
ctest --preset "$preset"
