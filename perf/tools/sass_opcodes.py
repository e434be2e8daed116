"""Per-opcode and per-region accounting of ncu's source page (SASS, CSV), for comparing two kernels that do the
same work: dynamic instruction counts by opcode, stall samples by reason, and the kernel cut into 1 KiB address
regions (each region's count, samples and leading opcodes: the mainloop's parts show as runs of regions with
the same count a warp-step).

    python -m perf.tools.sass_opcodes ncu_m0_sass.csv.gz ncu_fa3pp_sass.csv.gz [--regions] [--steps N]

Files come from `bash .ci/gpu ncu-prefill` (`ncu --import R --page source --print-source sass --csv`, gzip or
not). --steps N divides counts by N (e.g. warp-steps of the consumers: instructions a warp-step)."""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
import sys

PRED = re.compile(r"^@!?U?P\w+\s+")


def load(path: str):
    """(rows as dicts of the columns used, stall columns) of the file's first kernel (a file of several profiled
    launches repeats the header before each)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[at]
    stalls = [c for c in head if c.startswith("stall_") and "(Not Issued)" not in c]
    ix = {c: i for i, c in enumerate(head)}
    out = []
    for r in rows[at + 1:]:
        if r and r[0] == "Address":
            break
        if len(r) < len(head):
            continue
        src = r[ix["Source"]].strip()
        num = lambda c: int(r[ix[c]] or 0) if r[ix[c]].strip().lstrip("-").isdigit() else 0
        out.append({"addr": int(r[ix["Address"]], 16), "src": src,
                    "op": PRED.sub("", src).split(" ")[0].split(".")[0],
                    "executed": num("Instructions Executed"), "samples": num("Warp Stall Sampling (All Samples)"),
                    "stalls": {c[6:]: num(c) for c in stalls}})
    return out


def summary(rows):
    ops, samples, reasons = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        ops[r["op"]] += r["executed"]
        samples[r["op"]] += r["samples"]
        reasons.update(r["stalls"])
    return ops, samples, reasons


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.sass_opcodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=30, help="opcodes shown (by the sum of the files' counts)")
    ap.add_argument("--regions", action="store_true", help="also each file's 1 KiB address regions")
    ap.add_argument("--steps", type=float, default=1e6, help="divide counts by this (default 1e6: millions)")
    a = ap.parse_args(argv)
    data = [(f, load(f)) for f in a.files]
    sums = [summary(rows) for _, rows in data]
    for (f, rows), (ops, samples, reasons) in zip(data, sums):
        total, tot_s = sum(ops.values()), max(1, sum(reasons.values()))
        print(f"{f}: {total / a.steps:.2f} instructions, {sum(samples.values())} samples; stalls: "
              + " ".join(f"{k} {100 * v / tot_s:.1f}%" for k, v in reasons.most_common(8)))
    every = collections.Counter()
    for ops, _, _ in sums:
        every.update(ops)
    print("\n" + f"{'opcode':14s}" + "".join(f"{'count ' + str(i):>12s}{'samples %':>10s}" for i in range(len(data))))
    for op, _ in every.most_common(a.top):
        line = f"{op:14s}"
        for ops, samples, _ in sums:
            line += f"{ops[op] / a.steps:12.2f}{100 * samples[op] / max(1, sum(samples.values())):10.1f}"
        print(line)
    if a.regions:
        for f, rows in data:
            print(f"\n{f}: 1 KiB regions with at least 0.5% of the samples or 1% of the instructions")
            regions = collections.OrderedDict()
            for r in rows:
                g = regions.setdefault(r["addr"] >> 10, [0, 0, collections.Counter()])
                g[0] += r["executed"]
                g[1] += r["samples"]
                g[2][r["op"]] += r["executed"]
            total = max(1, sum(g[0] for g in regions.values()))
            tot_s = max(1, sum(g[1] for g in regions.values()))
            for addr, (n, s, ops) in regions.items():
                if s / tot_s >= 0.005 or n / total >= 0.01:
                    print(f"  {addr << 10:#x} {n / a.steps:10.2f} {100 * s / tot_s:5.1f}%  "
                          + " ".join(f"{o} {v / a.steps:.2f}" for o, v in ops.most_common(6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
