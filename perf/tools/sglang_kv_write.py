"""The SGLang adapter's two K/V writes, timed on the same inputs: SGLang 0.5.15's own
`MHATokenToKVPool.set_kv_buffer` (the adapter's default) against fi-backend's `ops.append_paged_kv_cache` into
the same pool's buffers (FI_BACKEND_SGLANG_KV_WRITE=append). Llama-3.1-8B's KV heads (8 x 128), bf16, page 1,
one layer; token counts of decode steps (1-256) and prefill chunks (512-8192), slots a random permutation of
the pool. Alternating rounds, median of CUDA-event timings (perf.common.time_rounds); the two writes are
checked to store the same bytes.

    source /tmp/sglang-env.sh; python -m perf.tools.sglang_kv_write   # GPU machine; perf/results/sglang_kv_write.json
"""
from __future__ import annotations

import statistics
import sys

import torch

from perf.common import device_info, log, time_rounds, write_result

TOKENS = (1, 16, 64, 256, 512, 2048, 8192)
HKV, D, SLOTS = 8, 128, 1 << 18


class _Layer:
    """What set_kv_buffer reads of a RadixAttention layer."""
    layer_id = 0


def main() -> int:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from fi_backend import ops
    pool = MHATokenToKVPool(SLOTS, page_size=1, dtype=torch.bfloat16, head_num=HKV, head_dim=D, layer_num=1,
                            device="cuda", enable_memory_saver=False)
    kv = (pool.get_key_buffer(0), pool.get_value_buffer(0))
    layer = _Layer()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in TOKENS:
        k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        loc = torch.randperm(SLOTS - 1, device="cuda", generator=g)[:n] + 1   # slot 0 is SGLang's padding slot
        fns = {"set_kv_buffer": lambda: pool.set_kv_buffer(layer, loc, k, v, None, None),
               "append": lambda: ops.append_paged_kv_cache(k, v, kv, loc)}
        fns["set_kv_buffer"]()
        want = (kv[0][loc].clone(), kv[1][loc].clone())
        kv[0][loc], kv[1][loc] = 0, 0
        fns["append"]()
        torch.cuda.synchronize()
        assert torch.equal(kv[0][loc], want[0]) and torch.equal(kv[1][loc], want[1]), f"{n} tokens: writes differ"
        t = time_rounds(fns, rounds=5, rep=200)
        med = {name: statistics.median(v) for name, v in t.items()}
        rows.append({"tokens": n, "set_kv_buffer_us": med["set_kv_buffer"], "append_us": med["append"],
                     "ratio_set_kv_buffer_over_append": med["set_kv_buffer"] / med["append"], "rounds_us": t})
        log(f"{n:5d} tokens: set_kv_buffer {med['set_kv_buffer']:7.2f} us, append {med['append']:7.2f} us, "
            f"ratio {med['set_kv_buffer'] / med['append']:.3f}")
    import sglang
    write_result("sglang_kv_write", {"device": device_info(), "sglang": sglang.__version__,
                                     "shape": {"kv_heads": HKV, "head_dim": D, "dtype": "bfloat16", "page_size": 1,
                                               "pool_slots": SLOTS},
                                     "anchor": "SGLang MHATokenToKVPool.set_kv_buffer", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
