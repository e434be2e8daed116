"""GPU tests of the prefill kernel (csrc/attention/prefill.cuh) through BatchAttention(kernel="prefill"),
against the float64 reference. Fresh random inputs every run; outputs poisoned with NaN first.

Matrix: page size {1, 16} x head_dim {64, 128, 256} x group {1, 4, 8} in full, each with a batch whose
query lengths come from {1, 3, 17, 128, 1000} and KV lengths from {q_len, q_len + 1000, 16000}, chosen so
every value of every axis appears; bf16 / fp16 alternate. Then non-causal, fp8 KV, every variant, ragged
KV (this step's K/V as a page-1 BSR), ragged + paged prefix merged as attention states, mixed prefill +
decode batches in one plan, CUDA-graph replay after a re-plan, and the errors.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from fi_backend import env
from fi_backend import variants as V
from fi_backend.formats import from_ragged
from fi_backend.wrappers import PREFILL_FA3_TUNINGS, PREFILL_WS_TUNINGS

from attention_cases import (_VARIANT_NAMES, DEV, TOL, PersistentBatch, _variant_case, check, make_bsr, make_wrapper, random_kv,
                             reference, replay_check, run_case, run_variant_case)

pytestmark = pytest.mark.gpu

# KV TMA is on unless FI_BACKEND_KV_TMA=0 (fi_backend/env.py): these tests cover TMA tiles and, beside them,
# the gather (scattered pages, partial tiles); with the switch off, every tile is gathered.
_MAPS = env.flag(env.KV_TMA, True)

_Q_LENS = (1, 3, 17, 128, 1000)


def prefill(Hq, Hkv, D, **kw):
    kw.setdefault("max_tokens", 8192)
    return make_wrapper(Hq, Hkv, D, kernel="prefill", **kw)


def _batch(k: int):
    """Query and KV lengths of case k: every query length, every KV kind, one 16000 (long) pair."""
    q_lens, kv_lens = [], []
    for i, ql in enumerate(_Q_LENS):
        kind = (i + k) % 3
        q_lens.append(ql)
        kv_lens.append(ql if kind == 0 else ql + 1000 if kind == 1 else 16000)
    return q_lens, kv_lens


_PAGES, _DIMS, _GROUPS = (1, 16), (64, 128, 256), (1, 4, 8)


@pytest.mark.parametrize("page,D,group", list(itertools.product(_PAGES, _DIMS, _GROUPS)))
def test_prefill_matrix(page, D, group):
    k = _PAGES.index(page) + _DIMS.index(D) + _GROUPS.index(group)
    dtype = (torch.bfloat16, torch.float16)[k % 2]
    Hkv = 2
    q_lens, kv_lens = _batch(k)
    attn = prefill(Hkv * group, Hkv, D, q_dtype=dtype, page_size=page)
    run_case(attn, kv_lens, q_lens, dtype=dtype, causal=True,
             what=f"page={page} D={D} group={group} q={q_lens} kv={kv_lens}")


def test_non_causal_and_long():
    attn = prefill(8, 8, 128, page_size=16)
    run_case(attn, [16000, 1500, 128], [1000, 200, 128], dtype=torch.bfloat16, causal=False, what="non-causal")
    run_case(attn, [16000], [4000], dtype=torch.bfloat16, causal=True, what="one long causal")


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_kv(kv_dtype, D):
    attn = prefill(16, 4, D, kv_dtype=kv_dtype, page_size=16)
    run_case(attn, [1200, 17, 3000, 128], [1000, 17, 3, 128], dtype=torch.bfloat16, kv_dtype=kv_dtype, causal=True,
             k_scale=0.37, v_scale=1.9, what=f"fp8 {kv_dtype} D={D}")


@pytest.mark.parametrize("name", _VARIANT_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_variants(name, dtype):
    Hq, Hkv, D = 16, 4, 128
    attn = prefill(Hq, Hkv, D, q_dtype=dtype, page_size=16, variant=_variant_case(name, Hq)[1])
    run_variant_case(attn, name, [1500, 3, 1017, 4000, 300], [1, 3, 17, 128, 300], dtype)


@pytest.mark.parametrize("window", [700, 64])
def test_long_sliding_window(window):
    """A window wider than the compute steps: steps wholly inside every row's window skip the mask
    (mask_is_kv_range), steps across a row's edge or the diagonal keep it; GQA group 4 packs heads."""
    attn = prefill(16, 4, 128, page_size=16, variant=V.SLIDING_WINDOW)
    run_case(attn, [2500, 3000, 300], [2000, 1, 300], dtype=torch.bfloat16, causal=True,
             variant_kw={"window_left": window}, ref_kw={"window_left": window}, what=f"window {window}")
    attn = prefill(8, 8, 128, page_size=1, variant=V.SLIDING_WINDOW)
    run_case(attn, [3000], [3000], dtype=torch.bfloat16, causal=False, variant_kw={"window_left": window},
             ref_kw={"window_left": window}, what=f"window {window} non-causal")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_window_family_members(kv_dtype):
    """The sliding window's own family, each member forced: the largest at 12 warps with the loader's query
    copy despite the mask hook, the second at 8 warps (query copy too); bf16 and fp8 KV, GQA group 4, a
    window narrower than a query tile (steps below every row of a warpgroup skipped)."""
    from fi_backend import wrappers as W
    kv = "bf16" if kv_dtype == torch.bfloat16 else "fp8_e4m3"
    fp8 = kv != "bf16"
    for m, shape in enumerate(W.prefill_family_shapes(128, kv, variant=V.SLIDING_WINDOW)):
        attn = prefill(16, 4, 128, kv_dtype=kv_dtype, page_size=16, variant=V.SLIDING_WINDOW, tuning=shape)
        run_case(attn, [1200, 17, 3000, 700], [1000, 17, 3, 700], dtype=torch.bfloat16, kv_dtype=kv_dtype,
                 causal=True, k_scale=0.37 if fp8 else 1.0, v_scale=1.9 if fp8 else 1.0,
                 variant_kw={"window_left": 100}, ref_kw={"window_left": 100}, what=f"window member {m} {shape} {kv}")


def test_rope_fp8():
    import fi_backend.reference as ref
    cfg = ref.RopeConfig(theta=500000.0, llama31=ref.Llama31Scaling())
    attn = prefill(32, 8, 128, kv_dtype=torch.float8_e4m3fn, variant=V.ROPE)
    run_case(attn, [9000, 300], [500, 300], dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, causal=True,
             variant_kw={"rope": cfg}, ref_kw={"rope": cfg}, k_scale=0.5, v_scale=1.5, tol=2e-2, what="rope fp8")


@pytest.mark.parametrize("layout,packed,page", [("NHD", True, 16), ("HND", True, 16), ("SGL", False, 1)])
def test_layouts(layout, packed, page):
    attn = prefill(32, 8, 128, page_size=page, kv_layout="HND" if layout == "HND" else "NHD")
    run_case(attn, [2000, 300, 17], [700, 300, 5], dtype=torch.bfloat16, causal=True, layout=layout, packed=packed,
             what=f"layout {layout}")


def test_mixed_prefill_and_decode():
    """What engines send with chunked prefill: many decode rows and a few long queries in one plan."""
    attn = prefill(32, 8, 128, page_size=16)
    q_lens = [1] * 60 + [1000, 3, 17, 512]
    kv_lens = [random.randint(1, 5000) for _ in range(60)] + [3000, 3, 4000, 512]
    run_case(attn, kv_lens, q_lens, dtype=torch.bfloat16, causal=True, what="mixed")


def _ragged_case(attn, q_lens, kv_lens, dtype):
    """K/V of this step contiguous per request ([total, Hkv, D]) as a page-1 BSR."""
    Hkv, D = attn.num_kv_heads, attn.head_dim
    total = sum(kv_lens)
    k = torch.randn(total, Hkv, D, device=DEV).to(dtype)
    v = torch.randn(total, Hkv, D, device=DEV).to(dtype)
    kv_indptr = torch.tensor([0] + list(itertools.accumulate(kv_lens)), dtype=torch.int32, device=DEV)
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    bsr = from_ragged(kv_indptr, qo.to(DEV), num_kv_tokens=total)
    return k, v, bsr, qo


def test_ragged_kv():
    attn = prefill(16, 4, 128, page_size=1)
    q_lens, kv_lens = [1000, 17, 128, 3], [1000, 1017, 128, 3]
    k, v, bsr, qo = _ragged_case(attn, q_lens, kv_lens, torch.bfloat16)
    q = torch.randn(sum(q_lens), 16, 128, device=DEV).to(torch.bfloat16)
    attn.plan(qo, torch.tensor(kv_lens, dtype=torch.int32), bsr, causal=True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], 16), float("nan"), device=DEV)
    attn.run(q, (k.unsqueeze(1), v.unsqueeze(1)), out=out, lse=lse)
    torch.cuda.synchronize()
    o_ref, lse_ref = reference(q, k.unsqueeze(1), v.unsqueeze(1), bsr, causal=True)
    check(out, lse, o_ref, lse_ref, TOL[torch.bfloat16], "ragged")


def test_ragged_plus_paged_prefix_merged():
    """New tokens ragged (causal among themselves) + the cached prefix paged (all visible), merged as
    attention states with ops.merge_state: equal to causal attention over prefix + new tokens."""
    from fi_backend import ops
    from fi_backend import reference as ref
    Hq, Hkv, D, page = 16, 4, 128, 16
    q_lens, prefix = [300, 17, 128], [1000, 40, 0]
    paged = prefill(Hq, Hkv, D, page_size=page)
    ragged = prefill(Hq, Hkv, D, page_size=1)
    bsr_p, qo_cpu, kvp_cpu, nb = make_bsr(prefix, q_lens, page)
    cache, kp, vp = random_kv(nb, page, Hkv, D, torch.bfloat16)
    k_new, v_new, bsr_r, _ = _ragged_case(ragged, q_lens, q_lens, torch.bfloat16)
    q = torch.randn(sum(q_lens), Hq, D, device=DEV).to(torch.bfloat16)
    paged.plan(qo_cpu, kvp_cpu, bsr_p, causal=False)
    ragged.plan(qo_cpu, torch.tensor(q_lens, dtype=torch.int32), bsr_r, causal=True)
    o1, s1 = paged.run(q, cache, return_lse=True)
    o2, s2 = ragged.run(q, (k_new.unsqueeze(1), v_new.unsqueeze(1)), return_lse=True)
    out = torch.full_like(q, float("nan"))
    ops.merge_state(o1, s1, o2, s2, out=out)
    torch.cuda.synchronize()
    # reference: each request's prefix pages followed by its new tokens, causal bottom-right
    qo, starts = qo_cpu.tolist(), bsr_p.kv_block_start.tolist()
    o_ref = torch.zeros(q.shape, dtype=torch.float64, device=DEV)
    koff = 0
    for i, (ql, pl) in enumerate(zip(q_lens, prefix)):
        blocks = bsr_p.kv_indices[starts[i]:starts[i] + (pl + page - 1) // page].long()
        ki = torch.cat([kp[blocks].reshape(-1, Hkv, D)[:pl], k_new[koff:koff + ql]])
        vi = torch.cat([vp[blocks].reshape(-1, Hkv, D)[:pl], v_new[koff:koff + ql]])
        koff += ql
        o_ref[qo[i]:qo[i + 1]], _ = ref.attention(q[qo[i]:qo[i + 1]], ki, vi, causal=True)
    check(out, None, o_ref, None, TOL[torch.bfloat16], "ragged + paged merged")


# The warp-specialised prefill (prefill::Config::kProducer): a producer warpgroup loads, the compute
# warpgroups consume tiles through mbarriers at their own pace. Forced by tuning (PREFILL_WS_TUNINGS):
# member 0's 12 x 1 shape with any variant, its 8 x 2 shape whatever the heads per chunk.
_WS = {128: PREFILL_WS_TUNINGS["w12"]}
_WS8 = {"w8m2": PREFILL_WS_TUNINGS["w8m2"]}


@pytest.mark.parametrize("D,group,shape", [(128, 1, None), (128, 4, None), (128, 8, None), (128, 1, "w8m2")])
def test_warp_specialised(D, group, shape):
    """Every query length and KV kind of the matrix (long KV: split chunks, merged by the compute warps'
    own barrier), paged and page 1, and a non-causal batch."""
    Hkv = 2
    tuning = _WS8[shape] if shape else _WS[D]
    for page in (1, 16):
        k = _PAGES.index(page) + _DIMS.index(D) + _GROUPS.index(group)
        q_lens, kv_lens = _batch(k)
        dtype = (torch.bfloat16, torch.float16)[k % 2]
        attn = prefill(Hkv * group, Hkv, D, q_dtype=dtype, page_size=page, tuning=tuning)
        run_case(attn, kv_lens, q_lens, dtype=dtype, causal=True,
                 what=f"warp-specialised page={page} D={D} group={group} q={q_lens} kv={kv_lens}")
    run_case(attn, [16000, 1500, 128], [1000, 200, 128], dtype=dtype, causal=False, what="warp-specialised non-causal")


_WS_VARIANTS = [n for n in _VARIANT_NAMES if not n.startswith("rope")]


@pytest.mark.parametrize("name", _WS_VARIANTS)
def test_warp_specialised_variants(name):
    Hq, Hkv, D = 16, 4, 128
    tuning = _WS[D]
    attn = prefill(Hq, Hkv, D, page_size=16, variant=_variant_case(name, Hq)[1], tuning=tuning)
    run_variant_case(attn, name, [1500, 3, 1017, 4000, 300], [1, 3, 17, 128, 300], torch.bfloat16)


# The softmax's row sums by warpgroup MMAs (prefill::Config::kRowSumMma: P . ones beside each P.V), with masks
# (a fully masked custom-mask row comes out as no row), GQA, the split chunks of long KV (the sums leave as
# partial LSEs), a variant without a softmax, and both 16-bit types.
@pytest.mark.parametrize("rowsum", [1])
@pytest.mark.parametrize("name,group,shape", [("default", 1, None), ("default", 4, None), ("window", 4, None),
                                              ("alibi", 4, None), ("soft_cap", 1, None), ("custom_mask", 4, None),
                                              ("sigmoid", 4, None)])
def test_row_sums(name, group, shape, rowsum):
    Hkv = 4
    variant = _variant_case(name, Hkv * group)[1]
    tuning = _WS8[shape] if shape else None
    for dtype in (torch.bfloat16, torch.float16) if name == "default" and group == 4 and not shape else (torch.bfloat16,):
        for page in (1, 16):
            attn = prefill(Hkv * group, Hkv, 128, q_dtype=dtype, page_size=page, variant=variant, tuning=tuning)
            run_variant_case(attn, name, [1500, 3, 1017, 4000, 300, 16000], [1, 3, 17, 128, 300, 1000], dtype)


# ALiBi by the tensor cores (the default where it can run; prefill::Config::kBiasMma: slope / scale against
# column indices as one more k step of Q.K^T, the rest a per-row offset): heads per chunk 1, 2, 4, 8 (a row block's
# heads), causal and not (positive distances), the reference's slopes and random ones of both signs, another
# sm_scale, long KV (a row's bias spans thousands), both 16-bit types.
@pytest.mark.parametrize("bias", [1])
@pytest.mark.parametrize("group,shape", [(1, None), (2, None), (4, None), (8, None)])
def test_alibi_bias_mma(group, shape, bias):
    Hkv = 2
    Hq = Hkv * group
    tuning = _WS8[shape] if shape else None
    from fi_backend import reference as ref
    from fi_backend import wrappers as W
    assert W.prefill_spec(V.ALIBI, 128, "bf16", "bf16", group, tuning=tuning).params["CONFIG"].endswith(
        "true" if bias else "false")
    g = torch.Generator().manual_seed(group * 10 + bias)
    # (within +-1/8: with positive distances up to 16000 a larger slope puts the LSE in the thousands, where
    # fp32's own rounding of it passes the 1e-3 tolerance, with or without the bias MMA)
    random_slopes = (torch.rand(Hq, generator=g, dtype=torch.float64) * 2 - 1) / 8
    for dtype in (torch.bfloat16, torch.float16):
        attn = prefill(Hq, Hkv, 128, q_dtype=dtype, page_size=16, variant=V.ALIBI, tuning=tuning)
        for causal, slopes, scale in ((True, ref.alibi_slopes(Hq), None), (False, random_slopes, 0.3)):
            kw = {"alibi_slopes": slopes.float().to(DEV)} | ({"sm_scale": scale} if scale else {})
            rkw = {"alibi_slopes": slopes.float().double()} | ({"sm_scale": scale} if scale else {})
            run_case(attn, [1500, 3, 1017, 16000, 300], [1, 3, 17, 1000, 300], dtype=dtype, causal=causal,
                     variant_kw=kw, ref_kw=rkw, what=f"alibi bias={bias} group={group} causal={causal} {dtype}")
    bsr, qo, kv, _ = make_bsr([10], [10], 16)
    with pytest.raises(ValueError, match="sm_scale must be finite and nonzero with ALiBi"):
        attn.plan(qo, kv, bsr, causal=True, sm_scale=0.0, alibi_slopes=ref.alibi_slopes(Hq).float().to(DEV))


# Plans by request (fi_backend.wrappers: prefill steps of 2+ requests with PLAN_GROUPED_MIN_KV+ KV tokens,
# not for a mask that is the KV range, FI_BACKEND_PLAN_GROUPED=0 off): queues in assignment order, so some
# CTA runs a larger tile of a request before a smaller one; LPT's queues are in creation order. The output
# is checked either way.
@pytest.mark.parametrize("name,kv_lens,env_off,grouped", [("default", [5000, 4500, 300], False, True),
                                                          ("default", [5000, 4500, 300], True, False),
                                                          ("default", [3000, 2000], False, False),
                                                          ("default", [6000], False, False),
                                                          ("window", [5000, 4500, 300], False, False),
                                                          ("alibi", [5000, 4500, 300], False, True)])
def test_plan_order(monkeypatch, name, kv_lens, env_off, grouped):
    from fi_backend import wrappers as W
    if env_off:
        monkeypatch.setenv("FI_BACKEND_PLAN_GROUPED", "0")
    assert W.PLAN_GROUPED_MIN_KV == 4096
    Hq, Hkv = 16, 4
    attn = prefill(Hq, Hkv, 128, page_size=16, variant=_variant_case(name, Hq)[1], max_tokens=16384)
    run_variant_case(attn, name, kv_lens, kv_lens, torch.bfloat16)
    d = attn.workspace.host_plan()
    in_creation_order = all(
        np.all(np.diff(d.items["request"][a:b].astype(np.int64) * 2**31 + d.items["q_begin"][a:b]) >= 0)
        for a, b in zip(d.cta_indptr[:-1], d.cta_indptr[1:]))
    assert in_creation_order != grouped


# KV by TMA (Loader::produce, shared.cuh): the producer copies a whole tile of consecutive tokens of a
# token-major cache (ragged KV; pages that happen to be in order) as boxes and gathers every other tile
# (partial, scattered pages). Every slot no request reads holds NaN (run_case(poison=True)): a box that
# reached past a request's tokens would put NaN into P.V. Each case asserts that the kernel got the maps
# (which tiles go by TMA is decided on the GPU); the cases with pages in random order check the gather
# beside them, and those with runs of pages in order ("runs") a request whose tiles go both ways (a sub-item
# stops voting for boxes at its first gathered tile).
_TMA_CASES = [(128, 4, 1, "NHD", False, "w8m2", True), (128, 1, 1, "SGL", False, "w8m2", True),
              (128, 8, 16, "NHD", False, None, True), (128, 4, 16, "NHD", True, "w8m2", False),
              (128, 1, 1, "NHD", False, "w8m2", "runs"), (128, 4, 16, "NHD", True, None, "runs")]


# FlashAttention-3's consumer loop (tuning fa3=1, prefill::Config::kOverlap; fa3=2 with its consumer warpgroups'
# ping-pong, kPingPong, as PREFILL_FA3_TUNINGS): two consumer warpgroups, 128-token tiles, P.V of tile j - 1
# deferred behind S of tile j. Causal and non-causal, paged at
# page 1 (pages in order: TMA boxes) and 16 (random order: gathers), ragged KV, GQA groups 1 / 4 / 7, odd
# lengths (partial last tiles, units with no rows), split chunks; outputs poisoned.
_FA3_CASES = [(128, 1, 1, True), (128, 4, 16, False), (128, 7, 16, False), (128, 4, 1, "runs"), (64, 4, 16, False),
              (64, 1, 1, True)]


@pytest.mark.parametrize("D,group,page,consecutive", _FA3_CASES)
def test_fa3_member(D, group, page, consecutive):
    Hkv = 2
    k = _FA3_CASES.index((D, group, page, consecutive))
    dtype = (torch.bfloat16, torch.float16)[k % 2]
    attn = prefill(Hkv * group, Hkv, D, q_dtype=dtype, page_size=page, tuning=PREFILL_FA3_TUNINGS[D])
    _fa3_cases(attn, dtype, consecutive, f"fa3 D={D} group={group} page={page} consecutive={consecutive}")


# Head sizes 80 and 96 (Phi-3's): P.V as a 64-column MMA and a 16- or 32-column one, the pad columns never read.
@pytest.mark.parametrize("D,group,page,consecutive", [(96, 1, 16, False), (96, 4, 1, True), (80, 4, 16, False)])
def test_fa3_member_head_sizes_80_96(D, group, page, consecutive):
    Hkv = 2
    attn = prefill(Hkv * group, Hkv, D, page_size=page, tuning=PREFILL_FA3_TUNINGS[D])
    _fa3_cases(attn, torch.bfloat16, consecutive, f"fa3 D={D} group={group} page={page} consecutive={consecutive}")


# Head size 64 with one query buffer, as at 128 (where two do not fit): each compute warp releases it to the
# producer after its last QK^T of a sub-item (units without rows at once, causal units that stop early before
# the sub-item's last tile), and the producer copies the next sub-item's query tile into it.
@pytest.mark.parametrize("group,page,consecutive", [(4, 16, False), (1, 1, True)])
def test_fa3_member_one_q_buffer(group, page, consecutive):
    Hkv, D = 2, 64
    attn = prefill(Hkv * group, Hkv, D, page_size=page, tuning={**PREFILL_FA3_TUNINGS[D], "q_buffers": 1})
    _fa3_cases(attn, torch.bfloat16, consecutive, f"fa3 one query buffer D={D} group={group} page={page}")


# Without the ping-pong (fa3=1).
@pytest.mark.parametrize("D,group,page,consecutive", [(128, 4, 16, False), (64, 1, 1, True)])
def test_fa3_member_no_pingpong(D, group, page, consecutive):
    Hkv = 2
    attn = prefill(Hkv * group, Hkv, D, page_size=page, tuning={**PREFILL_FA3_TUNINGS[D], "fa3": 1})
    _fa3_cases(attn, torch.bfloat16, consecutive, f"fa3=1 D={D} group={group} page={page} consecutive={consecutive}")


def _fa3_cases(attn, dtype, consecutive, what):
    for q_lens, kv_lens in (([1000, 17, 128, 3, 300, 129], [1000, 1017, 128, 3, 16000, 255]),
                            ([1, 127, 129, 255], [4097, 127, 129, 511])):
        run_case(attn, kv_lens, q_lens, dtype=dtype, causal=True, consecutive=consecutive, poison=True,
                 what=f"{what} causal q={q_lens} kv={kv_lens}")
    run_case(attn, [16000, 1500, 129, 7], [1000, 200, 129, 7], dtype=dtype, causal=False, consecutive=consecutive,
             poison=True, what=f"{what} non-causal")


@pytest.mark.parametrize("group", [1, 4])
def test_fa3_member_ragged(group):
    Hkv, D = 2, 128
    Hq = Hkv * group
    attn = prefill(Hq, Hkv, D, page_size=1, tuning=PREFILL_FA3_TUNINGS[D])
    q_lens, kv_lens = [1000, 17, 128, 3, 129], [1000, 1017, 128, 3, 4001]
    for causal in (True, False):
        k, v, bsr, qo = _ragged_case(attn, q_lens, kv_lens, torch.bfloat16)
        q = torch.randn(sum(q_lens), Hq, D, device=DEV).to(torch.bfloat16)
        attn.plan(qo, torch.tensor(kv_lens, dtype=torch.int32), bsr, causal=causal)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], Hq), float("nan"), device=DEV)
        attn.run(q, (k.unsqueeze(1), v.unsqueeze(1)), out=out, lse=lse)
        torch.cuda.synchronize()
        o_ref, lse_ref = reference(q, k.unsqueeze(1), v.unsqueeze(1), bsr, causal=causal)
        check(out, lse, o_ref, lse_ref, TOL[torch.bfloat16], f"fa3 ragged group={group} causal={causal}")


@pytest.mark.parametrize("D,group,page,layout,packed,shape,consecutive", _TMA_CASES)
def test_kv_tma(D, group, page, layout, packed, shape, consecutive):
    Hkv = 2
    dtype = (torch.bfloat16, torch.float16)[_TMA_CASES.index((D, group, page, layout, packed, shape, consecutive)) % 2]
    tuning = _WS8[shape] if shape else _WS[D]
    attn = prefill(Hkv * group, Hkv, D, q_dtype=dtype, page_size=page, tuning=tuning)
    q_lens, kv_lens = [1000, 17, 128, 3, 300], [1000, 1017, 128, 3, 16000]
    what = f"TMA D={D} group={group} page={page} {layout} packed={packed} {shape} consecutive={consecutive}"
    run_case(attn, kv_lens, q_lens, dtype=dtype, causal=True, layout=layout, packed=packed, consecutive=consecutive,
             poison=True, what=what)
    assert attn._kv_maps() == _MAPS, f"{what}: KV TMA maps {attn._kv_maps()} for a token-major cache"
    run_case(attn, [16000, 1500, 128], [1000, 200, 128], dtype=dtype, causal=False, layout=layout, packed=packed,
             consecutive=consecutive, poison=True, what=f"{what} non-causal")


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", ["default", "soft_cap", "window", "alibi", "sigmoid", "custom_mask", "alibi_window"])
def test_kv_tma_variants(name, page):
    """Windows start tiles anywhere."""
    Hq, Hkv, D = 16, 4, 128
    attn = prefill(Hq, Hkv, D, page_size=page, variant=_variant_case(name, Hq)[1], tuning=_WS[D])
    run_variant_case(attn, name, [1500, 3, 1017, 4000, 300], [1, 3, 17, 128, 300], torch.bfloat16,
                     consecutive=page == 1, poison=True)
    assert attn._kv_maps() == _MAPS


def test_kv_tma_not_for_hnd():
    """HND pages are not token-major: no maps, every tile gathered (and correct)."""
    attn = prefill(8, 2, 128, page_size=16, kv_layout="HND", tuning=_WS[128])
    run_case(attn, [2000, 300, 17], [700, 300, 5], dtype=torch.bfloat16, causal=True, layout="HND", packed=True,
             consecutive=True, poison=True, what="HND gathered")
    assert not attn._kv_maps()


@pytest.mark.parametrize("tuning,consecutive", [(None, False), (_WS[128], False), (_WS8["w8m2"], True)],
                         ids=["default", "warp_specialised", "tma"])
def test_cuda_graph_replay_after_replan(tuning, consecutive):
    """Capture once, re-plan with other lengths and a smaller batch in the same BSR tensors, replay. tma:
    pages in order (from a random start each step), so the replayed kernel copies most tiles by TMA."""
    Hq, Hkv, D, page = 16, 4, 128, 16
    attn = prefill(Hq, Hkv, D, page_size=page, max_tokens=2048, max_requests=16, tuning=tuning)
    batch = PersistentBatch(8, 200, page, consecutive=consecutive)
    cache, k, v = random_kv(batch.num_blocks, page, Hkv, D, torch.bfloat16)
    rows = 1500
    q_buf = torch.zeros(rows, Hq, D, dtype=torch.bfloat16, device=DEV)
    out_buf = torch.zeros_like(q_buf)

    def step(B):
        q_lens = [random.randint(1, 200) for _ in range(B - 1)]
        q_lens.append(rows - sum(q_lens))
        kv_lens = [ql + random.randint(0, 1500) for ql in q_lens]
        bsr, qo, kv_cpu = batch.write(q_lens, kv_lens)
        attn.plan(qo, kv_cpu, bsr, causal=True)
        return bsr

    step(8)
    q_buf.normal_()
    attn.run(q_buf, cache, out=out_buf)
    torch.cuda.synchronize()
    assert attn._kv_maps() == _MAPS or not consecutive
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf, cache, out=out_buf)
    for B in (8, 3):
        replay_check(graph, attn, q_buf, out_buf, k, v, step(B), TOL[torch.bfloat16], f"prefill graph replay B={B}")
    attn.release_graph()


def test_tile_family_picks_per_step():
    """One wrapper: a short prefill plans the small query tile, a long batch the large one (both against
    the reference); once run() is captured in a graph, a long step keeps the captured (small) tile."""
    Hq, Hkv, D, page = 32, 8, 128, 16
    attn = prefill(Hq, Hkv, D, page_size=page, max_tokens=6000, max_requests=8)
    picked = {}
    for q_lens in ([300], [1291] * 4, [200, 5]):
        run_case(attn, [q + 100 for q in q_lens], q_lens, dtype=torch.bfloat16, causal=True, what=f"family q={q_lens}")
        picked[len(q_lens)] = attn.rows_per_tile
    assert picked[1] < picked[4] and picked[2] == picked[1], f"tile rows per step: {picked}"

    batch = PersistentBatch(4, 96, page)
    cache, k, v = random_kv(batch.num_blocks, page, Hkv, D, torch.bfloat16)
    q_buf = torch.zeros(4 * 1291, Hq, D, dtype=torch.bfloat16, device=DEV)
    out_buf = torch.zeros_like(q_buf)
    bsr, qo, kv_cpu = batch.write([300, 1, 1, 1], [400, 50, 60, 70])
    attn.plan(qo, kv_cpu, bsr, causal=True)
    small = attn.rows_per_tile
    attn.run(q_buf[:303], cache, out=out_buf[:303])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf[:303], cache, out=out_buf[:303])
    q_lens = [1291] * 4
    bsr, qo, kv_cpu = batch.write(q_lens, [1391] * 4)
    attn.plan(qo, kv_cpu, bsr, causal=True)
    assert attn.rows_per_tile == small, "a captured graph must keep its kernel's tile"
    attn.release_graph()
    graph2 = torch.cuda.CUDAGraph()
    q_buf.normal_()
    out_buf.fill_(float("nan"))
    with torch.cuda.graph(graph2):
        attn.run(q_buf, cache, out=out_buf)
    graph2.replay()
    torch.cuda.synchronize()
    attn.check_errors()
    o_ref, _ = reference(q_buf, k, v, bsr, causal=True)
    check(out_buf, None, o_ref, None, TOL[torch.bfloat16], "long step planned after a small-tile capture")
    attn.release_graph()


@pytest.mark.parametrize("tuning", [None, "w8m2", "mma_sync"])
def test_growing_logits(tuning):
    """Keys whose scale grows along each request (x1 at its first token to x8 at its last): row maxima jump
    by more than the softmax's rescale threshold (2^8, prefill.cuh kRescaleLog2) at some steps and stay
    within it at others, so O is rescaled on some steps and exponents taken against a stale maximum on
    the rest (with unit-scale keys only a row's first step moves its maximum that far)."""
    if tuning == "mma_sync":
        from fi_backend.wrappers import prefill_family_shapes
        tuning = prefill_family_shapes(128, "bf16", wgmma=False)[0]
    elif tuning is not None:
        tuning = _WS8[tuning]
    Hq, Hkv, D, page = 8, 2, 128, 16
    q_lens, kv_lens = [1000, 17, 128, 1], [16000, 1017, 128, 3000]
    attn = prefill(Hq, Hkv, D, page_size=page, tuning=tuning)
    bsr, qo_cpu, kv_cpu, nb = make_bsr(kv_lens, q_lens, page)
    cache, k, v = random_kv(nb, page, Hkv, D, torch.bfloat16)
    starts = bsr.kv_block_start.tolist()
    for i, n in enumerate(kv_lens):
        blocks = bsr.kv_indices[starts[i]:starts[i] + (n + page - 1) // page].long()
        ramp = 1 + 7 * torch.arange(len(blocks) * page, device=DEV, dtype=torch.float32) / n
        k[blocks] = (k[blocks].float() * ramp.view(len(blocks), page, 1, 1)).to(k.dtype)  # in place: k is the cache
    rows = int(qo_cpu[-1])
    q = torch.randn(rows, Hq, D, device=DEV).to(torch.bfloat16)
    attn.plan(qo_cpu, kv_cpu, bsr, causal=True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((rows, Hq), float("nan"), device=DEV)
    attn.run(q, cache, out=out, lse=lse)
    torch.cuda.synchronize()
    attn.check_errors()
    o_ref, lse_ref = reference(q, k, v, bsr, causal=True)
    check(out, lse, o_ref, lse_ref, TOL[torch.bfloat16], f"growing logits, tuning {tuning}")


@pytest.mark.parametrize("D", [64, 128, 256])
def test_mma_sync_family(D):
    """The mma.sync family, which every GPU but Hopper runs, checked on the H100 too (Hopper's default is the
    warpgroup-MMA family): each member against the reference; fp8 KV and RoPE (the converted-tile path) at
    D 128."""
    from fi_backend.wrappers import prefill_family_shapes
    q_lens, kv_lens = _batch(D // 64)
    for shape in prefill_family_shapes(D, "bf16", wgmma=False):
        attn = prefill(8, 2, D, page_size=16, tuning=shape)
        run_case(attn, kv_lens, q_lens, dtype=torch.bfloat16, causal=True, what=f"mma.sync {shape} D={D}")
    if D == 128:
        shape = prefill_family_shapes(D, "fp8_e4m3", wgmma=False)[0]
        attn = prefill(8, 2, D, kv_dtype=torch.float8_e4m3fn, page_size=16, tuning=shape)
        run_case(attn, [1200, 17, 3000], [1000, 17, 3], dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                 causal=True, k_scale=0.37, v_scale=1.9, what=f"mma.sync {shape} fp8")
        attn = prefill(8, 2, D, page_size=16, variant=V.ROPE, tuning=prefill_family_shapes(D, "bf16", wgmma=False)[0])
        run_variant_case(attn, "rope_llama31", [1000, 17, 300], [1000, 3, 128], torch.bfloat16)


def test_workspace_tile_too_small():
    from fi_backend.workspace import Workspace
    from fi_backend.wrappers import BatchAttention
    ws = Workspace(DEV, max_requests=8, max_tokens=64, num_ctas=4, max_tile_q=16, num_qo_heads=8, num_kv_heads=8,
                   head_dim=128)
    with pytest.raises(ValueError, match="max_tile_q"):
        BatchAttention(ws, 8, 8, 128, kernel="prefill")
    with pytest.raises(ValueError, match="kernel must be one of"):
        BatchAttention(ws, 8, 8, 128, kernel="flash")


def test_user_variant_flash_sigmoid():
    """A variant of the user's own, as a CUDA string with two parameters, JIT-built for the prefill kernel
    and checked against the reference's sigmoid attention (sigmoid(q.k * sm_scale + bias))."""
    flash_sigmoid = V.Variant(
        "user_flash_sigmoid", use_softmax=False, params={"scale": "float", "bias": "float"},
        logits_transform="return 1.f / (1.f + __expf(-(logits * params.scale + params.bias)));")
    attn = prefill(16, 4, 128, page_size=16, variant=flash_sigmoid)
    run_case(attn, [1200, 300, 17], [1000, 300, 3], dtype=torch.bfloat16, causal=True,
             variant_kw={"scale": 1.0, "bias": -1.25}, ref_kw={"use_sigmoid": True, "sigmoid_bias": -1.25},
             what="user variant flash_sigmoid")


def test_alternating_layer_caches():
    """One wrapper, one plan, several layers' caches in turn (as an engine's layers call run()): each
    run reads its own cache (the wrapper remembers parses per cache object)."""
    attn = prefill(16, 4, 128, page_size=16)
    bsr, qo, kl, nb = make_bsr([700, 300, 5], [300, 300, 5], 16)
    caches = [random_kv(nb, 16, 4, 128, torch.bfloat16, packed=True) for _ in range(3)]
    q = torch.randn(int(qo[-1]), 16, 128, device=DEV).to(torch.bfloat16)
    attn.plan(qo, kl, bsr, causal=True)
    for rnd in range(2):
        for i, (cache, k, v) in enumerate(caches):
            out = torch.full_like(q, float("nan"))
            attn.run(q, cache, out=out)
            torch.cuda.synchronize()
            o_ref, _ = reference(q, k, v, bsr, causal=True)
            check(out, None, o_ref, None, TOL[torch.bfloat16], f"layer cache {i} round {rnd}")
