#!/usr/bin/env python3
"""Summarize the per-CTA timelines of a diagnostic v7 build (kernels/cuda/bulk_kernel.cuh).

Build the CUDA backend with -DRSSM_BULK_TRACE (CMAKE_CUDA_FLAGS), then run one case with
  REPLAYSSM_CUDA_TRACE_AT=40 REPLAYSSM_CUDA_TRACE_FILE=r64.bin \
  REPLAYSSM_BENCH_GATE=GDN REPLAYSSM_BENCH_STATE=f32 REPLAYSSM_BENCH_OP=replay \
  REPLAYSSM_BENCH_B=64 replayssm-bench kernels
and read the file here: bench/tools/bulk_trace.py r64.bin [more.bin ...]

The file: 8 int32 (batch, heads, mode, warps, rows per warp, stages, SMs, shared-memory
bytes), then 16 uint64 per CTA (bulk_kernel.cuh, kTraceWords): word 0 = SM | cursor << 8 |
fold << 16; 1, 2 = %globaltimer at the CTA's start and warp 0's end; 3.. = clock64 at: start,
tokens stored, first CTA barrier, records landed, prologue end, warp 0's batches 0..3 landed,
each warp's end. Standard library only.
"""
import statistics
import struct
import sys

PHASES = [
    ("lifetime", "start to the last warp's end"),
    ("tokens", "start to the tokens stored (thread 0)"),
    ("to_bar1", "tokens stored to the first CTA barrier passed"),
    ("records", "barrier to the records landed (warp 0, norms included)"),
    ("prologue", "start to the prologue's last barrier"),
    ("rows", "prologue end to the last warp's end"),
    ("batch", "warp 0: batch b landed after batch b-1 (b = 1..3, pooled)"),
]


def pct(xs, ps=(10, 50, 90, 99)):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return "     -" * len(ps)
    return " ".join(f"{xs[min(len(xs) - 1, int(p / 100 * len(xs)))]:6.2f}" for p in ps)


def load(path):
    raw = open(path, "rb").read()
    hdr = struct.unpack_from("8i", raw, 0)
    n = (len(raw) - 32) // 128
    recs = [struct.unpack_from("16Q", raw, 32 + 128 * i) for i in range(n)]
    return hdr, [r for r in recs if r[1] and r[2]]  # padding CTAs write no end


def summarize(path):
    (batch, heads, mode, nw, rpw, ns, sms, smem), recs = load(path)
    print(f"== {path}: B={batch} heads={heads} mode={mode} warps={nw} rows/warp={rpw} "
          f"stages={ns} smem={smem} B, {len(recs)} CTAs")
    if not recs:
        return
    ns_per_clk = statistics.median((r[2] - r[1]) / max(1, r[12] - r[3]) for r in recs)
    t0 = min(r[1] for r in recs)
    span = (max(r[2] for r in recs) - t0) / 1e3
    us = lambda clocks: clocks * ns_per_clk / 1e3
    rows = []
    for r in recs:
        end = max(r[12:16])
        d = {
            "fold": (r[0] >> 16) & 1, "w": (r[0] >> 8) & 0xFF,
            "start": (r[1] - t0) / 1e3, "end": (r[2] - t0) / 1e3,
            "lifetime": us(end - r[3]), "tokens": us(r[4] - r[3]), "to_bar1": us(r[5] - r[4]),
            "records": us(r[6] - r[5]) if r[6] else None, "prologue": us(r[7] - r[3]),
            "rows": us(end - r[7]),
            "batch": [us(r[8 + b] - r[7 + b]) for b in (1, 2, 3) if r[8 + b] and r[7 + b]],
        }
        rows.append(d)
    print(f"  {ns_per_clk:.3f} ns per clock; kernel span {span:.1f} us (first start to last end)")
    print(f"  {'phase (us), p10 p50 p90 p99':34s} {'all':>27s} {'not folding':>27s} {'folding':>27s}")
    for key, what in PHASES:
        def col(sel):
            if key == "batch":
                return pct([x for d in rows if sel(d) for x in d["batch"]])
            return pct([d[key] for d in rows if sel(d)])
        print(f"  {key:9s} {what[:24]:24s} {col(lambda d: True)}  {col(lambda d: not d['fold'])}"
              f"  {col(lambda d: d['fold'])}")
    late = [d for d in rows if d["end"] > 0.9 * span]
    print(f"  CTAs ending in the last 10% of the span: {len(late)}, folding {sum(d['fold'] for d in late)}"
          f" (folding share overall {sum(d['fold'] for d in rows) / len(rows):.3f})")
    steps = 20
    active = [sum(1 for d in rows if d["start"] <= span * i / steps < d["end"]) for i in range(steps + 1)]
    print("  CTAs resident at 5% steps:", " ".join(map(str, active)))


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    for path in argv[1:]:
        summarize(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
