"""Cost of deterministic mode (issue 31, docs/deterministic.md): the deterministic plan against the normal one
on the benchmark grids, each cell timed on the same inputs in one process (the bar: normal us / deterministic
us >= 0.9 in every cell).

    python3 tools/det_cost.py [--rep 100] [--out perf/results/deterministic_cost.json] [--sections decode]
                              [--min-chunk 128]

Decode: perf/decode.py's grid (32/8 heads, head_dim 128, bf16, page 16; batch 1/16/64/256 x KV 1k/4k/16k/32k).
Prefill: perf/prefill.py's fa2 shapes (32/32 and 32/8 heads; 16 x 1k, 4 x 4k, 1 x 16k, causal) and its tile
family shapes (short prefills, where the deterministic mode keeps the largest tile). Device times per run()
(perf.common.time_us); the plan is made once per cell, outside the timing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import commit, device_info, time_us  # noqa: E402

import fi_backend.attention as attention  # noqa: E402
from fi_backend.formats import BSR  # noqa: E402
from fi_backend.scheduler import DETERMINISTIC_PIECES  # noqa: E402
from fi_backend.wrappers import BatchAttention  # noqa: E402

DEV, PAGE, HQ, D = "cuda", 16, 32, 128
DECODE_GRID = [(b, kv) for b in (1, 16, 64, 256) for kv in (1024, 4096, 16384, 32768)]
PREFILL_GRID = [(16, 1024), (4, 4096), (1, 16384)]
FAMILY_GRID = [(1, 256), (1, 512), (16, 128), (64, 64), (8, 300), (1, 1291), (1, 2048), (4, 1291), (2, 4096)]


def wrapper(kernel, hkv, deterministic, max_tokens, max_requests=256):
    ws = BatchAttention.workspace_for(DEV, HQ, hkv, D, max_requests=max_requests, max_tokens=max_tokens,
                                      kernel=kernel, deterministic=deterministic)
    return BatchAttention(ws, HQ, hkv, D, page_size=PAGE, kernel=kernel, deterministic=deterministic)


def case(batch, kv_len, q_len, hkv):
    """q, the paged cache and the BSR of `batch` requests of kv_len tokens, q_len query rows each."""
    blocks = -(-kv_len // PAGE)
    pages = batch * blocks
    perm = torch.randperm(pages, dtype=torch.int32).view(batch, blocks).to(DEV)
    k = torch.randn(pages, PAGE, hkv, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qo = torch.arange(batch + 1, dtype=torch.int32) * q_len
    kv = torch.full((batch,), kv_len, dtype=torch.int32)
    bsr = BSR(qo_indptr=qo.to(DEV), kv_indices=perm.view(-1),
              kv_block_start=torch.arange(batch, dtype=torch.int32, device=DEV) * blocks, kv_lens=kv.to(DEV),
              block_width=PAGE, num_kv_blocks=pages)
    q = torch.randn(batch * q_len, HQ, D, device=DEV, dtype=torch.bfloat16)
    return q, (k, v), qo, kv, bsr


def cell(wrappers, batch, kv_len, q_len, hkv, rep):
    q, cache, qo, kv, bsr = case(batch, kv_len, q_len, hkv)
    out = torch.empty_like(q)
    row = {"batch": batch, "kv_len": kv_len, "q_len": q_len, "num_kv_heads": hkv}
    for name, attn in wrappers.items():
        attn.plan(qo, kv, bsr, causal=True)
        row[f"{name}_us"] = time_us(lambda: attn.run(q, cache, out=out), rep=rep)["median_us"]
        attn.check_errors()
    row["normal_over_det"] = row["normal_us"] / row["det_us"]
    print(f"{batch:4d} x {kv_len:6d} q {q_len:5d} hkv {hkv:2d}: normal {row['normal_us']:9.1f} us, "
          f"deterministic {row['det_us']:9.1f} us, ratio {row['normal_over_det']:.3f}", file=sys.stderr, flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--sections", default="decode,prefill")
    ap.add_argument("--min-chunk", type=int, default=attention.DETERMINISTIC_MIN_CHUNK,
                    help="the deterministic pieces' floor in tokens (default: scheduler.DETERMINISTIC_MIN_CHUNK)")
    a = ap.parse_args(argv)
    attention.DETERMINISTIC_MIN_CHUNK = a.min_chunk  # read by the wrappers made below
    result = {"device": device_info(), "commit": commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "deterministic_pieces": DETERMINISTIC_PIECES, "deterministic_min_chunk": a.min_chunk}
    sections = a.sections.split(",")
    if "decode" in sections:
        ws = {"normal": wrapper("decode", 8, False, 256), "det": wrapper("decode", 8, True, 256)}
        result["decode"] = [cell(ws, b, kv, 1, 8, a.rep) for b, kv in DECODE_GRID]
    if "prefill" in sections:
        rows = []
        for hkv in (32, 8):
            ws = {"normal": wrapper("prefill", hkv, False, 16384), "det": wrapper("prefill", hkv, True, 16384)}
            rows += [cell(ws, b, s, s, hkv, a.rep) for b, s in PREFILL_GRID + FAMILY_GRID]
        result["prefill"] = rows
    worst = min(r["normal_over_det"] for s in ("decode", "prefill") for r in result.get(s, []))
    result["worst_normal_over_det"] = worst
    print(f"worst cell: normal / deterministic = {worst:.3f} (bar: >= 0.9)", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
