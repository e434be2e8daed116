"""Does our prefill kernel lose speed as a step holds more independent KV streams? Causal, 16 heads (one
query head per KV head, as the FlexAttention benchmark runs), head_dim 128, ragged KV, at a fixed length
and a growing batch: the work per request and head stays the same, only how many (request, head) pairs the
132 CTAs share out grows. Ours (the wrapper's own kernel pick) and FlashInfer's FA2 template on the same
inputs in the same process, median of CUDA-event timings; TF/s as perf/prefill.py counts them. A ratio
to FA2 that falls as the batch grows points at our plan's order (L2 reuse), not the kernel's inner loop.

Prefill plans go request by request by default (fi_backend.wrappers, PLAN_GROUPED_MIN_KV); with
FI_BACKEND_PLAN_GROUPED=0 they are LPT over all items, so alternating runs are the A/B of that
(perf/results/locality_h_*.json).

    python -m perf.tools.locality [--name NAME]   # on the GPU machine (FlashInfer staged); perf/results/NAME.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from perf import prefill as P
from perf.common import log, stamp, time_us, write_result

HEADS = 16
SHAPES = ((1, 16384), (2, 16384), (4, 16384), (16, 16384), (4, 4096), (16, 4096), (64, 4096))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="locality", help="results name (default: locality)")
    a = ap.parse_args(argv)
    rows = []
    fa2 = P.FlashInferRagged("fa2")
    for i, (b, s) in enumerate(SHAPES, 1):
        case = P.Case(b, s, HEADS, HEADS)
        flops = P.attention_flops(P.unmasked_pairs(s, s, causal=True), HEADS, P.D) * b
        fn, _, info = P.ours_fn(case)
        afn, _ = fa2.fn(case)
        rep = 30 if b * s * s <= 4 * 16384 * 16384 else 10
        ours = time_us(fn, rep=rep)["median_us"]
        anchor = time_us(afn, rep=rep)["median_us"]
        r = {"batch": b, "seq_len": s, "num_qo_heads": HEADS, "num_kv_heads": HEADS, "head_dim": P.D,
             "pairs": b * HEADS, "ours_us": ours, "fi_fa2_us": anchor, "ours_tflops": P.tflops(flops, ours),
             "fi_fa2_tflops": P.tflops(flops, anchor), "ratio_fi_fa2_over_ours": anchor / ours, **info}
        rows.append(r)
        log(f"[{i}/{len(SHAPES)}] {b}x{s} ({b * HEADS} request-head pairs): ours {ours:.1f} us "
            f"{r['ours_tflops']:.0f} TF/s, FA2 {anchor:.1f} us {r['fi_fa2_tflops']:.0f} TF/s, ratio "
            f"{r['ratio_fi_fa2_over_ours']:.3f}")
        del fn, afn, case
        torch.cuda.empty_cache()
    from fi_backend import env
    write_result(a.name, {**stamp(), "plan_grouped": env.flag(env.PLAN_GROUPED, True), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
