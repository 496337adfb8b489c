#!/usr/bin/env python3
"""Compare `replayssm-bench kernels --json` runs, or print one run against the kernel targets.

  bench/tools/kernels_compare.py A.json B.json [C.json ...]
      every case of A with its µs per step, and each other file's µs and change against A
      (a same-call A/B: run the binaries alternately in one device call, two repetitions each,
      and pass them in that order; the spread between repetitions is the noise floor)
  bench/tools/kernels_compare.py --targets A.json
      per gate, state dtype and batch: baseline µs and % of copy bandwidth, replay µs, % and
      speedup, verify speedup — the numbers the targets (docs/gpu.md) are stated in
  --peer (first argument, before either form): the peer method's figures (`peer` per case)
      instead of the graph method's; cases a method did not measure are left out

Standard library only.
"""
import json
import sys


METHOD = "graph"


def load(path):
    with open(path) as f:
        d = json.load(f)
    cases = {}
    for c in d["results"]:
        fig = c.get("peer") if METHOD == "peer" else c
        if fig is None or fig.get("us_per_step") is None:
            continue
        cases[(c["gate"], c["state"], c["op"], c["batch"])] = fig
    return d, cases


def compare(paths):
    runs = [load(p)[1] for p in paths]
    names = [p.split("/")[-1].removesuffix(".json")[-17:] for p in paths]
    print("case".ljust(30) + "".join(n.rjust(19) for n in names))
    for key, first in runs[0].items():
        base = first["us_per_step"]
        row = " ".join(str(k) for k in key).ljust(30)
        for run in runs:
            c = run.get(key)
            if c is None:
                row += "-".rjust(19)
                continue
            us = c["us_per_step"]
            row += f"{us:10.2f} ({(us / base - 1) * 100:+5.1f}%)"
        print(row)


def fmt_x(x):
    return "-" if x is None else f"{x:.2f}x"


def targets(path):
    d, cases = load(path)
    print(f"{path} ({METHOD} method): copy bandwidth {d['copy_bandwidth_gbps']} GB/s")
    keys = sorted({(g, s, b) for g, s, _, b in cases}, key=lambda k: (k[0], k[1] != "f32", k[2]))
    for g, s, b in keys:
        base, rep, ver = (cases.get((g, s, op, b)) for op in ("baseline", "replay", "verify4"))
        parts = [f"{g} {s:4s} B={b:3d}:"]
        if base:
            parts.append(f"baseline {base['us_per_step']:8.2f} us {base['pct_copy_bw']:5.1f}%")
        if rep:
            parts.append(f"| replay {rep['us_per_step']:8.2f} us {rep['pct_copy_bw']:5.1f}% "
                         f"{fmt_x(rep['speedup_vs_baseline'])}")
        if ver:
            parts.append(f"| verify4 {ver['us_per_step']:8.2f} us "
                         f"{fmt_x(ver['speedup_vs_baseline'])}")
        print(" ".join(parts))


def main(argv):
    global METHOD
    if argv and argv[0] == "--peer":
        METHOD, argv = "peer", argv[1:]
    if len(argv) == 2 and argv[0] == "--targets":
        targets(argv[1])
    elif len(argv) >= 1 and not argv[0].startswith("-"):
        compare(argv)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
