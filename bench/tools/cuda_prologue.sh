#!/bin/bash
# Does any bulk step kernel read a row's metadata (slot, cursor, forced fold) before it issues
# its token loads? A use there (a branch on the cursor, a pointer computed from the slot) makes
# every warp wait for the metadata's round trip before its q/k/v loads go out. From the PTX,
# without building the project:
#   bench/tools/cuda_prologue.sh [ROOT]     (ROOT: a checkout, default this one; needs nvcc)
# Per instantiation: how many global loads are issued between the metadata loads and the first
# instruction that reads one of them (the per-row scalars alone are at most 4 loads). Verify
# issues every token load first (60 or more); 16-bit decode keeps the order through an empty
# asm in IssueRecords (7); fp32 decode lets the compiler hoist the records' address arithmetic
# ahead of the token loads, by choice (measured faster), and is reported so.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "${1:-$here/../..}" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$here/cuda_nvcc.sh"
for dtype in f32 bf16; do
  kernels_nvcc "$root" -ptx -o "$tmp/$dtype.ptx" "$root/kernels/cuda/kernels_$dtype.cu"
done
cat "$tmp/f32.ptx" "$tmp/bf16.ptx" > "$tmp/order.ptx"
python3 - "$tmp/order.ptx" <<'PY'
import re, sys
MIN_LOADS = 5  # more than the per-row scalars (a_log, dt_bias, GDN's a and b: at most 4)
text = open(sys.argv[1]).read()
bad = 0
for m in re.finditer(r"\.entry (\S*BulkStepKernel\S*)\((.*?)\n}\n", text, re.S):
    name, body = m.group(1), m.group(2).split("\n")
    k = re.search(r"BulkStepKernelI(\w+?)Li(\d)ELi(\d)ELi(\d)ELb(\d)", name)
    st = "f32" if k.group(1) == "f" else "bf16"
    label = f"{st:4s} TT={k.group(2)} KC={k.group(3)} RB={k.group(4)} " + ("KDA" if k.group(5) == "1" else "GDN")
    # The metadata: the kernel's first loads of slot_idx (32-bit), write_pos (32-bit) and
    # force_fold (8-bit), in that order.
    meta, first = [], None
    for i, line in enumerate(body):
        lm = re.match(r"\s*ld\.global\.(s32|u32|u8)\s+(%\w+),", line)
        if lm and len(meta) < 3:
            meta.append(lm.group(2))
            first = i
            continue
        if len(meta) == 3:
            break
    if len(meta) < 3:
        print(f"{label}: metadata loads not found"); bad += 1; continue
    regs = re.compile("|".join(re.escape(r) + r"\b" for r in meta))
    loads = 0
    for line in body[first + 1:]:
        ops = line.split(None, 1)
        if len(ops) < 2 or ops[0].startswith("//"):
            continue
        if ops[0].startswith("ld.global"):
            loads += 1
            continue
        args = ops[1].split(",", 1)
        # a read: the register among the operands after the destination (or any operand of a
        # branch or store)
        srcs = ops[1] if ops[0].startswith(("st.", "@", "bra")) else (args[1] if len(args) > 1 else "")
        if regs.search(srcs):
            break
    ok = loads >= MIN_LOADS
    chosen = not ok and st == "f32" and k.group(2) == "1"  # fp32 decode keeps the hoist
    bad += not ok and not chosen
    verdict = "ok" if ok else "fp32 decode, by choice" if chosen else "FAIL"
    print(f"{label}: {loads} global loads before the first read of the metadata  {verdict}")
sys.exit(1 if bad else 0)
PY
