#!/usr/bin/env bash
# The include graph points one way: service -> transfer -> cache -> kernels (docs/layers.md).
# Fails, naming file:line, when a layer reaches past the one below it or into another
# layer's private headers, or when code above the cache touches streams or slot memory.
# Usage: layering_test.sh SOURCE_DIR
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

status=0
# forbid DIR REGEX WHY: every match of REGEX in DIR's C++ sources is a violation.
forbid() {
  local dir=$1 regex=$2 why=$3 hits
  hits=$(grep -rnE --include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh' \
         "$regex" "$dir" || true)
  if [[ -n "$hits" ]]; then
    echo "layering: $dir: $why:" >&2
    echo "$hits" >&2
    status=1
  fi
}

cache_private='#include "(lane|slot_pool|device_buffer|radix_tree|slot_io_internal|slot_checksum)\.h"'
kernel_abi='#include "replayssm/(kernels|checksum_v2)\.h"'
above_cache='#include "(replayssm/transfer/|replayssm/v1/|service/|grpcpp/)'

forbid kernels '#include "(replayssm/cache/|replayssm/transfer/|replayssm/v1/|service/|grpcpp/)' \
  "the kernels know nothing above them"
forbid cache "$above_cache" "the cache knows nothing of transfer, gRPC or the service"
forbid transfer "$kernel_abi" "transfer uses the cache's slot I/O, not the kernel ABI"
forbid transfer "$cache_private" "transfer uses the cache's public headers only"
forbid transfer '\brssm_[a-z_]+\(|cudaStream|cuda_runtime' "transfer calls no kernel ABI, holds no stream"
forbid transfer '#include "(replayssm/v1/|service/|grpcpp/)' "transfer knows nothing of gRPC or the service"
forbid service "$kernel_abi" "the service reaches the kernels only through the cache"
forbid service "$cache_private" "the service uses the cache's public headers only"
forbid service '#include "(task_pool|transfer_testing)\.h"' "the service uses transfer's public headers only"
forbid service '\brssm_(alloc|free|memcpy|memset|stream_[a-z]+|synchronize|segment_digests[a-z_]*)\(|cudaStream' \
  "the service touches no memory, stream or checksum of the backend"

if [[ $status -eq 0 ]]; then echo "layering: service -> transfer -> cache -> kernels holds"; fi
exit $status
