#!/usr/bin/env bash
# The container entrypoint's environment handling, against a stand-in server that prints its
# arguments: REPLAYSSM_<FLAG> becomes --<flag>=value (an empty one is unset), a REPLAYSSM_CONFIG
# naming a missing file stops it, and a variable that names no flag is warned about.
set -uo pipefail
entrypoint=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf '#!/bin/sh\nprintf "%%s\\n" "$@"\n' > "$dir/server"
chmod +x "$dir/server"
fail=0
check() {  # name, condition
  if ! eval "$2"; then echo "FAIL: $1"; fail=1; fi
}
run() {
  env -i PATH="$PATH" REPLAYSSM_SERVER_BIN="$dir/server" REPLAYSSM_CONFIG="${CONFIG-}" "$@" \
    bash "$entrypoint" --extra=1 >"$dir/out" 2>"$dir/err"
}

CONFIG=$dir/missing.conf run; rc=$?
check "a missing REPLAYSSM_CONFIG stops it" '[[ $rc == 2 ]] && grep -q "REPLAYSSM_CONFIG=.*: no such file" "$dir/err"'

touch "$dir/x.conf"
CONFIG=$dir/x.conf run REPLAYSSM_MEMORY_BUDGET=80G REPLAYSSM_METRICS_ADDRESS= REPLAYSSM_MEMORY_BUDGE=1G \
  REPLAYSSM_TP_SIZE= REPLAYSSM_SERVICE_HOST=10.0.0.1 REPLAYSSM_PORT_50051_TCP=tcp://10.0.0.1:50051
rc=$?
check "it runs" '[[ $rc == 0 ]]'
check "the config file" 'grep -qx -- "--config" "$dir/out" && grep -qx -- "$dir/x.conf" "$dir/out"'
check "a flag from the environment" 'grep -qx -- "--memory-budget=80G" "$dir/out"'
check "an empty variable is unset, where empty would mean off too" '! grep -q -- "--metrics-address" "$dir/out"'
check "an empty placeholder is skipped" '! grep -q -- "--tp-size" "$dir/out"'
check "and named" 'grep -q "REPLAYSSM_METRICS_ADDRESS REPLAYSSM_TP_SIZE: empty, so unset" "$dir/err"'
check "Kubernetes service variables are not named" '! grep -q "SERVICE_HOST\|PORT_50051" "$dir/err"'
check "arguments last" '[[ $(tail -n 1 "$dir/out") == "--extra=1" ]]'
check "a misspelled variable is named" 'grep -q "warning: REPLAYSSM_MEMORY_BUDGE names no flag" "$dir/err"'
check "and not passed" '! grep -q "memory-budge=" "$dir/out"'
check "known non-flag variables are not named" '! grep -q "SERVER_BIN\|REPLAYSSM_CONFIG" "$dir/err"'
# An empty security variable (a template's placeholder) never turns off what the config file
# turns on: the server reads an empty --auth-tokens, --tls-cert, ... as off.
CONFIG=$dir/x.conf run REPLAYSSM_AUTH_TOKENS= REPLAYSSM_TLS_CERT= REPLAYSSM_TLS_KEY= \
  REPLAYSSM_TLS_CLIENT_CA= REPLAYSSM_PEER_TOKEN= REPLAYSSM_TRANSFER_PEERS= \
  REPLAYSSM_KV_EVENTS_CURVE_SECRET_FILE= REPLAYSSM_KV_EVENTS_CLIENTS_FILE=
rc=$?
check "empty security variables: it runs" '[[ $rc == 0 ]]'
for flag in auth-tokens tls-cert tls-key tls-client-ca peer-token transfer-peers \
            kv-events-curve-secret-file kv-events-clients-file; do
  check "an empty variable passes no --$flag" '! grep -q -- "--$flag" "$dir/out"'
done
check "the empty security variables are named" 'grep -q "REPLAYSSM_AUTH_TOKENS .*: empty, so unset" "$dir/err"'
# The Deployment's args name the config file too: one --config reaches the server (two were
# refused, and every pod crash-looped).
env -i PATH="$PATH" REPLAYSSM_SERVER_BIN="$dir/server" REPLAYSSM_CONFIG="$dir/x.conf" \
  bash "$entrypoint" --config "$dir/x.conf" >"$dir/out" 2>"$dir/err"
check "one --config when the arguments name it" '[[ $(grep -cx -- --config "$dir/out") == 1 ]]'
env -i PATH="$PATH" REPLAYSSM_SERVER_BIN="$dir/server" REPLAYSSM_CONFIG="$dir/x.conf" \
  bash "$entrypoint" --config="$dir/x.conf" >"$dir/out" 2>"$dir/err"
check "or --config=FILE" '! grep -qx -- --config "$dir/out" && [[ $(grep -c -- --config "$dir/out") == 1 ]]'
exit $fail
