"""One profiled launch (after 3 warm-ups) of ours / FlashInfer FA3 / FA2 on perf.prefill's Case, for ncu:

    ncu --profile-from-start off --set full -o ours python3 perf/ncu_prefill.py ours 1x16384 32 [TUNING_JSON]

argv: impl (ours, fa2, fa3), BxS, KV heads (32 query heads), optionally our kernel shape as JSON."""
import sys, torch
sys.path.insert(0, ".")
impl, bs, hkv = sys.argv[1], sys.argv[2], int(sys.argv[3])
from perf.prefill import Case, ours_fn, FlashInferRagged
b, s = (int(x) for x in bs.split("x"))
case = Case(b, s, 32, hkv)
if impl == "ours":
    import json
    fn, out, info = ours_fn(case, tuning=json.loads(sys.argv[4]) if len(sys.argv) > 4 else None)
    print(info, flush=True)
else:
    fn, out = FlashInferRagged(impl).fn(case)
for _ in range(3):
    fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done", impl, bs, hkv, flush=True)
