"""The attention modules' named sets for ahead-of-time builds (`fi-backend build NAME`, .ci/prebuild.py):
what the GPU tests, the benchmarks and the model zoo load, derived here from the same definitions they use.

    decode, prefill   the default variant over head sizes, dtypes and GQA groups
    tests             every module tests/test_decode_gpu.py, test_prefill_gpu.py, test_composable_gpu.py and
                      test_deterministic_gpu.py load (a CPU test, tests/test_kernels_build.py, runs those tests without
                      a GPU and checks it), with merge and append for tests/test_ops_gpu.py and tests/test_append_gpu.py
    zoo               models.modules_of over every zoo model fi-backend runs, bf16 and fp8 e4m3 KV (normal mode)
    bench             the benchmarks' kernels (perf/): Llama-shaped decode and prefill, the FlexAttention variants;
                      tools/det_cost.py's deterministic decode module
"""
from __future__ import annotations

import itertools
from typing import List, Optional

from . import variants as V
from .kernels import ModuleSpec
from .kernels.sets import module_set, specs_of
from .shapes import HEAD_DIMS, PREFILL_FA3_TUNINGS, PREFILL_WS_TUNINGS, prefill_family_shapes, prefill_family_size, prefill_uses_wgmma
from .specs import attention_specs, prefill_spec

_BOTH = ("decode", "prefill")


def _family(variant: V.Variant, head_dim: int, q: str, kv: str, group: int, tuning: Optional[dict] = None,
            kernels=_BOTH, deterministic: bool = False) -> List[ModuleSpec]:
    """The modules of a wrapper per kernel (the prefill tile family: every member; deterministic wrappers' decode
    module is one of its own)."""
    return [s for k in kernels for s in attention_specs(variant, head_dim, q, kv, group, tuning, k, deterministic)]


def _unique(specs: List[ModuleSpec]) -> List[ModuleSpec]:
    return list({s.memo_key: s for s in specs}.values())


@module_set("prefill", "prefill attention, default variant: head_dim 64/80/96/128/256 x bf16/fp16 x (same, fp8 e4m3) "
                       "KV x GQA group 1/4/8")
def _prefill_set() -> List[ModuleSpec]:
    return [prefill_spec(V.DEFAULT, d, q, kv, g, member=m) for d in HEAD_DIMS for q in ("bf16", "fp16")
            for kv in (q, "fp8_e4m3") for g in (1, 4, 8) for m in range(prefill_family_size(d, kv))]


@module_set("decode", "decode attention, default variant: head_dim 64/80/96/128/256 x bf16/fp16 x (same, fp8 e4m3) "
                      "KV x GQA group 1/4/8")
def _decode_set() -> List[ModuleSpec]:
    return [s for d in HEAD_DIMS for q in ("bf16", "fp16") for kv in (q, "fp8_e4m3") for g in (1, 4, 8)
            for s in attention_specs(V.DEFAULT, d, q, kv, g, kernel="decode")]


# The GPU tests' built-in variants by name (tests/attention_cases.py's cases).
_TEST_VARIANTS = ("default", "soft_cap", "window", "alibi", "sigmoid", "custom_mask", "rope", "rope_interleave",
                  "soft_cap_window", "rope_window", "alibi_window")


def gpu_test_specs() -> List[ModuleSpec]:
    """The modules of tests/test_decode_gpu.py, test_prefill_gpu.py, test_composable_gpu.py and
    test_deterministic_gpu.py (both kernels unless named)."""
    out = []
    # the matrices: head_dim 64/128/256 x group 1/4/8, bf16 and fp16 alternating over the cells
    for d, g, q in itertools.product((64, 128, 256), (1, 4, 8), ("bf16", "fp16")):
        out += _family(V.DEFAULT, d, q, q, g)
    # fp8 KV, head_dim 64/128/256; fp16 queries (decode); RoPE over fp8
    for d, kv in itertools.product((64, 128, 256), ("fp8_e4m3", "fp8_e5m2")):
        out += _family(V.DEFAULT, d, "bf16", kv, 4)
    out += _family(V.DEFAULT, 128, "fp16", "fp8_e4m3", 4, kernels=("decode",))
    out += _family(V.ROPE, 128, "bf16", "fp8_e4m3", 4)
    # every variant at 16 / 4 heads, both query types; one head a chunk
    for name, q in itertools.product(_TEST_VARIANTS, ("bf16", "fp16")):
        out += _family(V.BUILTIN_VARIANTS[name], 128, q, q, 4)
    out += _family(V.DEFAULT, 128, "bf16", "bf16", 1) + _family(V.DEFAULT, 64, "bf16", "bf16", 1)
    out += _family(V.DEFAULT, 128, "bf16", "bf16", 6, kernels=("decode",))  # test_merge_lanes's 12 / 2 heads
    out += _family(V.DEFAULT, 128, "bf16", "bf16", 16, kernels=("decode",))  # the 16-row decode family's graphs
    for name in ("window", "soft_cap", "alibi"):
        out += _family(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", 1, kernels=("prefill",))
    # prefill, forced shapes: the window family's members (bf16, fp8 KV), the warp-specialised member 0
    # shapes over groups (12 x 1 with every variant), ALiBi by MMA at 1, 2, 4, 8 heads a chunk, the mma.sync
    # family
    for kv in ("bf16", "fp8_e4m3"):
        for shape in prefill_family_shapes(128, kv, variant=V.SLIDING_WINDOW):
            out += _family(V.SLIDING_WINDOW, 128, "bf16", kv, 4, shape, ("prefill",))
    for tuning in PREFILL_WS_TUNINGS.values() if prefill_uses_wgmma() else ():  # the tests run on an H100
        for g, q in itertools.product((1, 4, 8), ("bf16", "fp16")):
            out += _family(V.DEFAULT, 128, q, q, g, tuning, ("prefill",))
    # FA3's consumer loop (test_fa3_member's cases, test_fa3_member_ragged's groups)
    fa3 = ((128, 1, "bf16"), (128, 4, "fp16"), (128, 7, "bf16"), (64, 4, "bf16"), (64, 1, "fp16"), (128, 4, "bf16"),
           (96, 1, "bf16"), (96, 4, "bf16"), (80, 4, "bf16"))  # (and test_fa3_member_head_sizes_80_96's)
    for d, g, q in fa3 if prefill_uses_wgmma() else ():
        out += _family(V.DEFAULT, d, q, q, g, PREFILL_FA3_TUNINGS[d], ("prefill",))
    # ... with one query buffer at head size 64, and without the ping-pong (fa3=1)
    fa3_more = ((64, 4, {"q_buffers": 1}), (64, 1, {"q_buffers": 1}), (128, 4, {"fa3": 1}), (64, 1, {"fa3": 1}))
    for d, g, over in fa3_more if prefill_uses_wgmma() else ():
        out += _family(V.DEFAULT, d, "bf16", "bf16", g, {**PREFILL_FA3_TUNINGS[d], **over}, ("prefill",))
    for name in _TEST_VARIANTS if prefill_uses_wgmma() else ():
        if not name.startswith("rope"):
            out += _family(V.BUILTIN_VARIANTS[name], 128, "bf16", "bf16", 4, PREFILL_WS_TUNINGS["w12"], ("prefill",))
    for g, q in itertools.product((1, 2, 4, 8), ("bf16", "fp16")):
        out += _family(V.ALIBI, 128, q, q, g, kernels=("prefill",))
    for d in (64, 128, 256):
        for shape in prefill_family_shapes(d, "bf16", wgmma=False):
            out += _family(V.DEFAULT, d, "bf16", "bf16", 4, shape, ("prefill",))
    out += _family(V.DEFAULT, 128, "bf16", "fp8_e4m3", 4, prefill_family_shapes(128, "fp8_e4m3", wgmma=False)[0],
                   ("prefill",))
    out += _family(V.ROPE, 128, "bf16", "bf16", 4, prefill_family_shapes(128, "bf16", wgmma=False)[0], ("prefill",))
    # tests/test_composable_gpu.py: shared-prefix groups at a GQA group of 7
    out += _family(V.DEFAULT, 128, "bf16", "bf16", 7)
    # tests/test_deterministic_gpu.py: deterministic decode modules (its prefill wrappers load the normal family)
    for variant in (V.DEFAULT, V.SLIDING_WINDOW, V.SIGMOID):
        out += _family(variant, 128, "bf16", "bf16", 4, kernels=("decode",), deterministic=True)
    return _unique(out)


@module_set("tests", "what the GPU tests load: tests/test_decode_gpu.py, test_prefill_gpu.py (checked on the CPU by "
                     "tests/test_kernels_build.py), merge and append")
def _tests_set() -> List[ModuleSpec]:
    return _unique(gpu_test_specs() + specs_of(["merge", "append"]))


@module_set("zoo", "every module the model zoo's runnable models and their tensor-parallel ranks need "
                   "(models.modules_of over ZOO and tp_slices()), bf16 and fp8 e4m3 KV")
def _zoo_set() -> List[ModuleSpec]:
    from . import models
    ranks = [m for m in models.tp_slices() if models.check(m)[0]]
    return _unique([s for m in list(models.ZOO) + ranks for s in models.modules_of(m)])


@module_set("bench", "the benchmarks' kernels (perf/): head_dim 128, bf16, GQA group 1/4/8, the default variant "
                     "(also fp8 e4m3 KV) and the FlexAttention variants (soft-cap, ALiBi, sliding window)")
def _bench_set() -> List[ModuleSpec]:
    out = []
    for g in (1, 4, 8):
        out += _family(V.DEFAULT, 128, "bf16", "bf16", g) + _family(V.DEFAULT, 128, "bf16", "fp8_e4m3", g)
        for variant in (V.SOFT_CAP, V.ALIBI, V.SLIDING_WINDOW):
            out += _family(variant, 128, "bf16", "bf16", g)
    # tools/det_cost.py: its deterministic decode wrappers (32 / 8 heads; its prefill ones load the family above)
    out += _family(V.DEFAULT, 128, "bf16", "bf16", 4, kernels=("decode",), deterministic=True)
    return _unique(out)
