"""A composable cell's plan, made on the host as the prefill wrapper makes it, read back CTA by CTA: how many items
and KV tiles each CTA runs, and which kinds of items (query rows x KV tiles). No GPU needed (runs here): it answers
whether a slow step is the plan's balance or the kernel's (docs/composable.md, 16 x 8k + 256).

    python -m perf.tools.plan_cell 16x8192x256 [64x4096x320 ...] [--tile-q 32] [--kv-tile 64] [--ctas 132]

A cell BxLxS is B requests sharing an L-token prefix, with S own tokens each, one query row each, all in one group.
--tile-q / --kv-tile are the wrapper's rows_per_tile and kv_tile (defaults: the prefill family's member 1 at 32/8
heads, head size 128, which plans group steps); --units the query-head groups (KV heads for group 4 and less).
"""
from __future__ import annotations

import argparse
import collections
import sys

import numpy as np


def plan_cell(B: int, L: int, S: int, *, tile_q: int, kv_tile: int, ctas: int, units: int, heads: int,
              kv_heads: int, head_dim: int, cost_item_min: float = None):
    from fi_backend import scheduler
    from fi_backend.attention import SHARED_ROWS_PER_REQUEST, plan_cost_q, prefill_group_item_min
    from fi_backend.workspace import Workspace
    n = max(B, 256)  # as perf.composable sizes its workspaces
    ws = Workspace("cpu", max_requests=n, max_tokens=n, num_ctas=ctas, max_tile_q=tile_q, num_qo_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim, pin_memory=False,
                   shared_prefix_rows=SHARED_ROWS_PER_REQUEST * n)
    qo = np.arange(B + 1, dtype=np.int32)
    kv = np.full(B, L + S, dtype=np.int32)
    info = ws.plan(qo, kv, tile_q=tile_q, num_units=units, causal=True, kv_chunk_align=kv_tile,
                   cost_q=plan_cost_q("prefill", kv_tile, tile_q), groups=np.array([[0, B, L]], dtype=np.int32),
                   num_ctas=ctas,
                   cost_item_min=prefill_group_item_min(kv_tile) if cost_item_min is None else cost_item_min)
    return info, scheduler.decode_plan(ws._views)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.plan_cell", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", nargs="+", help="BxLxS")
    ap.add_argument("--tile-q", type=int, default=32)
    ap.add_argument("--kv-tile", type=int, default=64)
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head size")
    ap.add_argument("--units", type=int, default=0, help="query-head groups (0: the KV heads)")
    ap.add_argument("--item-min", type=float, default=None,
                    help="the least an item costs, KV tokens (default: the wrapper's for group steps)")
    a = ap.parse_args(argv)
    hq, hkv, d = (int(x) for x in a.heads.split("/"))
    for cell in a.cells:
        B, L, S = (int(x) for x in cell.split("x"))
        info, p = plan_cell(B, L, S, tile_q=a.tile_q, kv_tile=a.kv_tile, ctas=a.ctas, units=a.units or hkv,
                            heads=hq, kv_heads=hkv, head_dim=d, cost_item_min=a.item_min)
        items, tiles = np.diff(p.cta_indptr), np.zeros(p.num_ctas)
        kinds = collections.Counter()
        for c in range(p.num_ctas):
            for it in p.items[p.cta_indptr[c]:p.cta_indptr[c + 1]]:
                t = -(-(int(it["kv_end"]) - max(int(it["kv_begin"]), 0)) // a.kv_tile)
                tiles[c] += t
                kinds[(int(it["q_end"] - it["q_begin"]), t)] += 1
        print(f"{cell}: {info}")
        print(f"  CTAs by items: {dict(sorted(collections.Counter(items.tolist()).items()))}; KV tiles a CTA: max "
              f"{tiles.max():.0f}, mean {tiles.mean():.2f}, min {tiles.min():.0f}")
        print("  items (query rows, KV tiles): count " +
              ", ".join(f"{k}: {v}" for k, v in kinds.most_common(6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
