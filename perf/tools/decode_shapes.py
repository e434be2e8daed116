"""Decode kernel shapes (warps x 16-token blocks a warp x stages) against FlashInfer's best decode path, on the
same inputs in the same process, alternating rounds: which shape suits short KV at large batches (ShareGPT-like
steps) and which long KV. Heads and KV type by --heads (default 32/8/128) and --kv-dtype, pages in random
order (perf.decode.Case, KV sets rotated past the L2); median of CUDA-event timings.

    python -m perf.tools.decode_shapes [--cells 512x176,256x1024,...] [--pages 16,1] [--tunings JSON]

A cell `BxL` is B requests of L tokens; `BxL~` draws each length uniformly from [L/2, 3L/2] (seeded).
Writes perf/results/decode_shapes.json (--name to rename)."""
from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from fi_backend import env

from perf import decode as D
from perf.common import device_info, log, rotating, time_rounds, write_result

CELLS = "512x176,512x224,512x288,512x400,256x300~,256x1024,128x1280,64x4096,32x16384"
TUNINGS = '[{}, {"warps": 4, "sub": 1, "stages": 3}, {"warps": 4, "sub": 1, "stages": 2}]'


def lengths(cell: str) -> list[int]:
    b, l = cell.rstrip("~").split("x")
    b, l = int(b), int(l)
    if not cell.endswith("~"):
        return [l] * b
    rng = random.Random(b * 100003 + l)
    return [rng.randint(l // 2, l + l // 2) for _ in range(b)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.decode_shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--pages", default="16")
    ap.add_argument("--tunings", default=TUNINGS, help="JSON list of decode_spec tunings; {} is the default shape; "
                    "a \"cost_q\" key sets the planner's cost of a query row for that entry, \"min_chunk\" its shortest KV "
                    "split, \"ctas\" the grid (the workspace's num_ctas), \"plan_ctas\" the CTAs of it given work")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head_dim")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"), help="KV cache type (fp8: e4m3)")
    ap.add_argument("--name", default="decode_shapes")
    a = ap.parse_args(argv)
    tunings = json.loads(a.tunings)
    hq, hkv, d = (int(x) for x in a.heads.split("/"))
    kv_dtype = torch.float8_e4m3fn if a.kv_dtype == "fp8" else D.DTYPE
    label = lambda t: "default" if not t else "x".join(str(t.get(k, "-")) for k in ("warps", "sub", "stages"))
    rows = []
    for page in (int(p) for p in a.pages.split(",")):
        for cell in a.cells.split(","):
            case = D.Case(lengths(cell), page, kv_dtype=kv_dtype, hq=hq, hkv=hkv, d=d)
            fns = {}
            for tc in (True, False):
                try:
                    f, s, fi_out = D.flashinfer_fn(case, tc)
                except Exception as e:   # a path FlashInfer does not build for these heads
                    log(f"  FlashInfer decode, tensor cores {tc}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                fns[f"flashinfer_{'tc' if tc else 'cuda'}"] = rotating(lambda i, f=f, s=s: (s(i), f()), case.sets)
                f()   # FlashInfer's output on set 0: each shape of ours is checked against it
            if not fns:
                raise RuntimeError(f"no FlashInfer decode path runs heads {a.heads} ({a.kv_dtype}): no anchor")
            for t in tunings:
                t = dict(t)
                cost_q = t.pop("cost_q", None)   # the planner's cost of a query row (FI_BACKEND_PLAN_DECODE_COST_Q)
                min_chunk, ctas, plan_ctas = t.pop("min_chunk", None), t.pop("ctas", None), t.pop("plan_ctas", None)
                with env.setting(env.PLAN_DECODE_COST_Q, None if cost_q is None else repr(float(cost_q))):
                    f, s, _ = D.ours(case, tuning=t or None, min_kv_chunk=min_chunk, num_ctas=ctas,
                                     plan_ctas=plan_ctas)
                case.out.fill_(float("nan"))
                f()
                D.check_close(case, case.out, fi_out)
                fns[f"ours_{label(t)}" + (f"_q{cost_q:g}" if cost_q else "") + (f"_c{min_chunk}" if min_chunk else "")
                    + (f"_g{ctas}" if ctas else "") + (f"_p{plan_ctas}" if plan_ctas else "")] = \
                    rotating(lambda i, f=f, s=s: (s(i), f()), case.sets)
            times = time_rounds(fns, a.rounds, a.rep)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            fi = min(v for k, v in med.items() if k.startswith("flashinfer_"))
            row = {"cell": cell, "page": page, "batch": case.B, "kv_tokens": int(case.kv_lens.sum()), "median_us": med,
                   "flashinfer_best_over_ours": {k: fi / v for k, v in med.items() if k.startswith("ours_")},
                   "gbps": {k: case.bytes / v / 1e3 for k, v in med.items()}}
            rows.append(row)
            log(f"{a.heads} {a.kv_dtype} page {page} {cell}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                + " | FI/ours " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in row["flashinfer_best_over_ours"].items()))
            del case, fns
            torch.cuda.empty_cache()
    write_result(a.name, {"device": device_info(), "heads": a.heads, "kv_dtype": a.kv_dtype, "tunings": tunings,
                          "rows": rows,
                          "anchor": "FlashInfer 0.6.14 BatchDecodeWithPagedKVCacheWrapper, tensor cores on and off"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
