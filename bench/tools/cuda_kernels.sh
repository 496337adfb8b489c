#!/bin/bash
# Every kernel instantiation of the CUDA backend as ptxas builds it for sm_90, without building
# the project: registers, spill bytes and an md5 of its machine code.
#   bench/tools/cuda_kernels.sh [ROOT]     (ROOT: a checkout, default this one; needs nvcc)
# Compare two checkouts (before and after a refactor) with
#   diff <(bench/tools/cuda_kernels.sh /tmp/before) <(bench/tools/cuda_kernels.sh)
# Equal lines mean the same machine code; a kernel renamed keeps its line (names are printed
# by role). A change that moves a hot instantiation into spills shows here before it costs a
# device call. Hot instantiations of the benchmark shape (K = 128): bulk <.,1,4,8,.> (decode),
# <.,4,4,4,.> (verify).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "${1:-$here/../..}" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$here/cuda_nvcc.sh"
for dtype in f32 bf16 f16 f32_ring_bf16 f32_ring_f16; do
  kernels_nvcc "$root" -cubin -Xptxas -v -o "$tmp/$dtype.cubin" \
    "$root/kernels/cuda/kernels_$dtype.cu" > "$tmp/$dtype.log" 2>&1 || { cat "$tmp/$dtype.log"; exit 1; }
done
python3 - "$tmp" <<'PY'
import hashlib, re, struct, sys

def text_sections(path):
    """(kernel, machine code) of every .text.<kernel> section of a 64-bit ELF cubin."""
    b = open(path, "rb").read()
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    names = hdrs[shstrndx][4]
    for h in hdrs:
        n = b[names + h[0]:b.index(b"\0", names + h[0])].decode()
        if n.startswith(".text."):
            yield n[6:], b[h[4]:h[4] + h[5]]

ROLE = {"BulkStepKernel": "bulk", "StepKernel": "tiled", "TiledStepKernel": "tiled",
        "PrefillKernel": "prefill"}
TYPE = {"f": "f32", "13__nv_bfloat16": "bf16", "6__half": "f16"}

def label(mangled):
    m = re.search(r"cuda\d+(\w+?Kernel)I(f|13__nv_bfloat16|6__half)((?:L[ib]\d+E)*)E", mangled)
    if not m:
        return mangled
    args = [TYPE[m.group(2)]] + re.findall(r"L[ib](\d+)E", m.group(3))
    return f"{ROLE.get(m.group(1), m.group(1))}<{','.join(args)}>"

tmp = sys.argv[1]
for dtype in ("f32", "bf16", "f16", "f32_ring_bf16", "f32_ring_f16"):
    info, cur = {}, None
    for line in open(f"{tmp}/{dtype}.log"):
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = m.group(1)
            info[cur] = {"spill": "0+0"}
        elif cur and "spill stores" in line:
            s = re.findall(r"(\d+) bytes spill (stores|loads)", line)
            info[cur]["spill"] = "+".join(n for n, _ in s)
        elif cur and "Used" in line:
            info[cur]["regs"] = re.search(r"Used (\d+) registers", line).group(1)
    rows = []
    for name, code in text_sections(f"{tmp}/{dtype}.cubin"):
        if name not in info:
            continue  # not a kernel of ours (none expected)
        i = info[name]
        rows.append(f"{label(name):24s} regs {i['regs']:>3s} spill {i['spill']:>9s} "
                    f"sass {len(code) // 16:6d} {hashlib.md5(code).hexdigest()[:12]}")
    print("\n".join(sorted(rows)))
PY
