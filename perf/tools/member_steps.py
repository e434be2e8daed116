"""The CuTe member's step rule (fi_backend.cute_member.CuteMember.takes_step) against measurement: for each step,
BatchAttention on pages in random order with the member forced on (its thresholds lifted), with the tile family
alone (FI_BACKEND_PREFILL_CUTE=0), and as the rule decides, in alternating rounds on the same inputs. A cell where
the rule's choice is not the faster one is counted as a miss.

    python -m perf.tools.member_steps [--heads 32/8/128] [--page 16] [--cells 1x1024x1024,1x2048x8192+64,...]

A cell `BxQxK` is B requests of Q new queries over K keys (Q = K: a prompt from scratch; Q < K: a chunk after
K - Q cached tokens); `+N` adds N decode requests (one query over K keys each, a mixed step). Needs an sm_90a GPU
and the nvidia-cutlass headers. Writes perf/results/<name>.json (default member_steps)."""
from __future__ import annotations

import argparse
import statistics
import sys

from perf import prefill as P
from perf.common import device_info, diff_stats, log, stamp, time_rounds, write_result

CELLS = ("1x256x256,1x512x512,1x1024x1024,2x1024x1024,1x2048x2048,16x1024x1024,4x2048x8192,1x8192x8192,"
         "1x2048x8192+16,1x2048x8192+64,1x2048x8192+256,4x1024x4096+128")


def parse_cell(cell: str) -> tuple:
    """(q_lens, kv_lens) of a cell `BxQxK[+N]`; ValueError naming the cell."""
    try:
        main, _, decodes = cell.partition("+")
        b, q, k = (int(x) for x in main.split("x"))
        n = int(decodes) if decodes else 0
    except ValueError:
        raise ValueError(f"cell {cell!r}: expected BxQxK or BxQxK+N (integers)") from None
    if b < 1 or not 1 <= q <= k or n < 0:
        raise ValueError(f"cell {cell!r}: need B >= 1, 1 <= Q <= K, N >= 0")
    return [q] * b + [1] * n, [k] * b + [k] * n


def forced(fn):
    """fn() with the member's step thresholds lifted (it takes every step whose KV covers its queries, any window)."""
    from fi_backend import cute_member
    saved = cute_member.MIN_TILES_PER_SM, cute_member.SHORT_SHARE, cute_member.WINDOW_MIN_KEYS
    cute_member.MIN_TILES_PER_SM, cute_member.SHORT_SHARE, cute_member.WINDOW_MIN_KEYS = 0.0, 1.0, 0
    try:
        return fn()
    finally:
        cute_member.MIN_TILES_PER_SM, cute_member.SHORT_SHARE, cute_member.WINDOW_MIN_KEYS = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.member_steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head_dim, comma-separated")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--name", default="member_steps")
    ap.add_argument("--variants", default="causal",
                    help="perf.prefill.flex_specs names, comma-separated (causal, soft_cap_30, sliding_window_1024; "
                         "the member does not compute alibi): each cell once a variant")
    a = ap.parse_args(argv)
    try:
        cells = [(c, *parse_cell(c)) for c in a.cells.split(",") if c]
    except ValueError as e:
        ap.error(str(e))
    import torch

    from fi_backend import env
    from fi_backend.wrappers import BatchAttention
    try:
        heads = [tuple(int(x) for x in h.split("/")) for h in a.heads.split(",") if h]
        assert heads and all(len(h) == 3 for h in heads)
    except (ValueError, AssertionError):
        ap.error(f"--heads: {a.heads!r}; expected Hq/Hkv/D[,Hq/Hkv/D...]")
    specs = P.flex_specs(None)
    variants = [v for v in a.variants.split(",") if v]
    if any(v not in specs or v == "alibi" for v in variants):
        ap.error(f"--variants: {variants}; accepted: {', '.join(k for k in specs if k != 'alibi')}")
    for (hq, hkv, d), v in ((h, v) for h in heads for v in variants):
        BatchAttention.prepare(hq, hkv, d, q_dtype=torch.bfloat16, page_size=a.page, kinds=("prefill",),
                               device="cuda", variant=specs[v][0])
    rows, misses = [], []
    for (hq, hkv, d), (cell, q_lens, kv_lens), vname in ((h, c, v) for h in heads for c in cells for v in variants):
        variant, params = specs[vname][:2]
        if vname != "causal":
            cell = f"{cell} {vname}"
        if len(heads) > 1:
            cell = f"{hq}/{hkv}/{d} {cell}"
        case = P.StepCase(q_lens, kv_lens, hq, hkv, d, page_size=a.page)
        fns, outs = {}, {}
        kw = {"paged": case.pool, "variant": variant, "params": params}
        fns["rule"], outs["rule"], info = P.ours_fn(case, **kw)
        fns["member"], outs["member"], minfo = forced(lambda: P.ours_fn(case, **kw))
        with env.setting(env.PREFILL_CUTE, "0"):
            fns["family"], outs["family"], _ = P.ours_fn(case, **kw)
        if not minfo["cute_step"]:
            log(f"{cell}: the member cannot take this step ({minfo['cute_unsupported'] or 'its KV'}); skipped")
            continue
        for fn in fns.values():  # each output written once before they are compared
            fn()
        torch.cuda.synchronize()
        checks = {k: P.check(f"{cell} {k} vs the family", diff_stats(outs[k], outs["family"]))
                  for k in ("rule", "member")}
        times = time_rounds(fns, a.rounds, a.rep)
        us = {k: statistics.median(v) for k, v in times.items()}
        faster = "member" if us["member"] < us["family"] else "family"
        takes = bool(info["cute_step"])
        r = {"cell": cell, "variant": vname, **case.shape(), "us": us, "us_per_round": times, "rule_takes": takes,
             "faster": faster, "family_over_member": us["family"] / us["member"],
             "rule_right": takes == (faster == "member"), "checks": checks}
        rows.append(r)
        if not r["rule_right"]:
            misses.append(cell)
        log(f"{cell}: member {us['member']:.1f} us, family {us['family']:.1f} us (x{r['family_over_member']:.3f}), "
            f"rule takes it: {takes}{'' if r['rule_right'] else '  MISS'}")
    write_result(a.name, {**stamp(), "device": device_info(), "heads": a.heads, "page_size": a.page,
                          "variants": variants,
                          "rule": "fi_backend.cute_member.CuteMember.takes_step", "rows": rows, "misses": misses,
                          "ratio": "family_over_member: the tile family's time / the forced member's (> 1: member "
                                   "faster)"})
    return 1 if P.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
