"""Where a prefill launch's time goes, CTA by CTA: one launch of a composable cell's group step (perf.composable) on
a prefill module built with -DFI_TIMELINE (csrc/attention/timeline.cuh; FI_BACKEND_NVCC_FLAGS, so these modules are
cached apart from the real ones), its stamps read back and summarised. The compute warps stamp each tile's arrival
(the full barrier's wait ended), each sub-item's finish (its output or partial state; every 8th split one, and the
queue's end, the deferred arrivals: fence, tickets, merges) and the queue's end; the producer stamps each tile's
wait for a free stage and its issue.

    python -m perf.tools.timeline 16x8192x256 [16x8192x16 ...] [--name timeline_groups]

Per cell it prints the launch's span, per CTA the time to its queue's end, and over all CTAs where the compute warps
were: waiting for tiles (from a tile's compute end to the next tile's arrival), computing, in finish. Writes
perf/results/<name>.json with every CTA's events as (ns from the launch's first stamp, tag), a string a writer
(`compact`; `events` reads one back). Tags: compute warps 9 waiting for a tile, 8 a sub-item's first tile landed,
1 any other, 2 / 3 a finish's start / end (after 4 too: the deferred arrivals), 4 the queue's end; producer 5
waiting for a stage, 6 a tile issued, 7 done (csrc/attention/prefill.cuh, shared.cuh)."""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np

def read_events(module):
    shape = (ctypes.c_int64 * 2)()
    module.function("fi_timeline_shape", [ctypes.c_void_p], ctypes.c_int64)(ctypes.addressof(shape))
    ctas, per = int(shape[0]), int(shape[1])
    buf = np.zeros(ctas * 2 * per * 2, dtype=np.uint64)
    rc = module.function("fi_timeline_read", [ctypes.c_void_p, ctypes.c_int64])(buf.ctypes.data, buf.nbytes)
    if rc:
        raise RuntimeError(f"fi_timeline_read: CUDA error {rc}")
    return buf.reshape(ctas, 2, per, 2)


def summarise(ev, num_ctas):
    """Per CTA: its events as (ns from the launch's first stamp, tag) for both writers, timed by the SM's clock64 (the
    CTA's first globaltimer stamp places it; cycles a ns from every CTA's span, as the globaltimer may tick coarsely),
    and the compute warps' time split into waiting for tiles (9 to 1 / 8 / 4), computing (a tile's landing to the next
    wait or finish) and finishing (2 to 3)."""
    per_cta, rates = [], []
    for c in range(num_ctas):
        rows = sorted((int(meta) & ((1 << 56) - 1), int(ns), int(meta) >> 56, w)
                      for w in range(2) for ns, meta in ev[c, w] if ns)
        per_cta.append(rows)
        if len(rows) > 1 and rows[-1][1] > rows[0][1]:
            rates.append((rows[-1][0] - rows[0][0]) / (rows[-1][1] - rows[0][1]))
    rate = float(np.median(rates)) if rates else 1.0   # clock64 cycles a ns
    t0 = min(rows[0][1] for rows in per_cta if rows)
    ctas, span_end = [], 0.0
    wait = comp = fin = 0.0
    for rows in per_cta:
        rec = {"compute": [], "producer": []}
        if rows:
            clk0, ns0 = rows[0][0], rows[0][1]
            for clk, _, tag, w in rows:
                rec["producer" if w else "compute"].append((ns0 - t0 + (clk - clk0) / rate, tag))
        comp_ev = rec["compute"]
        for (t, tag), (t_next, _) in zip(comp_ev, comp_ev[1:]):
            if tag == 9:
                wait += t_next - t
            elif tag == 2:
                fin += t_next - t
            elif tag != 4:
                comp += t_next - t
        if comp_ev:
            span_end = max(span_end, comp_ev[-1][0])
            rec["end_ns"] = comp_ev[-1][0]
            end = next((i for i, (_, tag) in enumerate(comp_ev) if tag == 4), len(comp_ev))
            rec["items"] = sum(1 for _, tag in comp_ev[:end] if tag == 2)   # not the deferred arrivals after 4
            rec["tiles"] = sum(1 for _, tag in comp_ev if tag in (1, 8))
        ctas.append(rec)
    total = wait + comp + fin
    return {"span_ns": span_end, "cycles_per_ns": rate,
            "compute_share": {"waiting": wait / total, "computing": comp / total, "finishing": fin / total}
            if total else None, "ctas": ctas}


def compact(s: dict) -> dict:
    """The summary with each CTA's events as one string of "ns:tag" pairs, ns rounded (one JSON line a writer, not
    one a stamp: a cell's file is then about 0.2 MB, not 1)."""
    ctas = [{**c, **{w: " ".join(f"{round(t)}:{tag}" for t, tag in c[w]) for w in ("compute", "producer")}}
            for c in s["ctas"]]
    return {**s, "ctas": ctas}


def events(text: str) -> list:
    """A compacted writer's events back as (ns, tag) pairs."""
    return [tuple(int(x) for x in e.split(":")) for e in text.split()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", nargs="+", help="BxLxS or BxLxSxN, as perf composable's")
    ap.add_argument("--name", default="timeline")
    a = ap.parse_args(argv)
    flags = os.environ.get("FI_BACKEND_NVCC_FLAGS", "")
    if "-DFI_TIMELINE" not in flags:
        os.environ["FI_BACKEND_NVCC_FLAGS"] = (flags + " -DFI_TIMELINE=1").strip()
    import torch
    from perf import composable
    from perf.common import log, stamp, write_result
    out = []
    for spec in a.cells:
        B, L, S, *N = (int(x) for x in spec.split("x"))
        cell = composable.Cell(B, L, S, *N)
        fn, _, info = composable.ours(cell, "prefill", True)
        module = fn.attn._launcher.module
        fn()
        torch.cuda.synchronize()
        module.function("fi_timeline_clear", [])()
        fn()
        torch.cuda.synchronize()
        s = summarise(read_events(module), fn.attn.grid[0])
        ends = np.array([c.get("end_ns", 0) for c in s["ctas"]]) / 1e3
        items = np.array([c.get("items", 0) for c in s["ctas"]])
        log(f"{spec}: {s['span_ns'] / 1e3:.1f} us to the last queue's end; CTAs end at {ends.min():.1f} .. "
            f"{np.median(ends):.1f} (median) .. {ends.max():.1f} us; compute warps "
            + ", ".join(f"{k} {v:.0%}" for k, v in (s["compute_share"] or {}).items()))
        for n in sorted(set(items.tolist())):
            sel = items == n
            log(f"  CTAs of {n} items: {int(sel.sum())}, ending at {np.median(ends[sel]):.1f} us (median), "
                f"{ends[sel].max():.1f} (last)")
        out.append({"cell": spec, "plan": info._asdict(), **compact(s)})
    write_result(a.name, {**stamp(), "cells": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
