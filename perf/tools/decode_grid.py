"""Decode at batch 256 on grids of all the SMs and of a multiple of the units, split plan and unsplit:
what BatchAttention.recommended_num_ctas(kernel="decode") is chosen by. 32/8 heads, head_dim 128, page 16,
bf16, KV sets rotated (perf.decode.Case); FlashInfer's best decode path on the same inputs, in the same
process. Median of CUDA-event timings (perf.common.time_us).

    python -m perf.tools.decode_grid          # on the GPU machine (FlashInfer staged); perf/results/decode_grid.json
"""
from __future__ import annotations

import sys

import torch

from perf import decode as D
from perf.common import device_info, time_us, write_result

SHAPES = ((256, 1024), (256, 4096), (256, 16384))


def main() -> int:
    from fi_backend.wrappers import BatchAttention
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for b, kv in SHAPES:
        case = D.Case([kv] * b, 16)
        fi = D.flashinfer_best_us(case)
        rec = BatchAttention.recommended_num_ctas("cuda", D.HQ, D.HKV, D.D, q_dtype=D.DTYPE, kv_dtype=case.kv_dtype)
        for num_ctas in sorted({sms, rec}, reverse=True):
            for split in (True, False):
                fn, setup, ws = D.ours(case, num_ctas=num_ctas, split=split)
                us = time_us(fn, setup=setup, rep=50)["median_us"]
                plan = ws.host_plan()
                rows.append({"batch": b, "kv_len": kv, "num_ctas": num_ctas, "recommended": num_ctas == rec,
                             "split_plan": split, "num_items": plan.num_items, "num_split_rows": plan.num_split_rows,
                             "ours_us": us, "fi_best_us": fi, "ratio_fi_best_over_ours": fi / us})
                print(f"decode b={b} kv={kv} {num_ctas} CTAs{' (recommended)' if num_ctas == rec else ''} "
                      f"{'split' if split else 'unsplit'} plan: {us:.1f} us ({plan.num_items} items, "
                      f"{plan.num_split_rows} split rows), FlashInfer {fi:.1f} us, ratio {fi / us:.3f}", flush=True)
                del fn
        del case
        torch.cuda.empty_cache()
    write_result("decode_grid", {"device": device_info(), "anchor": "FlashInfer BatchDecodeWithPagedKVCacheWrapper, "
                                 "best of tensor cores on / off", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
