"""Host time of plan() for decode batches: python -m perf.plan --batch 256 [--json] [--repeat K].

Times the whole Python call (fi_backend.scheduler.plan_into, argument checks and the C++ planner writing
into a staging buffer) with time.perf_counter_ns, over `repeat` calls after a warm-up, and reports the
median and p90. Inputs rotate through `sets` random batches (KV lengths uniform in 1..4096, one query
row each) so the branch predictor cannot learn one input. Also times Workspace.plan, which adds the
bound checks and the copy into the device plan section (the asynchronous host-to-device copy on a GPU
machine; a plain memcpy on a CPU-only one).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np

from fi_backend import scheduler
from fi_backend.workspace import Workspace

# 132 SMs (H100 SXM) * 2 CTAs per SM / 8 KV heads: the persistent grid per KV head.
DEFAULT_NUM_CTAS = 132 * 2 // 8
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


def bench(batch: int, num_ctas: int, repeat: int, sets: int, seed: int, workspace: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    qo = np.arange(batch + 1, dtype=np.int32)
    inputs = [(qo, rng.integers(1, 4097, batch).astype(np.int32)) for _ in range(sets)]
    max_items = max(num_ctas, batch)
    views = scheduler.PlanViews.allocate(num_ctas, max_items, batch, 2 * num_ctas)
    plan = _time(lambda q, k: scheduler.plan_into(views, q, k, tile_q=1, num_ctas=num_ctas), inputs, repeat)
    info = scheduler.plan_into(views, *inputs[0], tile_q=1, num_ctas=num_ctas)
    out = {"batch": batch, "num_ctas": num_ctas, "plan_us_median": round(plan["median_us"], 2),
           "plan_us_p90": round(plan["p90_us"], 2), "plan_us_min": round(plan["min_us"], 2),
           "num_items": info.num_items, "kv_chunk": info.kv_chunk, "repeat": repeat}
    if workspace:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        ws = Workspace(device, max_requests=batch, max_tokens=batch, num_ctas=num_ctas, max_tile_q=1,
                       num_qo_heads=32, head_dim=128)
        w = _time(lambda q, k: ws.plan(q, k, tile_q=1), inputs, repeat)
        if device == "cuda":
            torch.cuda.synchronize()
        out.update({"workspace_plan_us_median": round(w["median_us"], 2),
                    "workspace_plan_us_p90": round(w["p90_us"], 2), "workspace_device": device})
    if batch in BARS_US:
        out["bar_us"] = BARS_US[batch]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, action="append", help="decode batch size (repeatable; default 256, 1024)")
    ap.add_argument("--num-ctas", type=int, default=DEFAULT_NUM_CTAS)
    ap.add_argument("--repeat", type=int, default=5000)
    ap.add_argument("--sets", type=int, default=32, help="distinct random batches to rotate through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object per batch, nothing else")
    args = ap.parse_args(argv)
    for batch in args.batch or [256, 1024]:
        r = bench(batch, args.num_ctas, args.repeat, args.sets, args.seed)
        if args.json:
            print(json.dumps(r))
            continue
        print(f"batch {batch:5d}  num_ctas {args.num_ctas:4d}: plan median {r['plan_us_median']:7.2f} us  "
              f"p90 {r['plan_us_p90']:7.2f} us  | Workspace.plan ({r['workspace_device']}) median "
              f"{r['workspace_plan_us_median']:7.2f} us" + (f"  (bar {r['bar_us']:.0f} us)" if "bar_us" in r else ""))
        for other in (66, 132):  # other grids: 4 or 2 KV heads on 132 SMs
            if other != args.num_ctas:
                o = bench(batch, other, max(args.repeat // 5, 200), args.sets, args.seed, workspace=False)
                print(f"{'':11s}  num_ctas {other:4d}: plan median {o['plan_us_median']:7.2f} us  "
                      f"p90 {o['plan_us_p90']:7.2f} us")


if __name__ == "__main__":
    main()
