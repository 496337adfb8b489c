#!/usr/bin/env bash
# Container entrypoint of replayssm-server. Turns REPLAYSSM_<FLAG> environment variables into
# --<flag>=value (REPLAYSSM_MEMORY_BUDGET=80G -> --memory-budget=80G), adds
# --config $REPLAYSSM_CONFIG (default /etc/replayssm/replayssm.conf) when that file exists (a
# REPLAYSSM_CONFIG set to a missing file stops it, exit 2), skips (and names) the empty ones,
# warns of REPLAYSSM_* variables that name no flag, and execs the server so that it is PID 1 and receives SIGTERM itself (graceful drain).
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
       max-request-id-bytes max-import-tokens max-streams max-planned-forwards tenant-max-streams
       tenant-max-slots
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
# The container's own --config (the shipped Deployment names the file in its args) wins: two
# are refused by the server ("expected one file"), which left every pod crash-looping.
config_in_args=0
for a in "$@"; do [[ "$a" == --config || "$a" == --config=* ]] && config_in_args=1; done
if ((config_in_args)); then
  :
elif [[ -f "$config" ]]; then
  args+=(--config "$config")
elif [[ -n "${REPLAYSSM_CONFIG:-}" ]]; then
  # Named, and not there: the server would start on its defaults (loopback, no TLS, no tokens).
  echo "replayssm-entrypoint: REPLAYSSM_CONFIG=$REPLAYSSM_CONFIG: no such file" >&2
  exit 2
fi
# A set but empty variable is unset: the flag is not passed, and the config file's value (or
# the default) holds. Passing it gave the flag an empty value, which for --auth-tokens,
# --tls-cert, --tls-client-ca, --peer-token, --transfer-peers and the CURVE files means
# off (or any peer): a template's empty placeholder (REPLAYSSM_AUTH_TOKENS: "") silently
# undid the config file's security. An empty value on purpose goes in the arguments
# (--metrics-address=), where nothing is a placeholder.
declare -A known=()
empty=()
for flag in "${flags[@]}"; do
  var="REPLAYSSM_${flag//-/_}"
  var=${var^^}
  known[$var]=1
  if [[ -n "${!var:-}" ]]; then
    args+=("--${flag}=${!var}")
  elif [[ -n "${!var+set}" ]]; then
    empty+=("$var")
  fi
done
if ((${#empty[@]})); then
  echo "replayssm-entrypoint: ${empty[*]}: empty, so unset (not passed); to give a flag an" \
    "empty value, pass --<flag>= as an argument" >&2
fi
# A misspelled variable (REPLAYSSM_MEMORY_BUDGE) was dropped without a word. The server and
# the tools in its image read a few that are no flags; any other is named.
for var in SERVER_BIN CONFIG CPU_THREADS CPU_FAULT_FILE CPU_FAIL_CALLS TOKEN ADDRESS; do known[REPLAYSSM_$var]=1; done
# Kubernetes adds REPLAYSSM_SERVICE_HOST, REPLAYSSM_PORT_... for a Service named replayssm.
while IFS='=' read -r var _; do
  if [[ "$var" == REPLAYSSM_* && -z "${known[$var]:-}" && "$var" != REPLAYSSM_SERVICE_* &&
        "$var" != REPLAYSSM_PORT* ]]; then
    echo "replayssm-entrypoint: warning: $var names no flag of replayssm-server: ignored" >&2
  fi
done < <(env)
exec "$server" "${args[@]}" "$@"
