"""A crude model of how much of a decode plan's KV reads on physically shared pages hit L2, with each CTA's queue
in creation order and by kv_begin (scheduler.plan_into's kv_order), no GPU needed (runs here).

    python -m perf.tools.l2_queue_model 12x32768x256 20x32768x256 64x32768x256

A cell BxLxS is B requests of one query row reading the same L-token prefix (the same pages) and S tokens of
their own, planned as the decode wrapper plans 32/8 heads at head_dim 128 on the H100 (128 CTAs, 8 units, 4-row
tiles, 128-token KV tiles = cost_q). Model: every CTA reads one 128-token tile of one KV head a step (an item's
fixed cost one step more), all CTAs in lockstep; a tile of the prefix is keyed (KV head, position), any other by
request too; the L2 is an LRU of 50 MB of such tiles (K and V, bf16). Prints the fraction of tile reads that miss.
It ignores everything but capacity (timing drift between CTAs, the L2's two halves, page-table reads), so it can
say whether an order could matter, not what it costs (docs/composable.md, Measured, finding (1)).
"""
from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

from fi_backend import scheduler as S

GRID = dict(num_ctas=128, num_units=8, tile_q=4, kv_chunk_align=128, cost_q=128.0,
            min_kv_chunk=S.DEFAULT_MIN_KV_CHUNK)
TILE, L2_BYTES, TOKEN_BYTES = 128, 50 << 20, 2 * 128 * 2  # tokens a tile; L2; K and V of a token, one KV head


def plan(B: int, L: int, S_: int, kv_order: bool):
    qo = np.arange(B + 1, dtype=np.int32)
    kv = np.full(B, L + S_, dtype=np.int32)
    m, u, t = GRID["num_ctas"], GRID["num_units"], GRID["tile_q"]
    views = S.PlanViews.allocate(m, S.max_items_for(B, m, u), B, S.max_partial_rows_for(m, u, t))
    info = S.plan_into(views, qo, kv, causal=True, kv_order=kv_order, **GRID)
    return info, S.decode_plan(views)


def miss_fraction(d, L: int) -> float:
    streams = []
    for c in range(d.num_ctas):
        seq = []
        for it in d.items[d.cta_indptr[c]:d.cta_indptr[c + 1]]:
            seq.append(None)  # the item's fixed cost: a step without a read
            unit, req = int(it["unit"]), int(it["request"])
            for p in range(int(it["kv_begin"]) // TILE * TILE, int(it["kv_end"]), TILE):
                seq.append((unit, p) if p + TILE <= L else (req, unit, p))
        streams.append(seq)
    capacity = L2_BYTES // (TILE * TOKEN_BYTES)
    lru, misses, reads = OrderedDict(), 0, 0
    for step in range(max(map(len, streams), default=0)):
        for seq in streams:
            if step < len(seq) and seq[step] is not None:
                key = seq[step]
                reads += 1
                if key in lru:
                    lru.move_to_end(key)
                else:
                    misses += 1
                    lru[key] = True
                    if len(lru) > capacity:
                        lru.popitem(last=False)
    return misses / max(reads, 1)


def main(argv=None) -> None:
    for cell in (argv if argv is not None else sys.argv[1:]) or ["12x32768x256", "20x32768x256", "64x32768x256"]:
        B, L, S_ = (int(x) for x in cell.split("x"))
        for kv_order in (False, True):
            info, d = plan(B, L, S_, kv_order)
            print(f"{cell:14s} {'by kv_begin' if kv_order else 'creation   '}  {info.kind:9s} "
                  f"split pairs {info.num_split_pairs:3d}  L2 misses {miss_fraction(d, L):.3f}")


if __name__ == "__main__":
    main()
