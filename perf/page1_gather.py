"""What page 1 pays over ragged KV, taken apart. Causal, bf16, 32 / 32 heads, head_dim 128 (perf/prefill.py's
paged section), on the same inputs in one process, in interleaved rounds (median of CUDA-event timings each):

  ragged        this step's K / V (TMA boxes, or gathered with FI_BACKEND_KV_TMA=0)
  page1         pages a random permutation of the pool (perf/prefill.py's paged bar)
  page1_g256    pages shuffled within groups of 256 (a tile's rows inside one 2 MiB stretch of the pool)
  page1_inorder pages in order (TMA boxes by the producer's vote, or gathered with FI_BACKEND_KV_TMA=0)
  page16        16-token pages, a random permutation
and each layout again with the kernel built with csrc macros (--defines, JSON: label -> {macro: value}; e.g.
'{"novote": {"FI_PREFILL_KV_VOTE": 0}, "every": {"FI_PREFILL_VOTE_EVERY_TILE": 1}}', csrc/attention/shared.cuh).

    python -m perf.page1_gather [--rounds 3] [--defines JSON] [--name NAME]   # GPU machine; perf/results/NAME.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from perf import prefill as P
from perf.common import write_result

LAYOUTS = {"page1": (1, 0), "page1_g256": (1, 256), "page1_inorder": (1, 1), "page16": (16, 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--defines", default="{}", help="JSON: label -> {csrc macro: value}, each a module to time too")
    ap.add_argument("--shapes", default="16x1024,4x4096", help="batch x length, comma-separated")
    ap.add_argument("--name", default="page1_gather")
    a = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    builds = [("", None)] + [("+" + k, {"defines": v}) for k, v in json.loads(a.defines).items()]
    rows = []
    for b, s in shapes:
        case = P.Case(b, s, P.HQ, P.HQ, seed=s)
        fns, checks = {}, {}
        fn, ref, info = P.ours_fn(case)
        fn()
        for name, (ps, group) in [("ragged", (None, 0))] + list(LAYOUTS.items()):
            paged = P.Paged(case, ps, group=group) if ps else None
            for suffix, tuning in builds:
                label = name + suffix
                f, out, pinfo = P.ours_fn(case, paged=paged, tuning=tuning)
                if pinfo["rows_per_tile"] != info["rows_per_tile"]:
                    raise SystemExit(f"{label}: rows per tile {pinfo['rows_per_tile']} != ragged's {info['rows_per_tile']}")
                f()
                checks[label] = P._check(f"{b}x{s} {label} vs ragged", P.diff_stats(out, ref))
                fns[label] = f
        times = P.time_rounds(fns, a.rounds, a.rep, on_round=lambda i, t: P.log(
            f"{b}x{s} round {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in t.items())))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({**case.shape(), "rows_per_tile": info["rows_per_tile"], "us_per_round": times, "median_us": med,
                     "over_ragged": {k: v / med["ragged"] for k, v in med.items()}, "checks": checks})
        del fns, case
        torch.cuda.empty_cache()
    write_result(a.name, {**P._stamp(), "kv_tma": os.environ.get("FI_BACKEND_KV_TMA", "1"), "rounds": a.rounds,
                          "anchor": "ragged KV, same process, same rounds", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
