"""Host cost of run() for the warp-specialised prefill kernel, KV TMA maps on or off (FI_BACKEND_KV_TMA in the
environment; each process reads it once): a tiny case (the GPU finishes each launch before the host issues the
next), wall time of N run() calls / N, and of N _kv_maps() calls (ctypes + the two encodes, or the early
return when off). Prints one JSON line (perf/results/run_host_kv_maps_*.jsonl):

    for v in 1 0 1 0; do FI_BACKEND_KV_TMA=$v python3 perf/run_host.py; done
"""
import json, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from perf.prefill import Case, ours_fn

N = 3000
case = Case(1, 64, 32, 8, seed=1)
# member 0's shape (warp-specialised, the maps' user), forced: a tiny case would otherwise pick a small tile
fn, out, info = ours_fn(case, tuning={"warps": 8, "mfrags": 2, "tile": 64, "stages": 3, "step": 64, "producer": 1})
attn = None
for cell in fn.__closure__:  # the wrapper inside ours_fn's closure
    if type(cell.cell_contents).__name__ == "BatchAttention":
        attn = cell.cell_contents
res = {"kv_tma": os.environ.get("FI_BACKEND_KV_TMA", "(unset)")}
for _ in range(200):
    fn()
torch.cuda.synchronize()
best = []
for rep in range(5):
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    best.append((time.perf_counter() - t0) / N * 1e6)
res["run_us"] = sorted(best)
maps = []
for rep in range(5):
    t0 = time.perf_counter()
    for _ in range(N):
        attn._kv_maps()
    maps.append((time.perf_counter() - t0) / N * 1e6)
res["kv_maps_call_us"] = sorted(maps)
res["maps"] = attn._kv_maps()
res["module"] = attn._launcher.module.name if hasattr(attn._launcher.module, "name") else str(attn._launcher.module)
print(json.dumps(res))
