#!/usr/bin/env bash
# Container entrypoint of replayssm-server. Turns REPLAYSSM_<FLAG> environment variables into
# --<flag>=value (REPLAYSSM_MEMORY_BUDGET=80G -> --memory-budget=80G), adds
# --config $REPLAYSSM_CONFIG (default /etc/replayssm/replayssm.conf) when that file exists,
# and execs the server so that it is PID 1 and receives SIGTERM itself (graceful drain).
#
# Precedence (the server lets command-line flags win over the config file, and the last of
# two equal flags win): arguments given to the container > REPLAYSSM_* environment > config
# file > built-in defaults.
set -euo pipefail

server=${REPLAYSSM_SERVER_BIN:-replayssm-server}
config=${REPLAYSSM_CONFIG:-/etc/replayssm/replayssm.conf}

# Every flag of `replayssm-server --help` but --config (deploy/tests/check_flags.py checks it).
flags=(grpc-address metrics-address model device tp-size devices memory-budget ring-length
       track-interval
       state-dtype ring-dtype beta-rounding max-batch forward-graphs max-prefill-tokens max-message-bytes dedup-entries dedup-bytes
       max-request-id-bytes max-import-tokens max-streams tenant-max-streams tenant-max-slots
       tenant-max-snapshots host-snapshot-bytes host-snapshot-policy host-spill-ahead host-pin-at-start slot-ttl
       cache-events-retain max-watchers tenant-max-watchers kv-events-endpoint
       kv-events-replay-endpoint
       kv-events-topic kv-events-tenant kv-events-curve-secret-file kv-events-clients-file
       tls-cert tls-key tls-client-ca transfer-peers transfer-interface
       transfer-reservations-per-peer
       region-ttl max-regions max-region-bytes forward-timeout stream-idle-timeout drain-timeout
       drain-wait-slots
       device-check-interval
       transfer-chunk-bytes
       transfer-lanes transfer-import-threads transfer-timeout transfer-lease
       transfer-max-concurrent auth-tokens peer-token ready-file)

args=()
if [[ -f "$config" ]]; then
  args+=(--config "$config")
fi
for flag in "${flags[@]}"; do
  var="REPLAYSSM_${flag//-/_}"
  var=${var^^}
  if [[ -n "${!var:-}" ]]; then
    args+=("--${flag}=${!var}")
  fi
done
exec "$server" "${args[@]}" "$@"
