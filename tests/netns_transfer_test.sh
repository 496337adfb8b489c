#!/usr/bin/env bash
# A slot transfer that crosses a real interface: two network namespaces joined by a veth
# pair, a replayssm-server in each, UCX forced onto TCP, and the disaggregated demo (prefill
# on A, transfer, decode on B, every output checked against the CPU reference).
#   netns_transfer_test.sh SERVER_BINARY CLI_BINARY
# Exits 77 (ctest: skipped) only where namespaces cannot be made (not root, no CAP_NET_ADMIN).
set -euo pipefail
server=$1
cli=$2
a=rssm-a-$$
b=rssm-b-$$
va=rva$$
vb=rvb$$
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
if [[ $(id -u) != 0 ]] || ! ip netns add "$a" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here"
  exit 77
fi
ip netns add "$b"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$a"
ip link set "$vb" netns "$b"
ip -n "$a" addr add 10.231.$(( $$ % 200 )).1/24 dev "$va"
ip -n "$b" addr add 10.231.$(( $$ % 200 )).2/24 dev "$vb"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "$va" up
ip -n "$b" link set "$vb" up
addr_a=10.231.$(( $$ % 200 )).1
addr_b=10.231.$(( $$ % 200 )).2

start() {  # NS ADDRESS DEVICE NAME
  ip netns exec "$1" env UCX_TLS=tcp,self UCX_NET_DEVICES="$3" \
    "$server" --model tiny-gdn --device cpu --grpc-address "$2:50051" --metrics-address "" \
    --track-interval 16 --ready-file "$dir/$4.ready" >"$dir/$4.log" 2>&1 &
  pids+=($!)
}
start "$a" "$addr_a" "$va" a
start "$b" "$addr_b" "$vb" b
for _ in $(seq 200); do
  [[ -f $dir/a.ready && -f $dir/b.ready ]] && break
  sleep 0.05
done
if [[ ! -f $dir/a.ready || ! -f $dir/b.ready ]]; then
  echo "servers did not start"; cat "$dir"/*.log; exit 1
fi
# The client runs in A; B is reached over the veth only (nothing else connects the two).
out=$(ip netns exec "$a" "$cli" --address "$addr_a:50051" demo --seed 5 \
  --disaggregated "$addr_b:50051" 2>&1) || { echo "$out"; cat "$dir"/*.log; exit 1; }
echo "$out"
grep -q "to the decode server $addr_b:50051 over UCX" <<<"$out"
grep -q "demo: OK" <<<"$out"
echo "PASS: prefill in $a, transfer over $va <-> $vb (UCX tcp), decode in $b"
