#!/usr/bin/env bash
# The README's main job: install what is needed, build, start replayssm-server with the
# tiny-gdn demo model (CUDA where a GPU is present, else the embedded CPU backend), run the
# demo scheduler against it (`replayssm-cli demo`: prefill, batched decode, a prefix hit,
# every output checked against the CPU reference), and leave the server running.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# The CUDA backend is built only where it can be built (nvcc: the CUDA toolkit, which this
# script does not install) and run (a GPU of compute capability 9.0 or later: the kernels are
# sm_90's); elsewhere the CPU backend serves. A driver alone brings nvidia-smi, not nvcc.
preset=cpu
nvcc=$(command -v nvcc || true)
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
if [[ -n "$nvcc" ]] && command -v nvidia-smi >/dev/null; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 || true)
  if [[ "${cap%%.*}" =~ ^[0-9]+$ ]] && ((${cap%%.*} >= 9)); then
    preset=cuda
    export CUDACXX="$nvcc"
  else
    echo "run.sh: no GPU of compute capability 9.0+ (${cap:-none}): the CPU backend serves" >&2
  fi
fi
cmake --preset "$preset" -DREPLAYSSM_SERVICE=ON >/dev/null
cmake --build --preset "$preset" --target replayssm-server replayssm-cli

build="build-$preset"
grpc_address=${REPLAYSSM_GRPC_ADDRESS:-127.0.0.1:50051}
metrics_address=${REPLAYSSM_METRICS_ADDRESS:-127.0.0.1:9400}
pidfile="$build/replayssm-server.pid"
log="$build/replayssm-server.log"
ready="$build/replayssm-server.ready"

# A server this script started before is stopped (gracefully) first: its drain may take
# --drain-timeout (30 s). A pid reused since by another program is left alone.
if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null &&
  grep -qa replayssm-server "/proc/$(cat "$pidfile")/cmdline" 2>/dev/null; then
  kill -TERM "$(cat "$pidfile")"
  for _ in $(seq 400); do kill -0 "$(cat "$pidfile")" 2>/dev/null || break; sleep 0.1; done
fi
rm -f "$ready"
nohup "./$build/service/replayssm-server" --model tiny-gdn --device auto \
  --grpc-address "$grpc_address" --metrics-address "$metrics_address" \
  --ready-file "$ready" >"$log" 2>&1 &
echo $! >"$pidfile"
for _ in $(seq 300); do [[ -f "$ready" ]] && break; sleep 0.1; done
if [[ ! -f "$ready" ]]; then
  echo "replayssm-server did not start; its log ($log):" >&2
  cat "$log" >&2
  exit 1
fi
cat "$log"

"./$build/client/replayssm-cli" --address "$grpc_address" demo

cat <<MSG

replayssm-server is running (pid $(cat "$pidfile"), log $log):
  gRPC      $grpc_address   (replayssm.v1.ReplaySsm, grpc.health.v1, reflection)
  metrics   http://$metrics_address/metrics
Try:   ./$build/client/replayssm-cli --address $grpc_address info
       ./$build/client/replayssm-cli --address $grpc_address stats
       curl -s http://$metrics_address/metrics | grep ^replayssm_
Stop:  kill -TERM $(cat "$pidfile")    (drains open forwards, then exits)
API:   docs/api.md
MSG
