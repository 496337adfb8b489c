#!/usr/bin/env bash
# Installs every system dependency of replayssm from Debian 12's packages.
# Idempotent; needs root (or sudo). Nothing is downloaded at build time.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PKGS=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libucx-dev ucx-utils prometheus-cpp-dev
  # Cache events (docs/api.md): the ZMQ publisher in vLLM's KV-events wire format (msgpack).
  libzmq3-dev libmsgpack-cxx-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libssl-dev zlib1g-dev libc-ares-dev libre2-dev
  curl openssl
  # scripts/fuzz.sh: clang and its runtime libraries (libclang_rt.fuzzer, asan, ubsan).
  clang libclang-rt-dev
  prometheus python3
  # client/python: its runtime, the offline install into a venv (docs/python.md), and
  # protoc's gRPC Python plugin (protobuf-compiler-grpc, above) for its stubs.
  python3-grpcio python3-protobuf python3-numpy python3-setuptools python3-wheel
  python3-zmq python3-msgpack
  python3-pip python3-venv
)
# deploy/ checks (ctest -R deploy): node + npm for `npm ci` of deploy/tools. Machines whose
# nodejs comes with its own npm (NodeSource) must not get Debian's npm, which conflicts.
if ! command -v npm >/dev/null 2>&1; then PKGS+=(nodejs npm); fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
