"""Host time of plan() for decode batches: python -m perf.plan --batch 256 [--json] [--repeat K] [--dist D].

Times the whole Python call (fi_backend.scheduler.plan_into, argument checks and the C++ planner writing
into a staging buffer) with time.perf_counter_ns, over `repeat` calls after a warm-up, and reports the
median and p90. Inputs rotate through `sets` random batches with one query row each, so the branch
predictor cannot learn one input. KV lengths (--dist): `uniform` in 1..4096 (the project's bars; such
batches are balanced unsplit, so the chunk search is skipped), `skewed` (one request of 32768 tokens,
the others uniform in 1..1023: the search runs) or `sharegpt` (prompt + part of the output of pairs from
perf/data/sharegpt_trace.json). Also reports how good the plans are: the mean of makespan / makespan of
the unsplit plan, and how many sets were split. Also times Workspace.plan, which adds the bound checks
and the copy into the device plan section (the asynchronous host-to-device copy on a GPU machine; a
plain memcpy on a CPU-only one).

--wrapper plans as the decode wrapper does (query tiles of 16 rows, chunks aligned to a 64-token KV
tile, cost_q = 64); the default is the planner's own defaults (tile_q = 1, cost_q = cost_kv = 1).
--num-ctas is the whole grid and --units the query-head groups every item runs for: a grid that divides
by the units plans as unit blocks (one LPT pass over the items), another places every (item, unit)
replica on its own (csrc/scheduler/planner.h).

--write NAME times the project's table into perf/results/NAME.json (plan_host_time): the decode wrapper's
settings, uniform / skewed / sharegpt batches of 256 and 1024, 8 units on 128 CTAs (unit blocks), on 132
(replicas) and on 392 (unit blocks: the decode grid of 3 CTAs an SM, docs/decode.md), each against the
anchor on the same inputs in the same process: the plan of queues per KV head (num_ctas // units CTAs, one
unit) that the planner made before items named their unit.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import numpy as np

from fi_backend import scheduler
from fi_backend.workspace import Workspace

# 132 SMs (H100 SXM) x 1 CTA per SM (decode, head_dim 128, bf16: 8 warps): the persistent grid, serving
# 8 units (Llama-3-8B's KV heads; each (item, unit) is placed on its own).
DEFAULT_NUM_CTAS = 132
DEFAULT_NUM_UNITS = 8
BARS_US = {256: 100.0, 1024: 250.0}  # the project's host-time bars (median)


def _time(fn, inputs, repeat: int) -> dict:
    for i in range(min(200, repeat)):
        fn(*inputs[i % len(inputs)])
    t = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(repeat):
            qo, kv = inputs[i % len(inputs)]
            t0 = time.perf_counter_ns()
            fn(qo, kv)
            t.append(time.perf_counter_ns() - t0)
    finally:
        if gc_was:
            gc.enable()
    t.sort()
    return {"median_us": statistics.median(t) / 1e3, "p90_us": t[(9 * len(t)) // 10] / 1e3,
            "min_us": t[0] / 1e3}


def kv_lengths(dist: str, batch: int, rng: np.random.Generator) -> np.ndarray:
    if dist == "uniform":
        kv = rng.integers(1, 4097, batch)
    elif dist == "skewed":
        kv = rng.integers(1, 1024, batch)
        kv[rng.integers(batch)] = 32768
    elif dist == "sharegpt":
        from perf.sharegpt import load_trace
        trace = load_trace()
        picks = rng.integers(0, len(trace), batch)
        kv = np.array([trace[i][0] + int(rng.integers(1, trace[i][1] + 1)) for i in picks])
    else:
        raise ValueError(f"dist must be one of uniform, skewed, sharegpt, got {dist!r}")
    return kv.astype(np.int32)


def bench(batch: int, num_ctas: int, repeat: int, sets: int, seed: int, workspace: bool = True,
          num_units: int = DEFAULT_NUM_UNITS,
          dist: str = "uniform", wrapper: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    qo = np.arange(batch + 1, dtype=np.int32)
    inputs = [(qo, kv_lengths(dist, batch, rng)) for _ in range(sets)]
    kw = dict(tile_q=16, kv_chunk_align=64, cost_q=64.0) if wrapper else dict(tile_q=1)
    tile_q = kw["tile_q"]
    # Room for every candidate plan: per unit, pairs <= batch, plus the split items' budget.
    views = scheduler.PlanViews.allocate(num_ctas, scheduler.max_items_for(batch, num_ctas, num_units), batch,
                                         scheduler.max_partial_rows_for(num_ctas, num_units, tile_q))
    kw = dict(kw, num_units=num_units)
    plan = _time(lambda q, k: scheduler.plan_into(views, q, k, num_ctas=num_ctas, **kw), inputs, repeat)
    infos = [scheduler.plan_into(views, q, k, num_ctas=num_ctas, **kw) for q, k in inputs]
    unsplit = [scheduler.plan_into(views, q, k, num_ctas=num_ctas, force_kv_chunk=0, **kw) for q, k in inputs]
    info = infos[0]
    out = {"batch": batch, "num_ctas": num_ctas, "num_units": num_units, "dist": dist, "wrapper_settings": wrapper,
           "plan_us_median": round(plan["median_us"], 2),
           "plan_us_p90": round(plan["p90_us"], 2), "plan_us_min": round(plan["min_us"], 2),
           "num_items": info.num_items, "kv_chunk": info.kv_chunk, "repeat": repeat,
           "sets_split": sum(i.num_split_pairs > 0 for i in infos), "sets": sets,
           "makespan_over_unsplit": round(float(np.mean([i.makespan / u.makespan if u.makespan else 1.0
                                                          for i, u in zip(infos, unsplit)])), 4)}
    if workspace:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        ws = Workspace(device, max_requests=batch, max_tokens=batch, num_ctas=num_ctas, max_tile_q=tile_q,
                       num_qo_heads=4 * num_units, num_kv_heads=num_units, head_dim=128)
        w = _time(lambda q, k: ws.plan(q, k, **kw), inputs, repeat)
        # The search keeps to the workspace's max_items: fewer splits here than above means the
        # workspace is sized below scheduler.max_items_for(max_tokens, num_ctas, units).
        ws_split = sum(ws.plan(q, k, **kw).num_split_pairs > 0 for q, k in inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        out.update({"workspace_plan_us_median": round(w["median_us"], 2),
                    "workspace_plan_us_p90": round(w["p90_us"], 2), "workspace_device": device,
                    "workspace_sets_split": ws_split})
    if batch in BARS_US:
        out["bar_us"] = BARS_US[batch]
    return out


def write_table(name: str, repeat: int, sets: int, seed: int) -> None:
    import platform

    from perf.common import write_result
    rows = []
    for dist in ("uniform", "skewed", "sharegpt"):
        for num_ctas in (128, 132, 392):
            for batch in (256, 1024):
                r = bench(batch, num_ctas, repeat, sets, seed, dist=dist, wrapper=True)
                a = bench(batch, num_ctas // DEFAULT_NUM_UNITS, repeat, sets, seed, workspace=False, dist=dist,
                          wrapper=True, num_units=1)
                r.update({"anchor": "queues per KV head", "anchor_num_ctas": a["num_ctas"],
                          "anchor_plan_us_median": a["plan_us_median"],
                          "ratio_anchor_over_ours": round(a["plan_us_median"] / r["plan_us_median"], 3)})
                rows.append(r)
                print(f"{dist:8s} batch {batch:5d}  {num_ctas} CTAs x {DEFAULT_NUM_UNITS} units: plan median "
                      f"{r['plan_us_median']:7.2f} us (bar {r.get('bar_us', 0):.0f}); per-KV-head queues "
                      f"({a['num_ctas']} CTAs) {a['plan_us_median']:7.2f} us", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    write_result(name, {"host": {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()},
                        "command": f"python -m perf.plan --write {name} --repeat {repeat} --sets {sets} --seed {seed}",
                        "rows": rows})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, action="append", help="decode batch size (repeatable; default 256, 1024)")
    ap.add_argument("--num-ctas", type=int, default=DEFAULT_NUM_CTAS, help="CTAs of the grid (default 132)")
    ap.add_argument("--units", type=int, default=DEFAULT_NUM_UNITS, help="units each item runs for (default 8)")
    ap.add_argument("--repeat", type=int, default=5000)
    ap.add_argument("--sets", type=int, default=32, help="distinct random batches to rotate through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dist", choices=["uniform", "skewed", "sharegpt"], default="uniform",
                    help="KV lengths of the batches (default uniform in 1..4096)")
    ap.add_argument("--wrapper", action="store_true", help="the decode wrapper's settings (tile_q 16, align 64)")
    ap.add_argument("--json", action="store_true", help="one JSON object per batch, nothing else")
    ap.add_argument("--write", metavar="NAME", help="the project's table into perf/results/NAME.json (see above)")
    args = ap.parse_args(argv)
    if args.write:
        write_table(args.write, args.repeat, args.sets, args.seed)
        return
    for batch in args.batch or [256, 1024]:
        r = bench(batch, args.num_ctas, args.repeat, args.sets, args.seed, dist=args.dist, wrapper=args.wrapper,
                  num_units=args.units)
        if args.json:
            print(json.dumps(r))
            continue
        print(f"batch {batch:5d}  num_ctas {args.num_ctas:4d} x {args.units} units: plan median {r['plan_us_median']:7.2f} us  "
              f"p90 {r['plan_us_p90']:7.2f} us  | Workspace.plan ({r['workspace_device']}) median "
              f"{r['workspace_plan_us_median']:7.2f} us" + (f"  (bar {r['bar_us']:.0f} us)" if "bar_us" in r else "")
              + f"  | {r['sets_split']}/{r['sets']} split, makespan / unsplit {r['makespan_over_unsplit']:.3f}")
        for units in (1, 2, 32):  # other head counts on the same grid
            if units != args.units:
                o = bench(batch, args.num_ctas, max(args.repeat // 5, 200), args.sets, args.seed, workspace=False,
                          dist=args.dist, wrapper=args.wrapper, num_units=units)
                print(f"{'':11s}  num_ctas {args.num_ctas:4d} x {units} units: plan median "
                      f"{o['plan_us_median']:7.2f} us  p90 {o['plan_us_p90']:7.2f} us")


if __name__ == "__main__":
    main()
