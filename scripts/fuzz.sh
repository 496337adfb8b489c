#!/usr/bin/env bash
# Builds the libFuzzer targets (the `fuzz` preset: clang, ASan + UBSan) and runs each for a
# bounded time over its committed corpus (fuzz/corpus/<target>/), two at a time. Fails on any
# crash, UB report, leak, slow input (> 10 s) or out-of-memory; the input that did it is left
# in build-fuzz/artifacts/ — fix the bug and commit the input as fuzz/corpus/<target>/crash-*
# (the normal suite then replays it: ctest -R FuzzCorpus).
#   scripts/fuzz.sh [SECONDS_PER_TARGET]    default 60
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
targets=(server_config hf_config safetensors requests)
./scripts/install-deps.sh
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz
rm -rf build-fuzz/artifacts build-fuzz/new-corpus
mkdir -p build-fuzz/artifacts

# run TARGET: new inputs go to build-fuzz/new-corpus/TARGET; the committed corpus is read only.
run() {
  local target=$1
  mkdir -p "build-fuzz/new-corpus/$target"
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "./build-fuzz/fuzz/fuzz-${target//_/-}" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/artifacts/$target-" \
    "build-fuzz/new-corpus/$target" "fuzz/corpus/$target" >"build-fuzz/fuzz-$target.log" 2>&1
}

status=0
for ((i = 0; i < ${#targets[@]}; i += 2)); do
  pids=()
  for t in "${targets[@]:i:2}"; do
    run "$t" &
    pids+=("$!:$t")
  done
  for p in "${pids[@]}"; do
    if wait "${p%%:*}"; then
      echo "fuzz: ${p#*:}: $(grep -Eo 'stat::number_of_executed_units: *[0-9]+' \
        "build-fuzz/fuzz-${p#*:}.log" | grep -Eo '[0-9]+$') runs in ${seconds}s, no crash"
    else
      status=1
      echo "fuzz: ${p#*:} FAILED (build-fuzz/fuzz-${p#*:}.log):" >&2
      tail -n 60 "build-fuzz/fuzz-${p#*:}.log" >&2
    fi
  done
done
if [[ $status -ne 0 ]]; then ls -l build-fuzz/artifacts >&2; fi
exit $status
