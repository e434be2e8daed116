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
from fi_backend.wrappers import decode_spec, prefill_family_shapes, prefill_family_size, prefill_spec  # noqa: E402

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
        if spec_fn is decode_spec:  # odd groups: tests/test_plan_partition_gpu.py
            for g in (5, 7):
                add(V.DEFAULT, 128, "bf16", "bf16", g)
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
    # The warp-specialised prefill (tuning producer=1): tests/test_prefill_gpu.py (_WS) and perf A/B runs.
    ws = {64: {"warps": 12, "mfrags": 1, "producer": 1}, 128: {"warps": 12, "mfrags": 1, "producer": 1}, 256: {"warps": 4, "mfrags": 1, "producer": 1}}
    for (D, g), q in itertools.product(((64, 1), (128, 1), (128, 4), (128, 8), (256, 4)), ("bf16", "fp16")):
        out.append(prefill_spec(V.DEFAULT, D, q, q, g, tuning=ws[D]))
    for (g, q), t in itertools.product(((4, "bf16"), (4, "fp16"), (1, "bf16"), (1, "fp16")),
                                       ({"warps": 8, "mfrags": 1, "stages": 3, "producer": 1},
                                        {"warps": 8, "mfrags": 2, "stages": 3, "producer": 1, "pingpong": 0})):
        out.append(prefill_spec(V.DEFAULT, 128, q, q, g, tuning=t))
    for name in _VARIANTS:
        if not name.startswith("rope"):
            out.append(prefill_spec(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", 4, tuning=ws[128]))
    for name, g in itertools.product(("soft_cap", "window", "alibi", "default"), (1, 4)):
        for t in (ws[128], {"warps": 8, "mfrags": 1, "stages": 3, "producer": 1},
                  {"warps": 8, "mfrags": 2, "stages": 3, "producer": 1, "pingpong": 0}):
            out.append(prefill_spec(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", g, tuning=t))
    # Ping-pong (tuning pingpong=1): tests/test_prefill_gpu.py (_PP, the variants at 12 x 1) and perf A/B runs.
    pp = {"w8m2pp": {"warps": 8, "mfrags": 2, "stages": 3, "producer": 1, "pingpong": 1},
          "w8t128pp": {"warps": 8, "mfrags": 1, "tile": 128, "stages": 2, "step": 128, "producer": 1, "pingpong": 1},
          "w12pp": {"warps": 12, "mfrags": 1, "producer": 1, "pingpong": 1}}
    for q in ("bf16", "fp16"):
        out.extend([prefill_spec(V.DEFAULT, 128, q, q, 4, tuning=pp["w8m2pp"]),
                    prefill_spec(V.DEFAULT, 128, q, q, 1, tuning=pp["w8t128pp"]),
                    prefill_spec(V.DEFAULT, 128, q, q, 8, tuning=pp["w12pp"])])
    for name in _VARIANTS:
        if not name.startswith("rope"):
            out.append(prefill_spec(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", 4, tuning={**ws[128], "pingpong": 1}))
    for name, g in itertools.product(("soft_cap", "window", "alibi", "default"), (1, 4)):
        for t in pp.values():
            out.append(prefill_spec(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", g, tuning=t))
    for g in (1, 4):  # the 8 x 1 shape with 128-token tiles, without ping-pong (A/B)
        out.append(prefill_spec(V.DEFAULT, 128, "bf16", "bf16", g, tuning={**pp["w8t128pp"], "pingpong": 0}))
    # The softmax's row sums by MMA or not (tuning rowsum): tests/test_prefill_gpu.py (test_row_sums) and perf A/B runs.
    for (name, g), rs in itertools.product((("default", 1), ("default", 4), ("window", 4), ("alibi", 4), ("soft_cap", 1),
                                            ("custom_mask", 4), ("sigmoid", 4), ("window", 1), ("alibi", 1)),
                                           ({"rowsum": 0}, {"rowsum": 1})):
        out.append(prefill_spec(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", g, tuning=rs))
    for rs in ({"rowsum": 0}, {"rowsum": 1}):
        out.extend([prefill_spec(V.DEFAULT, 128, "fp16", "fp16", 4, tuning=rs),
                    prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={"warps": 8, "mfrags": 1, "stages": 3, "producer": 1, **rs}),
                    prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 8, tuning={**pp["w12pp"], **rs})])
    # ALiBi by MMA or per element (tuning bias): tests/test_prefill_gpu.py (test_alibi_bias_mma), both query types.
    for (g, shape), b, q in itertools.product(((1, {}), (2, {}), (4, pp["w12pp"]),
                                               (8, {"warps": 8, "mfrags": 1, "stages": 3, "producer": 1}),
                                               (1, pp["w8t128pp"])), (0, 1), ("bf16", "fp16")):
        out.append(prefill_spec(V.ALIBI, 128, q, q, g, tuning={**shape, "bias": b}))
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
