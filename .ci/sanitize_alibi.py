"""The body of compute-sanitizer racecheck / synccheck runs over the ALiBi bias MMA (bias_setup's named barrier,
the MMA's shared-memory operands): one small ALiBi prefill per shape (8 x 2 default, 12 x 1, the 8 x 1 non-producer
member), checked against the reference. On the GPU machine, from the repo root:
    compute-sanitizer --tool racecheck python3 .ci/sanitize_alibi.py"""
import sys
sys.path.insert(0, "tests")
import torch
from fi_backend import reference as ref
from fi_backend import variants as V
from attention_cases import make_wrapper, run_case, DEV

for group, tuning in ((1, None), (4, {"warps": 12, "mfrags": 1, "producer": 1}), (2, {"warps": 8, "mfrags": 1, "producer": 0})):
    Hkv = 2
    Hq = Hkv * group
    attn = make_wrapper(Hq, Hkv, 128, kernel="prefill", page_size=16, variant=V.ALIBI, tuning=tuning, max_tokens=2048)
    slopes = ref.alibi_slopes(Hq)
    run_case(attn, [300, 17, 1000], [300, 17, 200], dtype=torch.bfloat16, causal=True,
             variant_kw={"alibi_slopes": slopes.float().to(DEV)}, ref_kw={"alibi_slopes": slopes},
             what=f"race alibi group={group} {tuning}")
    print("ok", group, tuning, flush=True)
