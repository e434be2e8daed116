"""Host cost of run() for the warp-specialised prefill kernel, KV TMA maps on or off (FI_BACKEND_KV_TMA in the
environment; each process reads it once): a tiny case (the GPU finishes each launch before the host issues the
next), host wall time per run() call and per _kv_maps() call (ctypes and the two encodes, or the early return
when off), perf.common.host_us. Prints one JSON line with device, date and commit:

    for v in 1 0 1 0; do FI_BACKEND_KV_TMA=$v python3 -m perf.run_host; done   # on the GPU machine
"""
import datetime
import json
import os

from perf.common import commit, device_info, host_us
from perf.prefill import Case, ours_fn


def main():
    case = Case(1, 64, 32, 8, seed=1)
    # member 0's shape (warp-specialised, the maps' user), forced: a tiny case would otherwise pick a small tile
    fn, _, _ = ours_fn(case, tuning={"warps": 8, "mfrags": 2, "tile": 64, "stages": 3, "step": 64, "producer": 1})
    attn = fn.attn
    run_us = host_us(fn, 3000)  # first: _kv_maps reads the parameters run() last set
    print(json.dumps({"device": device_info()["name"], "commit": commit(),
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "kv_tma": os.environ.get("FI_BACKEND_KV_TMA", "(unset)"), "maps": attn._kv_maps(),
                      "module": attn._launcher.module.name, "run_us": run_us,
                      "kv_maps_call_us": host_us(attn._kv_maps, 3000)}))


if __name__ == "__main__":
    main()
