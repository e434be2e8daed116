"""GPU correctness for the model zoo (fi_backend.models) and for every GQA group: decode, prefill, chunked
prefill and mixed prefill + decode batches against the float64 reference, fresh random inputs, outputs
poisoned with NaN first, KV slots no request reads poisoned too.

  * test_zoo_model: every distinct (query heads, KV heads, head size, variant) of the zoo's accepted models,
    page sizes 1, 16, 64 and 128, odd batch sizes and lengths (not powers of two, not multiples of a page
    or a tile), bf16; fp8 e4m3 KV at page 16.
  * test_any_group: groups 1..16, 32 and 64 at head sizes 64, 80, 96, 128 and 256, decode and prefill.
  * test_odd_group_variants / test_odd_group_kv_dtypes: groups 3, 5, 7 with every built-in variant, fp16
    queries and fp8 KV (e4m3, e5m2).

The modules these tests load are built first, in parallel (_prebuild), so a cold cache costs a minute on
16 cores rather than a serial build per case. FI_BACKEND_CUDA_ARCH_LIST=80+ptx runs the same cases on the
Ampere (mma.sync) kernels, JIT-compiled from PTX by the driver on a newer GPU; FI_ZOO_MODELS=name,name
keeps the zoo cases (and the prebuild) to those models' configurations, e.g.
    FI_BACKEND_CUDA_ARCH_LIST=80+ptx FI_ZOO_MODELS=Llama-3.1-8B,Qwen2.5-7B,Gemma-2-9B,Phi-3-mini \
        python3 -m pytest -m gpu tests/test_zoo_gpu.py -k test_zoo_model

FI_ZOO_TP=1 runs the same cases on what each rank of the large models runs under tensor parallelism
(models.tp_slices: TP 2, 4 and 8 where the heads split, e.g. Llama-3.1-70B TP8 = 8 / 1 heads) instead of the
whole models, and only those (FI_ZOO_MODELS still narrows them, by the whole model's name):
    FI_ZOO_TP=1 python3 -m pytest -m gpu tests/test_zoo_gpu.py -k "test_zoo_model or test_zoo_configs_cover"
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from fi_backend import models
from fi_backend import reference as ref
from fi_backend import variants as V

from attention_cases import _variant_case, make_wrapper, run_case, run_variant_case

pytestmark = pytest.mark.gpu

PAGES = (1, 16, 64, 128)
GROUPS = tuple(range(1, 17)) + (32, 64)
DIMS = (64, 80, 96, 128, 256)
ODD_GROUPS = (3, 5, 7)


def _zoo_configs(zoo):
    """(label, Hq, Hkv, D, variant, models) for each distinct head configuration and variant of `zoo`."""
    seen = {}
    for m in zoo:
        if not models.check(m)[0]:
            continue
        for v in models.variants_of(m):
            key = (m.num_qo_heads, m.num_kv_heads, m.head_dim, v.name)
            seen.setdefault(key, (v, []))[1].append(m.name)
    return [(f"{q}-{kv}-{d}-{name}", q, kv, d, v, names) for (q, kv, d, name), (v, names) in sorted(seen.items())]


ONLY = [n.strip().lower() for n in os.environ.get("FI_ZOO_MODELS", "").split(",") if n.strip()]
TP = os.environ.get("FI_ZOO_TP", "") == "1"
# the whole models, or with FI_ZOO_TP=1 the ranks of the large ones ("<name> TP<n>")
ZOO = models.tp_slices() if TP else models.ZOO
ZOO_CONFIGS = [c for c in _zoo_configs(ZOO) if not ONLY or any(n.rsplit(" TP", 1)[0].lower() in ONLY for n in c[5])]
NARROWED = bool(ONLY) or TP   # the group / variant sweeps (and their prebuild) are left out


def _plan_kw(variant, Hq):
    """Plan parameters of a zoo variant, small enough to bite at these lengths (a module does not depend on them)."""
    kw = {}
    if "window_left" in variant.params:
        kw["window_left"] = 37
    if "logits_soft_cap" in variant.params:
        kw["logits_soft_cap"] = 2.5
    return kw


def _specs(variant, D, q, kv, group):
    """The decode module and the prefill family's; with FI_TEST_CUTE=1 the CuTe member's at each page size too."""
    from fi_backend.wrappers import decode_spec, prefill_family_size, prefill_spec
    out = [decode_spec(variant, D, q, kv, group)] + [prefill_spec(variant, D, q, kv, group, member=m)
                                                     for m in range(prefill_family_size(D, kv))]
    if os.environ.get("FI_TEST_CUTE") == "1":
        from fi_backend.cute_member import specs_for
        out += [s for page in PAGES for s in specs_for(variant, D, q, kv, page)]
    return out


@pytest.fixture(scope="module", autouse=True)
def _prebuild():
    build_modules()


def build_modules():
    """Every module of this file, built in parallel before the first case (already-cached ones are found)."""
    from fi_backend import kernels
    specs = []
    for _, q, kv, d, v, _ in ZOO_CONFIGS:
        specs += _specs(v, d, "bf16", "bf16", q // kv) + _specs(v, d, "bf16", "fp8_e4m3", q // kv)
    for d in () if NARROWED else DIMS:
        for g in GROUPS:
            specs += _specs(V.DEFAULT, d, "bf16", "bf16", g)
    for g in () if NARROWED else ODD_GROUPS:
        for name in _variant_names(128):
            specs += _specs(_variant_case(name, 8 * g)[1], 128, "bf16", "bf16", g)
        for q, kv in (("fp16", "fp16"), ("bf16", "fp8_e4m3"), ("bf16", "fp8_e5m2"), ("fp16", "fp8_e4m3")):
            specs += _specs(V.DEFAULT, 128, q, kv, g)
    unique = list({s.memo_key: s for s in specs}.values())
    results = kernels.build_many(unique, jobs=os.cpu_count() or 4)
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, f"{len(failed)} of {len(unique)} modules failed to build: {failed[:3]}"


def _lens(n, lo, hi):
    """n odd lengths in [lo, hi]: not a power of two, not a multiple of a page or a 64-token tile."""
    out = []
    while len(out) < n:
        x = random.randint(lo, hi)
        if x % 2 and x & (x - 1) and x % 64:
            out.append(x)
    return out


def _cases(attn_dec, attn_pre, dtype, kv_dtype, plan_kw, what, poison=True):
    """Decode, prefill, chunked prefill and a mixed batch through one decode and one prefill wrapper."""
    kw = dict(dtype=dtype, kv_dtype=kv_dtype, causal=True, variant_kw=plan_kw, ref_kw=plan_kw, poison=poison)
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    scales = dict(k_scale=0.75, v_scale=1.25) if fp8 else {}
    b = random.choice((3, 7, 13))
    run_case(attn_dec, _lens(b, 1, 3001), [1] * b, what=f"{what} decode b={b}", **kw, **scales)
    q = _lens(3, 1, 700)
    run_case(attn_pre, q, q, what=f"{what} prefill q={q}", **kw, **scales)
    q, extra = _lens(3, 1, 300), _lens(3, 1, 2000)
    run_case(attn_pre, [a + e for a, e in zip(q, extra)], q, what=f"{what} chunked prefill q={q}", **kw, **scales)
    dec = _lens(9, 1, 2500)
    q = [1] * 9 + _lens(2, 3, 400)
    run_case(attn_pre, dec + [x + 301 for x in q[9:]], q, what=f"{what} mixed", **kw, **scales)


def _pair(Hq, Hkv, D, *, variant, page, q_dtype=torch.bfloat16, kv_dtype=None):
    return (make_wrapper(Hq, Hkv, D, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=page, variant=variant),
            make_wrapper(Hq, Hkv, D, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=page, variant=variant,
                         kernel="prefill", max_tokens=4096))


@pytest.mark.parametrize("label,Hq,Hkv,D,variant,names", ZOO_CONFIGS, ids=[c[0] for c in ZOO_CONFIGS])
def test_zoo_model(label, Hq, Hkv, D, variant, names):
    plan_kw = _plan_kw(variant, Hq)
    for page in PAGES:
        dec, pre = _pair(Hq, Hkv, D, variant=variant, page=page)
        _cases(dec, pre, torch.bfloat16, None, plan_kw, f"{label} ({', '.join(names)}) page {page}")
    dec, pre = _pair(Hq, Hkv, D, variant=variant, page=16, kv_dtype=torch.float8_e4m3fn)
    _cases(dec, pre, torch.bfloat16, torch.float8_e4m3fn, plan_kw, f"{label} fp8 KV page 16")


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_any_group(group, D):
    Hkv = 1 if group >= 16 else 2
    page = PAGES[(GROUPS.index(group) + DIMS.index(D)) % len(PAGES)]
    dec, pre = _pair(Hkv * group, Hkv, D, variant=V.DEFAULT, page=page)
    _cases(dec, pre, torch.bfloat16, None, {}, f"group {group} D {D} page {page}")


def _variant_names(D):
    from attention_cases import _VARIANT_NAMES
    return [n for n in _VARIANT_NAMES if D % 64 == 0 or "rope" not in n]


@pytest.mark.parametrize("group", ODD_GROUPS)
@pytest.mark.parametrize("name", _variant_names(128))
def test_odd_group_variants(name, group):
    Hkv = 2
    variant = _variant_case(name, Hkv * group)[1]
    for kernel in ("decode", "prefill"):
        attn = make_wrapper(Hkv * group, Hkv, 128, page_size=16, variant=variant, kernel=kernel, max_tokens=4096)
        q = [1] * 5 if kernel == "decode" else _lens(3, 1, 400)
        kv = [x + random.randint(0, 900) for x in q]
        run_variant_case(attn, name, kv, q, torch.bfloat16, poison=True)


@pytest.mark.parametrize("group", ODD_GROUPS)
@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float16, None), (torch.bfloat16, torch.float8_e4m3fn),
                                              (torch.bfloat16, torch.float8_e5m2), (torch.float16, torch.float8_e4m3fn)])
def test_odd_group_kv_dtypes(group, q_dtype, kv_dtype):
    dec, pre = _pair(2 * group, 2, 128, variant=V.DEFAULT, page=16, q_dtype=q_dtype, kv_dtype=kv_dtype)
    _cases(dec, pre, q_dtype, kv_dtype, {}, f"group {group} {q_dtype} KV {kv_dtype}")


def test_zoo_configs_cover_the_zoo():
    """Every accepted zoo model's heads appear among the tested configurations (and the odd groups do)."""
    if ONLY:
        pytest.skip("FI_ZOO_MODELS keeps a part of the zoo")
    tested = {(q, kv, d, v.name) for _, q, kv, d, v, _ in ZOO_CONFIGS}
    for m in ZOO:
        if not models.check(m)[0]:
            assert not TP, f"{m.name}: {models.check(m)[1]}"   # every TP rank is one the kernels take
            continue
        for v in models.variants_of(m):
            assert (m.num_qo_heads, m.num_kv_heads, m.head_dim, v.name) in tested, m.name
    if TP:   # the ranks the issue names, and one whose KV heads are replicated (group 6, not the model's 12)
        names = {n for c in ZOO_CONFIGS for n in c[5]}
        assert {"Llama-3.1-70B TP8", "Qwen2.5-32B TP4", "Llama-3.1-405B TP8", "StarCoder2-15B TP8"} <= names
        assert {(8, 1, 128), (10, 2, 128), (16, 1, 128), (6, 1, 128)} <= {t[:3] for t in tested}
    else:
        assert {q // kv for _, q, kv, _, _, _ in ZOO_CONFIGS} >= {3, 5, 6, 7}
