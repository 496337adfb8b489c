#!/bin/bash
# Whether a refactor kept each kernel's instruction stream: compiles one CUDA unit of two
# checkouts to PTX and compares every kernel's PTX with its virtual registers and labels
# numbered away (they follow the front end's value order, which moves with any restructuring
# and then moves ptxas's register assignment — and cuda_kernels.sh's md5 — without changing an
# instruction).
#   bench/tools/cuda_ptx.sh BEFORE AFTER [UNIT [FILTER]]
#     UNIT: f32 (default), bf16, f16, f32_ring_bf16, f32_ring_f16 (kernels/cuda/kernels_UNIT.cu)
#     FILTER: only kernels whose mangled name contains it
# Prints, per kernel, "same" or "differs: N lines" (and the first differing lines), then a
# count; exits 1 if any kernel differs or is missing on one side.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
before=$(cd "$1" && pwd)
after=$(cd "$2" && pwd)
unit=${3:-f32}
filter=${4:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$here/cuda_nvcc.sh"
for side in before after; do
  root=$before
  [ "$side" = after ] && root=$after
  kernels_nvcc "$root" -ptx -o "$tmp/$side.ptx" "$root/kernels/cuda/kernels_$unit.cu" \
    > "$tmp/$side.log" 2>&1 || { cat "$tmp/$side.log"; exit 1; }
done
python3 - "$tmp/before.ptx" "$tmp/after.ptx" "$filter" <<'PY'
import difflib, re, sys

def kernels(path):
    text = open(path).read()
    out = {}
    for m in re.finditer(r"\.entry (\w+)", text):
        # The body ends where its braces balance: inline asm opens scopes of its own (a "}"
        # line of an mbarrier wait is not the kernel's end), vector operands {a, b} balance.
        at = text.index("{", text.index(")", m.start()))
        depth = 0
        for end in range(at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        else:
            sys.exit(f"{m.group(1)}: unbalanced braces in {path}")
        end += 1
        body = re.sub(r"%(rd|rs|fd|f|r|p|h|hh)\d+", r"%\1", text[m.start():end])
        out[m.group(1)] = re.sub(r"\$L__BB\d+_\d+", "$L", body).splitlines()
    return out

before, after, flt = kernels(sys.argv[1]), kernels(sys.argv[2]), sys.argv[3]
same = differ = 0
for name in sorted(set(before) | set(after)):
    if flt not in name:
        continue
    if name not in before or name not in after:
        print(f"{name}: only {'after' if name in after else 'before'}")
        differ += 1
        continue
    diff = [l for l in difflib.unified_diff(before[name], after[name], lineterm="", n=0)
            if l[:1] in "+-" and l[:3] not in ("+++", "---")]
    if not diff:
        same += 1
        print(f"{name}: same")
    else:
        differ += 1
        print(f"{name}: differs: {len(diff)} lines")
        for line in diff[:6]:
            print(f"    {line.strip()}")
print(f"{same} the same, {differ} different")
sys.exit(1 if differ else 0)
PY
