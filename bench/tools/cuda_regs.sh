#!/bin/bash
# Registers and spills of every v7 step-kernel instantiation (BulkStepKernel<state, TT, KC, RB,
# KDA>), from ptxas for sm_90, without building the project: a change that moves a hot
# instantiation into spills shows here before it costs a device call.
#   bench/tools/cuda_regs.sh            (run from anywhere; needs nvcc)
# The nvcc flags follow kernels/cuda/CMakeLists.txt (cuda_v7_nvcc.sh); the build itself only
# warns on spills (-Xptxas=-warn-spills), this also prints the registers.
# Hot instantiations of the benchmark shape (K = 128): decode <.,1,4,8,.>, verify <.,4,4,4,.>.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$root/bench/tools/cuda_v7_nvcc.sh"
v7_nvcc "$tmp" -Xptxas -v -c -o "$tmp/regs.o" 2>&1 |
  python3 -c '
import re, sys
cur = None
for line in sys.stdin:
    m = re.search(r"Compiling entry function .(\S+).", line)
    if m:
        k = re.search(r"BulkStepKernelI(\w+?)Li(\d)ELi(\d)ELi(\d)ELb(\d)", m.group(1))
        cur, spill = None, "?"
        if k:
            st = "f32" if k.group(1) == "f" else "bf16"
            cur = f"{st:4s} TT={k.group(2)} KC={k.group(3)} RB={k.group(4)} " + ("KDA" if k.group(5) == "1" else "GDN")
        continue
    if cur and "Used" in line:
        regs = re.search(r"Used (\d+) registers", line).group(1)
        print(f"{cur}: {regs} registers, spills {spill}")
        cur = None
    elif cur and "spill" in line:
        s = re.findall(r"(\d+) bytes spill (stores|loads)", line)
        spill = ", ".join(f"{n} B {kind}" for n, kind in s)
'
