"""How our kernels' time scales with the number of CTAs (one per SM): CTAs per KV head forced to the
recommended count minus 0, 1, 2 (at 8 KV heads: 128, 120, 112 of the H100's 132 SMs). The grids are
(CTAs per KV head) x (KV heads), so 132 // heads per head leaves SMs idle; this says what using them
would be worth. Decode: 32/8 heads, head_dim 128, page 16, KV sets rotated (perf.decode.Case); prefill:
causal, 32/8 heads, ragged (perf.prefill.Case). Median of CUDA-event timings (perf.common.time_us).

    python -m perf.sm_scaling            # on the GPU machine; writes perf/results/sm_scaling.json
"""
from __future__ import annotations

import sys

import torch

from perf import decode as D, prefill as P
from perf.common import device_info, time_us, write_result

DECODE_SHAPES = ((256, 16384), (64, 4096))
PREFILL_SHAPES = ((16, 1024), (4, 4096))


def log(msg: str) -> None:
    print(msg, flush=True)


def main() -> int:
    from fi_backend.wrappers import BatchAttention
    recommended = BatchAttention.recommended_num_ctas
    rows = []
    try:
        for delta in (0, 1, 2):
            BatchAttention.recommended_num_ctas = staticmethod(lambda *a, _d=delta, **k: recommended(*a, **k) - _d)
            for b, kv in DECODE_SHAPES:
                case = D.Case([kv] * b, 16)
                fn, setup, _ = D.ours(case)
                us = time_us(fn, setup=setup, rep=50)["median_us"]
                rows.append({"kernel": "decode", "batch": b, "kv_len": kv, "ctas_per_head_minus": delta, "us": us})
                log(f"decode b={b} kv={kv} CTAs per head -{delta}: {us:.1f} us")
                del case, fn
                torch.cuda.empty_cache()
            for b, s in PREFILL_SHAPES:
                case = P.Case(b, s, 32, 8)
                fn, _, info = P.ours_fn(case)
                us = time_us(fn, rep=30)["median_us"]
                rows.append({"kernel": "prefill", "batch": b, "seq_len": s, "num_ctas_per_head": info["num_ctas"],
                             "ctas_per_head_minus": delta, "us": us})
                log(f"prefill {b}x{s} 32/8 heads, {info['num_ctas']} CTAs per head: {us:.1f} us")
                del case, fn
                torch.cuda.empty_cache()
    finally:
        BatchAttention.recommended_num_ctas = recommended
    write_result("sm_scaling", {"device": device_info(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
