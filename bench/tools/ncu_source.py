#!/usr/bin/env python3
"""Read ncu's source page (CSV) of one kernel: where the stall samples and instructions are.

Profile (a build with -lineinfo in CMAKE_CUDA_FLAGS, on the GPU machine):
  ncu --clock-control none -k regex:BulkStep --launch-skip 20 -c 1 \
    --section SourceCounters --section WarpStateStats --page source \
    --print-source cuda,sass --csv replayssm-bench kernels --gate GDN --state f32 \
    --op replay --batches 64 > src.csv
Then here:
  bench/tools/ncu_source.py src.csv lines [N]   top N source lines by stall samples
  bench/tools/ncu_source.py src.csv sass        the SASS in address order: offset, samples,
                                                 warp instructions executed, file:line, text
(This machine has no cuobjdump/nvdisasm: this is the way to read the SASS.) Standard library only.
"""
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


def read(path):
    """Source-line rows (file, line, text, metrics) and SASS rows (address, text, line, metrics)."""
    lines, sass = [], []
    header, file_name, line = None, "?", ("?", 0)
    for rec in csv.reader(open(path, errors="replace")):
        if not rec:
            continue
        if rec[0] == "File Path":
            file_name = rec[1].split("/")[-1]
            continue
        if rec[0] == "Line No":
            header = rec
            continue
        if header is None or len(rec) < len(header):
            continue
        metrics = dict(zip(header, rec))
        if rec[0].isdigit():
            line = (file_name, int(rec[0]))
            lines.append((file_name, int(rec[0]), rec[1], metrics))
        elif rec[2].startswith("0x"):
            sass.append((int(rec[2], 16), rec[3], line, metrics))
    return header or [], lines, sass


def top_lines(header, lines, n):
    reasons = [k for k in header if k.startswith("stall_") and "Not Issued" not in k]
    total_s = sum(num(m[SAMPLES]) for *_, m in lines) or 1.0
    total_i = sum(num(m[EXECUTED]) for *_, m in lines) or 1.0
    print(f"stall samples {total_s:.0f}, warp instructions {total_i:.0f}")
    for f, ln, text, m in sorted(lines, key=lambda r: -num(r[3][SAMPLES]))[:n]:
        why = sorted(((num(m[k]), k[6:]) for k in reasons), reverse=True)[:3]
        print(f"{100 * num(m[SAMPLES]) / total_s:5.1f}% {100 * num(m[EXECUTED]) / total_i:5.1f}%i "
              f"{f[:16]}:{ln:<5d} {text.strip()[:70]:70s} "
              + " ".join(f"{k}={v:.0f}" for v, k in why if v > 0))


def dump_sass(sass):
    if not sass:
        return
    base = min(a for a, *_ in sass)
    for a, text, (f, ln), m in sorted(sass):
        print(f"{a - base:6x} {num(m[SAMPLES]):6.0f} {num(m[EXECUTED]):9.0f} {f[:14]}:{ln:<5d} {text}")


def main(argv):
    if len(argv) < 3 or argv[2] not in ("lines", "sass"):
        print(__doc__)
        return 2
    header, lines, sass = read(argv[1])
    if argv[2] == "lines":
        top_lines(header, lines, int(argv[3]) if len(argv) > 3 else 40)
    else:
        dump_sass(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
