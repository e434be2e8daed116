"""How our kernels' time scales with the number of CTAs (one per SM): the grid at the recommended count
and 4 and 12 CTAs fewer. Prefill's recommended grid is all 132 of the H100's SMs (132, 128: what grids of
one queue per KV head used at 8 KV heads, 16 CTAs each; 120); decode's is the largest multiple of its
units (128 at 8 KV heads; then 124, 116). Work items name their unit (KV head), so any count serves every
head. Decode: 32/8 heads, head_dim 128, page 16, KV sets rotated (perf.decode.Case), anchor
FlashInfer's best decode path; prefill: causal, 32/8 heads, ragged (perf.prefill.Case), anchor FlashInfer's
FA2 template; both timed on the same inputs in the same process. Median of CUDA-event timings.

    python -m perf.tools.sm_scaling            # on the GPU machine (FlashInfer staged); perf/results/sm_scaling.json
"""
from __future__ import annotations

import sys

import torch

from perf import decode as D, prefill as P
from perf.common import device_info, time_us, write_result

DECODE_SHAPES = ((256, 16384), (64, 4096))
PREFILL_SHAPES = ((16, 1024), (4, 4096))
FEWER = (0, 4, 12)   # CTAs below the recommended count


def log(msg: str) -> None:
    print(msg, flush=True)


def main() -> int:
    from fi_backend.wrappers import BatchAttention
    rows = []
    for b, kv in DECODE_SHAPES:
        case = D.Case([kv] * b, 16)
        anchor = D.flashinfer_best_us(case)
        full = BatchAttention.recommended_num_ctas("cuda", D.HQ, D.HKV, D.D, q_dtype=D.DTYPE, kv_dtype=case.kv_dtype)
        for fewer in FEWER:
            fn, setup, _ = D.ours(case, num_ctas=full - fewer)
            us = time_us(fn, setup=setup, rep=50)["median_us"]
            rows.append({"kernel": "decode", "batch": b, "kv_len": kv, "num_ctas": full - fewer, "ours_us": us,
                         "fi_best_us": anchor, "ratio_fi_best_over_ours": anchor / us})
            log(f"decode b={b} kv={kv} {full - fewer} CTAs: {us:.1f} us, FlashInfer {anchor:.1f} us, "
                f"ratio {anchor / us:.3f}")
            del fn
        del case
        torch.cuda.empty_cache()
    fa2 = P.FlashInferRagged("fa2")
    for b, s in PREFILL_SHAPES:
        case = P.Case(b, s, 32, 8)
        afn, _ = fa2.fn(case)
        anchor = time_us(afn, rep=30)["median_us"]
        full = None
        for fewer in FEWER:
            fn, _, info = P.ours_fn(case, num_ctas=None if full is None else full - fewer)
            full = full or info["num_ctas"]
            us = time_us(fn, rep=30)["median_us"]
            rows.append({"kernel": "prefill", "batch": b, "seq_len": s, "num_ctas": info["num_ctas"],
                         "ours_us": us, "fi_fa2_us": anchor, "ratio_fi_fa2_over_ours": anchor / us})
            log(f"prefill {b}x{s} 32/8 heads, {info['num_ctas']} CTAs: {us:.1f} us, FlashInfer FA2 "
                f"{anchor:.1f} us, ratio {anchor / us:.3f}")
            del fn
        del case, afn
        torch.cuda.empty_cache()
    write_result("sm_scaling", {"device": device_info(), "anchors": "decode: FlashInfer BatchDecodeWithPagedKV"
                                "CacheWrapper, best of tensor cores on / off; prefill: FlashInfer FA2 ragged",
                                "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
