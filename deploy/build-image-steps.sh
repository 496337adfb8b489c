#!/usr/bin/env bash
# The build stage of deploy/Dockerfile as a script, so that CI runs the same steps on the host
# (there is no Docker engine there):
#   1. install the Debian/Ubuntu packages (scripts/install-deps.sh; REPLAYSSM_SKIP_DEPS=1 skips)
#   2. configure with a CMake preset (skipped when the build directory is configured already)
#   3. build replayssm-server and replayssm-cli
#   4. install them into a staging prefix (cmake --install, component "runtime"); with
#      --bundle-libs also copy the non-glibc shared libraries they load into
#      PREFIX/lib/replayssm (the runtime image has no -dev packages)
#   5. check the staged binaries: server --help lists its flags, the CLI prints its usage,
#      every shared library resolves (with LD_LIBRARY_PATH=PREFIX/lib/replayssm).
#
#   deploy/build-image-steps.sh [--preset cpu|cuda] [--build-dir DIR] [--prefix DIR] [--bundle-libs]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
preset=cpu
build_dir=""
prefix=""
bundle=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --preset) preset=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --prefix) prefix=$2; shift 2 ;;
    --bundle-libs) bundle=1; shift ;;
    *) echo "build-image-steps: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n "$build_dir" ]] || build_dir="$root/build-$preset"
[[ -n "$prefix" ]] || prefix="$build_dir/staging"
say() { echo "build-image-steps: $*"; }

if [[ "${REPLAYSSM_SKIP_DEPS:-0}" != 1 ]]; then
  say "1/5 install dependencies"
  "$root/scripts/install-deps.sh"
else
  say "1/5 dependencies: skipped (REPLAYSSM_SKIP_DEPS=1)"
fi

if [[ -f "$build_dir/CMakeCache.txt" ]]; then
  say "2/5 configure: $build_dir is configured already"
else
  say "2/5 configure: preset $preset in $build_dir"
  (cd "$root" && cmake --preset "$preset" -B "$build_dir" -DREPLAYSSM_TESTS=OFF)
fi

say "3/5 build replayssm-server replayssm-cli"
cmake --build "$build_dir" --target replayssm-server replayssm-cli -j "${REPLAYSSM_JOBS:-$(nproc)}"

say "4/5 install into $prefix"
rm -rf "$prefix"
cmake --install "$build_dir" --prefix "$prefix" --component runtime
for bin in replayssm-server replayssm-cli; do
  [[ -x "$prefix/bin/$bin" ]] || { say "FAIL: $prefix/bin/$bin was not installed"; exit 1; }
done
libdir="$prefix/lib/replayssm"
# The shared libraries `ldd` lists for the files given, but the C runtime and the driver (the
# runtime image has them, in the versions of its own), and libibverbs and librdmacm: the
# runtime stage installs them with the NIC's verbs providers (ibverbs-providers), which must
# be of their very version.
bundled_deps() {
  ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libcuda|libnvidia[^/]*|libibverbs|librdmacm)\.so'
}
if [[ $bundle == 1 ]]; then
  mkdir -p "$libdir"
  bundled_deps "$prefix/bin/replayssm-server" "$prefix/bin/replayssm-cli" |
    while read -r lib; do cp -L "$lib" "$libdir/"; done
  # UCX loads its transports but tcp and shared memory (cma, ib, rdmacm: RDMA and RoCE) as
  # modules from <libucs's directory>/ucx at run time: ldd lists none of them, and the image
  # could only move states over TCP (UCX_TLS=rc found nothing). They go beside libucs here,
  # with the libraries they need (libibverbs and librdmacm come from the runtime stage).
  ucs=$(ldd "$prefix/bin/replayssm-server" | awk '$1 ~ /^libucs\.so/ {print $3}')
  if [[ -n "$ucs" && -d "$(dirname "$ucs")/ucx" ]]; then
    mkdir -p "$libdir/ucx"
    cp -L "$(dirname "$ucs")"/ucx/*.so.0 "$libdir/ucx/"
    bundled_deps "$libdir"/ucx/*.so.0 | while read -r lib; do
      [[ -e "$libdir/$(basename "$lib")" ]] || cp -L "$lib" "$libdir/"
    done
  fi
  say "bundled $(ls "$libdir" | wc -l) shared libraries (and $(ls "$libdir/ucx" 2>/dev/null |
    wc -l) UCX modules) into $libdir"
fi

say "5/5 check the staged binaries"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for bin in replayssm-server replayssm-cli; do
  if ldd "$prefix/bin/$bin" | grep -q 'not found'; then
    ldd "$prefix/bin/$bin" | grep 'not found'
    say "FAIL: $bin has unresolved shared libraries"; exit 1
  fi
done
if [[ $bundle == 1 && -d "$libdir/ucx" ]]; then
  for m in "$libdir"/ucx/*.so.0; do
    if LD_LIBRARY_PATH="$libdir" ldd "$m" | grep -q 'not found'; then
      LD_LIBRARY_PATH="$libdir" ldd "$m" | grep 'not found'
      say "FAIL: UCX module $m has unresolved shared libraries"; exit 1
    fi
  done
fi
help=$("$prefix/bin/replayssm-server" --help)
for flag in --grpc-address --metrics-address --model --device --memory-budget --config; do
  grep -q -- "$flag" <<<"$help" || { say "FAIL: replayssm-server --help lacks $flag"; exit 1; }
done
usage=$("$prefix/bin/replayssm-cli" --help 2>&1)
grep -q 'health' <<<"$usage" || { say "FAIL: replayssm-cli --help lacks 'health'"; exit 1; }
if "$prefix/bin/replayssm-server" --no-such-flag=1 >/dev/null 2>&1; then
  say "FAIL: replayssm-server accepted an unknown flag"; exit 1
fi
say "OK: $(ls "$prefix/bin" | tr '\n' ' ')in $prefix"
