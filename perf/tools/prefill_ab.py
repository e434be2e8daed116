"""Prefill kernel shapes A/B: the query-tile family's per-step pick against every member forced, and any kernel
shapes (tunings) against the pick, ours only, same inputs, same process, alternating rounds. `--build NAME=FLAGS`
adds the pick built with extra nvcc flags (FI_BACKEND_NVCC_FLAGS: a kernel change behind a macro, A/B in one process).

    python -m perf.tools.prefill_ab                                  # the family table, FAMILY_SHAPES
    python -m perf.tools.prefill_ab --shapes 16x1024,4x4096 --tunings '[{"warps": 8, "mfrags": 1, "tile": 64}]'
    python -m perf.tools.prefill_ab --shapes 16x1024,1x2048 --tunings '[]' --build old='-DFI_MY_SWITCH=0'

Causal, bf16, 32 query / 8 KV heads, head_dim 128, this step's K/V ragged (perf.prefill.ours_fn). A forced shape
is a `tuning` of fi_backend.wrappers.prefill_spec; each output is checked against the pick's. A pick more than
10% slower than the fastest member is flagged: this tunes wrappers.FAMILY_TILES_PER_CTA / FAMILY_WAVE_SLACK.
Writes perf/results/<name>.json (default prefill_ab).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from perf import prefill as P
from fi_backend import env
from perf.common import add_build_argument, diff_stats, log, parse_builds, stamp, time_rounds, write_result

FAMILY_SHAPES = ((1, 256), (1, 512), (16, 128), (64, 64), (8, 300), (1, 1291), (1, 2048), (4, 1291), (2, 4096))
HKV = 8


def parse_shapes(text: str) -> list:
    from perf.zoo import parse_shapes as parse
    return parse(text)


def run(shapes, tunings, rounds: int, rep: int, builds=()) -> list:
    rows = []
    for b, s in shapes:
        case = P.Case(b, s, P.HQ, HKV, seed=s + b)
        fn, out, info = P.ours_fn(case)
        fns, outs, rows_per_tile = {"pick": fn}, {}, {"pick": info["rows_per_tile"]}
        for name, shape in tunings.items():
            fns[name], outs[name], minfo = P.ours_fn(case, tuning=shape)
            rows_per_tile[name] = minfo["rows_per_tile"]
        for name, flags in builds:
            with env.setting(env.NVCC_FLAGS, flags):
                fns[name], outs[name], minfo = P.ours_fn(case)
            rows_per_tile[name] = minfo["rows_per_tile"]
        times = time_rounds(fns, rounds, rep)
        r = {**case.shape(), "rows_per_tile": rows_per_tile, "us_per_round": times,
             "us": {k: statistics.median(v) for k, v in times.items()},
             "checks": {k: P.check(f"{b}x{s} {k} vs the pick", diff_stats(o, out)) for k, o in outs.items()}}
        forced = {k: v for k, v in r["us"].items() if k != "pick"}
        r["over_pick"] = {k: v / r["us"]["pick"] for k, v in forced.items()}   # > 1: the pick is faster
        if forced:
            r["fastest"] = min(forced, key=forced.get)
            r["pick_over_fastest"] = r["us"]["pick"] / forced[r["fastest"]]
            r["pick_ok"] = r["pick_over_fastest"] <= 1.10
        rows.append(r)
        log(f"{b:2d}x{s:5d}: " + ", ".join(f"{k} ({rows_per_tile[k]} rows) {v:.1f} us" for k, v in r["us"].items())
            + (f" | pick / fastest {r['pick_over_fastest']:.3f}" if forced else ""))
        del fn, fns, outs, case
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.prefill_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="batch x length, comma-separated (default: FAMILY_SHAPES)")
    ap.add_argument("--tunings", type=json.loads,
                    help="a JSON list of kernel shapes to force (default: the family's members)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--name", default="prefill_ab")
    add_build_argument(ap, "the pick")
    a = ap.parse_args(argv)
    from fi_backend import wrappers
    shapes = parse_shapes(a.shapes) if a.shapes else list(FAMILY_SHAPES)
    if a.tunings is not None:
        tunings = {json.dumps(t): t for t in a.tunings}
    else:
        tunings = {f"member{m}": t for m, t in enumerate(wrappers.prefill_family_shapes(P.D, "bf16"))}
    builds = parse_builds(ap, a.build)
    rows = run(shapes, tunings, a.rounds, a.rep, builds)
    write_result(a.name, {**stamp(), "num_qo_heads": P.HQ, "num_kv_heads": HKV, "head_dim": P.D, "tunings": tunings,
                          "builds": dict(builds), "tiles_per_cta": wrappers.FAMILY_TILES_PER_CTA, "wave_slack": wrappers.FAMILY_WAVE_SLACK,
                          "rows": rows})
    return 1 if P.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
