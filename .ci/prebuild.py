"""Build, on a machine with nvcc and no GPU, every attention module the GPU tests and benchmarks load, into
$FI_BACKEND_CACHE_DIR (then pack it for the GPU machine: see .ci/gpu). Usage:
    FI_BACKEND_CACHE_DIR=$PWD/.fi_cache FI_BACKEND_CUDA_ARCH_LIST=90a python3 .ci/prebuild.py [--jobs N]
    python3 .ci/prebuild.py --list > /tmp/modules   # their directory names: pack only these (see .ci/gpu)
Keep in step with tests/test_decode_gpu.py, tests/test_prefill_gpu.py and perf/."""
import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, ".")
os.environ.setdefault("FI_BACKEND_CUDA_ARCH_LIST", "90a")  # the GPU machine's H100; names the modules for --list too
from fi_backend import kernels, variants as V  # noqa: E402
from fi_backend.kernels.sets import specs_of  # noqa: E402
from fi_backend.wrappers import (PREFILL_WS_TUNINGS, decode_spec, prefill_family_shapes, prefill_family_size,  # noqa: E402
                                 prefill_spec)

_VARIANTS = ("default", "soft_cap", "window", "alibi", "sigmoid", "custom_mask", "rope", "rope_interleave",
             "soft_cap_window", "rope_window", "alibi_window")


def specs():
    out = list(specs_of(["merge", "append"]))
    for spec_fn in (decode_spec, prefill_spec):
        def add(v, D, q, kv, g, spec_fn=spec_fn):  # every member of the prefill tile family
            members = prefill_family_size(D, kv) if spec_fn is prefill_spec else 1
            out.extend(spec_fn(v, D, q, kv, g, **({"member": m} if m else {})) for m in range(members))
        for D, g, q in itertools.product((64, 128, 256), (1, 4, 8), ("bf16", "fp16")):
            add(V.DEFAULT, D, q, q, g)
        for kv, D in itertools.product(("fp8_e4m3", "fp8_e5m2"), (64, 128, 256)):
            add(V.DEFAULT, D, "bf16", kv, 4)
        add(V.DEFAULT, 128, "fp16", "fp8_e4m3", 4)
        add(V.DEFAULT, 128, "bf16", "fp8_e4m3", 8)
        for name, q in itertools.product(_VARIANTS, ("bf16", "fp16")):
            add(V.BUILTIN_VARIANTS[name], 128, q, q, 4)
        for name in ("soft_cap", "window", "alibi", "default"):
            add(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", 1)
        add(V.ROPE, 128, "bf16", "fp8_e4m3", 4)
        add(V.SLIDING_WINDOW, 128, "bf16", "fp8_e4m3", 4)  # test_window_family_members
        add(V.ROPE, 128, "bf16", "bf16", 4)
    for D in (64, 128, 256):  # the mma.sync family on the H100 (test_mma_sync_family)
        out.extend(prefill_spec(V.DEFAULT, D, "bf16", "bf16", 4, tuning=t) for t in prefill_family_shapes(D, "bf16", wgmma=False))
    out.append(prefill_spec(V.DEFAULT, 128, "bf16", "fp8_e4m3", 4, tuning=prefill_family_shapes(128, "fp8_e4m3", wgmma=False)[0]))
    out.append(prefill_spec(V.ROPE, 128, "bf16", "bf16", 4, tuning=prefill_family_shapes(128, "bf16", wgmma=False)[0]))
    # The warp-specialised prefill forced (tests/test_prefill_gpu.py: PREFILL_WS_TUNINGS).
    ws, w8m2 = PREFILL_WS_TUNINGS["w12"], PREFILL_WS_TUNINGS["w8m2"]
    for g, q in itertools.product((1, 4, 8), ("bf16", "fp16")):
        out.append(prefill_spec(V.DEFAULT, 128, q, q, g, tuning=ws))
    for g, q in itertools.product((1, 4), ("bf16", "fp16")):
        out.append(prefill_spec(V.DEFAULT, 128, q, q, g, tuning=w8m2))
    for name in _VARIANTS:
        if not name.startswith("rope"):
            out.append(prefill_spec(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", 4, tuning=ws))
    for name, g in itertools.product(("soft_cap", "window", "alibi", "default"), (1, 4)):
        for t in (ws, w8m2):
            out.append(prefill_spec(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", g, tuning=t))
    for g, q in itertools.product((1, 2, 4, 8), ("bf16", "fp16")):  # test_alibi_bias_mma
        out.append(prefill_spec(V.ALIBI, 128, q, q, g))
    seen, uniq = set(), []
    for s in out:
        if s.memo_key not in seen:
            seen.add(s.memo_key)
            uniq.append(s)
    return uniq


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true",
                    help="print the modules' cache directory names (what to pack) instead of building")
    a = ap.parse_args()
    todo = specs()
    if a.list:
        from fi_backend.kernels import builder
        nvcc = builder.find_nvcc()
        version = builder.nvcc_version(nvcc) if nvcc else None
        for s in todo:
            print(builder.module_identity(s, builder.resolve_arch_list("90a"), version, csrc=builder.csrc_dir()).name)
        sys.exit(0)
    t = time.time()
    res = kernels.build_many(todo, archs="90a", jobs=a.jobs,
                             on_done=lambda s, r: print(s.tag, r, flush=True) if isinstance(r, Exception) else None)
    failed = sum(isinstance(r, Exception) for r in res)
    print(f"{len(todo)} modules in {time.time() - t:.0f} s, {failed} failed")
    sys.exit(1 if failed else 0)
