#!/bin/bash
# One device call's worth of GPU checks, run on the GPU machine from a bundle of the `cuda`
# preset's binaries (docs/gpu.md, "Building and testing on the GPU"): the suites with a CUDA
# path, the kernel benchmark by both methods, and on a machine of two or more GPUs the tensor-
# parallel runs only such a machine can make (bench/results/tp.md, "Not run").
#   bench/tools/gpu_check.sh OUT_DIR [tests|bench|tp ...]   (default: tests bench tp)
# Each step runs under its own time limit and logs to OUT_DIR/<step>.log; a summary line per
# step goes to OUT_DIR/summary.txt and stdout. Exits 1 if any step failed. Needs the bundle's
# env.sh sourced (PATH, LD_LIBRARY_PATH) and REPLAYSSM_SERVER_BINARY for the service tests.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [tests|bench|tp ...]}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench tp)
mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
failed=0
run() {  # run NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local line="$name: rc=$rc in $((SECONDS - t0)) s: $(tail -n 1 "$out/$name.log")"
  echo "$line" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || failed=1
}
mps_on() { nvidia-cuda-mps-control -d 2>/dev/null || true; }
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null || true; }

echo "gpus=$gpus $(date -u +%FT%TZ)" | tee "$out/summary.txt"
for step in "${steps[@]}"; do
  case $step in
    tests)
      # By its path: the death test re-executes argv[0], which a bare name on PATH is not.
      run kernel_tests 400 "$(command -v replayssm_cuda_kernel_tests)"
      run cache_tests 400 env REPLAYSSM_TEST_BACKEND=cuda replayssm_cache_tests
      mps_on
      run service_tests 400 env REPLAYSSM_TEST_DEVICE=cuda replayssm_service_tests \
        --gtest_filter='Engine/*:*DataPlane*:CacheEvents*:ZmqEvents*-DataPlaneTest.BadRegions*'
      mps_off
      ;;
    bench)
      run kernels_bench 590 replayssm-bench kernels --method both --json "$out/kernels.json"
      ;;
    tp)
      if [ "$gpus" -lt 2 ]; then
        echo "tp: skipped, $gpus GPU(s)" | tee -a "$out/summary.txt"
        continue
      fi
      run tp_tests 400 env REPLAYSSM_TEST_BACKEND=cuda replayssm_cache_tests \
        --gtest_filter='*Tp*:*SlotIo*'
      for pair in "2 1" "1 2" "2 2" "1 1"; do
        set -- $pair
        run "transfer_tp$1_to_tp$2" 300 replayssm-bench-transfer --backend cuda --slots 10 \
          --sender-tp "$1" --receiver-tp "$2"
      done
      run cache_tp2 300 replayssm-bench-cache --backend cuda --batch 64,256 --io device \
        --rounds 7 --steps 10 --tp-size 2
      mps_on
      run dataplane_tp2 400 replayssm-bench-dataplane --server "$REPLAYSSM_SERVER_BINARY" \
        --tp-size 2 --devices 0,1 --batch 1,64,256 --forwards 20 --json "$out/dataplane.json"
      mps_off
      ;;
    *) echo "unknown step $step" | tee -a "$out/summary.txt"; failed=1 ;;
  esac
done
exit $failed
