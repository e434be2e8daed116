"""Tests of the reference semantics (fi_backend/reference.py).

The reference is checked against a naive implementation written here differently (a loop over heads and
query rows, scalar-built masks, complex-number RoPE), and through invariances that tie its pieces
together: splitting the KV and merging attention states, composable BSR formats, positions shifts.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from fi_backend import reference as ref
from fi_backend.formats import BSR

F64 = torch.float64


def gen(*seed) -> torch.Generator:
    """A generator seeded from the test's parameters (crc32: stable across runs, unlike hash())."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(seed).encode()))
    return g


def randn(g, *shape, dtype=F64):
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def assert_close(a, b, rtol=1e-10, atol=1e-10):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=False)


# ------------------------------------------------------------------------------ naive implementation


def naive_attention(q, k, v, q_pos, kv_pos, *, sm_scale=None, causal=False, window_left=-1,
                    logits_soft_cap=0.0, alibi_slopes=None, mask=None, use_sigmoid=False, sigmoid_bias=0.0):
    """Loops over heads and query rows; the allowed set is built entry by entry in Python."""
    Lq, Hq, D = q.shape
    Lkv, Hkv, Dv = v.shape
    group = Hq // Hkv
    scale = D ** -0.5 if sm_scale is None else sm_scale
    qp, kp = [int(x) for x in q_pos], [int(x) for x in kv_pos]
    allowed = [
        [
            (not causal or kp[j] <= qp[i])
            and (window_left < 0 or kp[j] >= qp[i] - window_left)
            and (mask is None or bool(mask[i, j]))
            for j in range(Lkv)
        ]
        for i in range(Lq)
    ]
    o = torch.zeros(Lq, Hq, Dv, dtype=F64)
    lse = torch.full((Lq, Hq), -math.inf, dtype=F64)
    for h in range(Hq):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        s = (q[:, h].double() @ kh.T) * scale
        if logits_soft_cap > 0:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        for i in range(Lq):
            row = s[i].clone()
            if alibi_slopes is not None:
                row = row + float(alibi_slopes[h]) * torch.tensor([kp[j] - qp[i] for j in range(Lkv)], dtype=F64)
            sel = torch.tensor(allowed[i], dtype=torch.bool) if Lkv else torch.zeros(0, dtype=torch.bool)
            if use_sigmoid:
                o[i, h] = (torch.sigmoid(row[sel] + sigmoid_bias)[:, None] * vh[sel]).sum(0)
                continue
            if not sel.any():
                continue
            x = row[sel]
            mx = x.max()
            e = torch.exp(x - mx)
            lse[i, h] = mx + torch.log(e.sum())
            o[i, h] = (e / e.sum()) @ vh[sel]
    return o, (None if use_sigmoid else lse)


VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window_left": 5},
    "window_only": {"window_left": 3},
    "softcap": {"logits_soft_cap": 2.5, "sm_scale": 0.7},
    "alibi": {"causal": True, "alibi": True},
    "mask": {"mask": True},
    "sigmoid": {"use_sigmoid": True, "sigmoid_bias": -1.5, "causal": True},
    "all": {"causal": True, "window_left": 9, "logits_soft_cap": 1.5, "alibi": True, "mask": True},
}


def make_variant(name, g, Lq, Lkv, Hq):
    kw = dict(VARIANTS[name])
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = ref.alibi_slopes(Hq) * (1 + torch.rand(Hq, generator=g, dtype=F64))
    if kw.pop("mask", False):
        kw["mask"] = torch.rand(Lq, Lkv, generator=g) < 0.6
    return kw


# -------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("Lq,Lkv", [(1, 37), (11, 40), (24, 24)])
def test_attention_matches_naive(variant, group, Lq, Lkv):
    g = gen("naive", variant, group, Lq, Lkv)
    Hkv, D = 2, 16
    Hq = Hkv * group
    q, k, v = randn(g, Lq, Hq, D), randn(g, Lkv, Hkv, D), randn(g, Lkv, Hkv, D)
    kw = make_variant(variant, g, Lq, Lkv, Hq)
    o, lse = ref.attention(q, k, v, **kw)
    q_pos = torch.arange(Lkv - Lq, Lkv)  # bottom-right aligned default
    o_n, lse_n = naive_attention(q, k, v, q_pos, torch.arange(Lkv), **kw)
    assert o.dtype == F64 and o.shape == (Lq, Hq, D)
    assert_close(o, o_n)
    if kw.get("use_sigmoid"):
        assert lse is None
    else:
        assert lse.shape == (Lq, Hq)
        assert_close(lse, lse_n)


@pytest.mark.parametrize("seed", range(3))
def test_attention_explicit_positions_and_dtypes(seed):
    g = gen("pos", seed)
    Lq, Lkv, Hq, Hkv, D, Dv = 6, 30, 4, 1, 32, 8  # MQA, and a value head_dim unlike the key's
    q = randn(g, Lq, Hq, D, dtype=torch.bfloat16)
    k, v = randn(g, Lkv, Hkv, D, dtype=torch.float16), randn(g, Lkv, Hkv, Dv)
    kv_pos = 100 + torch.randperm(Lkv, generator=g)
    q_pos = torch.randint(90, 140, (Lq,), generator=g)
    kw = dict(causal=True, window_left=11, alibi_slopes=ref.alibi_slopes(Hq))
    o, lse = ref.attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, **kw)
    o_n, lse_n = naive_attention(q, k, v, q_pos, kv_pos, **kw)
    assert o.shape == (Lq, Hq, Dv)
    assert_close(o, o_n)
    assert_close(lse, lse_n)


def test_attention_rope_equals_pre_rotated_inputs():
    g = gen("rope-attn")
    Lq, Lkv, Hq, Hkv, D = 5, 21, 8, 2, 32
    q, k, v = randn(g, Lq, Hq, D), randn(g, Lkv, Hkv, D), randn(g, Lkv, Hkv, D)
    rope = ref.RopeConfig(theta=500000.0, llama31=ref.Llama31Scaling())
    q_pos, kv_pos = torch.arange(Lkv - Lq, Lkv), torch.arange(Lkv)
    o, lse = ref.attention(q, k, v, rope=rope, causal=True)
    qr, kr = complex_rope(q, q_pos, rope), complex_rope(k, kv_pos, rope)
    o_n, lse_n = naive_attention(qr, kr, v, q_pos, kv_pos, causal=True)
    assert_close(o, o_n)
    assert_close(lse, lse_n)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    g = gen("empty")
    Lq, Lkv, H, D = 6, 10, 4, 8
    q, k, v = randn(g, Lq, H, D), randn(g, Lkv, H, D), randn(g, Lkv, H, D)
    mask = torch.rand(Lq, Lkv, generator=g) < 0.5
    mask[1] = False
    mask[4] = False
    mask[0, 0] = True
    o, lse = ref.attention(q, k, v, mask=mask, logits_soft_cap=3.0, alibi_slopes=ref.alibi_slopes(H))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    for r in (1, 4):
        assert torch.equal(o[r], torch.zeros_like(o[r]))
        assert torch.all(lse[r] == -math.inf)
    assert torch.isfinite(lse[0]).all()
    # Causal with every query position before every key, and an empty KV.
    before = torch.zeros(Lq, dtype=torch.long)
    o, lse = ref.attention(q, k, v, q_pos=before, kv_pos=torch.arange(1, Lkv + 1), causal=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.all(lse == -math.inf)
    o, lse = ref.attention(q, k[:0], v[:0])
    assert o.shape == (Lq, H, D) and torch.equal(o, torch.zeros_like(o)) and torch.all(lse == -math.inf)


def test_argument_errors():
    q, k = torch.zeros(2, 6, 8), torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match="num_qo_heads.*num_kv_heads"):
        ref.attention(q, k, k)
    q = torch.zeros(2, 8, 8)
    with pytest.raises(ValueError, match="mask"):
        ref.attention(q, k, k, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="alibi_slopes"):
        ref.attention(q, k, k, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="q_pos"):
        ref.attention(q, k, k, q_pos=torch.arange(3))
    with pytest.raises(ValueError, match="head_dim"):
        ref.apply_rope(torch.zeros(2, 1, 7), torch.arange(2), ref.RopeConfig())
    with pytest.raises(ValueError, match="mask"):
        ref.batch_attention(q, torch.tensor([0, 2]), k, k, torch.tensor([0, 3]),
                            mask=torch.ones(2, 3, dtype=torch.bool))


# ------------------------------------------------------------------------------------ merge


def test_merge_state_matches_formula_and_edge_cases():
    g = gen("merge")
    N, H, D = 50, 3, 8
    o_a, o_b = randn(g, N, H, D), randn(g, N, H, D)
    lse_a, lse_b = 5 * randn(g, N, H), 5 * randn(g, N, H)
    o, lse = ref.merge_state(o_a, lse_a, o_b, lse_b)
    ea, eb = torch.exp(lse_a), torch.exp(lse_b)
    assert_close(lse, torch.log(ea + eb))
    assert_close(o, (ea[..., None] * o_a + eb[..., None] * o_b) / (ea + eb)[..., None])
    # Commutative and associative.
    o_c, lse_c = randn(g, N, H, D), 5 * randn(g, N, H)
    o1, l1 = ref.merge_state(*ref.merge_state(o_a, lse_a, o_b, lse_b), o_c, lse_c)
    o2, l2 = ref.merge_state(o_c, lse_c, *ref.merge_state(o_b, lse_b, o_a, lse_a))
    assert_close(o1, o2)
    assert_close(l1, l2)
    # -inf on one side returns the other exactly, even when the empty side's o is poisoned.
    lse_a[:10] = -math.inf
    o_a[:10] = math.nan
    lse_b[10:15] = -math.inf
    o_b[10:15] = math.inf
    lse_a[15:20] = -math.inf
    lse_b[15:20] = -math.inf
    o_a[15:20] = math.nan
    o, lse = ref.merge_state(o_a, lse_a, o_b, lse_b)
    assert torch.equal(o[:10], o_b[:10]) and torch.equal(lse[:10], lse_b[:10])
    assert torch.equal(o[10:15], o_a[10:15]) and torch.equal(lse[10:15], lse_a[10:15])
    assert torch.equal(o[15:20], torch.zeros_like(o[15:20])) and torch.all(lse[15:20] == -math.inf)
    assert not torch.isnan(o).any()


@pytest.mark.parametrize("S", [0, 1, 2, 7])
def test_merge_states_equals_folding_merge_state(S):
    g = gen("merge_states", S)
    N, H, D = 20, 2, 4
    o = randn(g, N, S, H, D, dtype=torch.float32)
    lse = 4 * randn(g, N, S, H)
    dead = torch.rand(N, S, H, generator=g) < 0.3
    lse[dead] = -math.inf
    o[dead] = math.nan  # never read
    if S:
        lse[0] = -math.inf  # a row with no live state
    m_o, m_lse = ref.merge_states(o, lse)
    f_o, f_lse = torch.zeros(N, H, D, dtype=F64), torch.full((N, H), -math.inf, dtype=F64)
    for s in range(S):
        f_o, f_lse = ref.merge_state(f_o, f_lse, o[:, s], lse[:, s])
    assert m_o.shape == (N, H, D) and m_lse.shape == (N, H)
    assert not torch.isnan(m_o).any()
    assert_close(m_o, f_o)
    assert_close(m_lse, f_lse)
    if S:
        assert_close(m_lse[1:], torch.logsumexp(lse[1:], dim=1))
        assert torch.all(m_lse[0] == -math.inf) and torch.equal(m_o[0], torch.zeros_like(m_o[0]))


@pytest.mark.parametrize("variant", ["plain", "causal", "window", "softcap", "alibi", "mask", "all"])
@pytest.mark.parametrize("seed", range(3))
def test_split_kv_and_merge_equals_full(variant, seed):
    g = gen("split", variant, seed)
    Lq, Lkv, Hq, Hkv, D = 7, 33, 4, 2, 16
    q, k, v = randn(g, Lq, Hq, D), randn(g, Lkv, Hkv, D), randn(g, Lkv, Hkv, D)
    kw = make_variant(variant, g, Lq, Lkv, Hq)
    kw["rope"] = ref.RopeConfig(interleave=bool(seed % 2))
    mask = kw.pop("mask", None)
    q_pos, kv_pos = torch.arange(Lkv - Lq, Lkv), torch.arange(Lkv)
    o, lse = ref.attention(q, k, v, mask=mask, **kw)
    for c in [0, Lkv, int(torch.randint(1, Lkv, (1,), generator=g))]:
        parts = []
        for sl in (slice(0, c), slice(c, Lkv)):
            parts += ref.attention(q, k[sl], v[sl], q_pos=q_pos, kv_pos=kv_pos[sl],
                                   mask=None if mask is None else mask[:, sl], **kw)
        o_m, lse_m = ref.merge_state(*parts)
        assert_close(o_m, o)
        assert_close(lse_m, lse)


# --------------------------------------------------------------------------------------------- RoPE


def scalar_inv_freq(D, rope):
    """Inverse frequencies one at a time, with the Llama-3.1 rule written out per frequency."""
    out = []
    for i in range(D // 2):
        f = rope.theta ** (-2 * i / D)
        s = rope.llama31
        if s is not None:
            wavelen = 2 * math.pi / f
            if wavelen < s.original_max_position / s.high_freq_factor:
                pass
            elif wavelen > s.original_max_position / s.low_freq_factor:
                f = f / s.factor
            else:
                band = s.high_freq_factor - s.low_freq_factor
                smooth = (s.original_max_position / wavelen - s.low_freq_factor) / band
                f = (1 - smooth) * f / s.factor + smooth * f
        out.append(f)
    return torch.tensor(out, dtype=F64)


def complex_rope(x, pos, rope):
    """RoPE as complex multiplication: pairs (2i, 2i+1) for GPT-J, (i, i + D/2) for NeoX."""
    L, H, D = x.shape
    x = x.double()
    angle = (pos.double() / rope.scale)[:, None] * scalar_inv_freq(D, rope)[None]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]
    if rope.interleave:
        z = torch.view_as_complex(x.reshape(L, H, D // 2, 2).contiguous()) * rot
        return torch.view_as_real(z).reshape(L, H, D)
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * rot
    return torch.cat((z.real, z.imag), dim=-1)


ROPES = [
    ref.RopeConfig(),
    ref.RopeConfig(interleave=True),
    ref.RopeConfig(theta=500000.0, llama31=ref.Llama31Scaling()),
    ref.RopeConfig(theta=1e6, scale=4.0, interleave=True),
]


@pytest.mark.parametrize("rope", ROPES)
def test_rope_matches_complex_rotation_and_preserves_norms(rope):
    g = gen("rope", str(rope))
    L, H, D = 20, 3, 64
    x = randn(g, L, H, D)
    pos = torch.randint(0, 100000, (L,), generator=g)
    y = ref.apply_rope(x, pos, rope)
    assert y.dtype == F64
    assert_close(y, complex_rope(x, pos, rope), rtol=1e-9, atol=1e-9)
    assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(ref.apply_rope(x, torch.zeros(L, dtype=torch.long), rope), x)


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_dot_product_depends_only_on_position_difference(interleave):
    g = gen("rope-rel", interleave)
    rope = ref.RopeConfig(interleave=interleave)
    n, D = 50, 32
    q, k = randn(g, n, 1, D), randn(g, n, 1, D)
    m, p = torch.randint(0, 4000, (n,), generator=g), torch.randint(0, 4000, (n,), generator=g)
    t = torch.randint(-3000, 3000, (n,), generator=g)
    dot = (ref.apply_rope(q, m, rope) * ref.apply_rope(k, p, rope)).sum(-1)
    dot_shift = (ref.apply_rope(q, m + t + 3000, rope) * ref.apply_rope(k, p + t + 3000, rope)).sum(-1)
    assert_close(dot, dot_shift, rtol=1e-8, atol=1e-8)
    # Sanity: it does depend on the difference.
    dot_other = (ref.apply_rope(q, m + 1, rope) * ref.apply_rope(k, p, rope)).sum(-1)
    assert (dot - dot_other).abs().max() > 1e-3


def test_rope_linear_scale_divides_positions():
    g = gen("rope-scale")
    x = randn(g, 9, 2, 16)
    pos = torch.randint(0, 1000, (9,), generator=g)
    assert_close(ref.apply_rope(x, 4 * pos, ref.RopeConfig(scale=4.0)), ref.apply_rope(x, pos, ref.RopeConfig()))


def test_llama31_frequencies_in_each_band():
    s = ref.Llama31Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    rope = ref.RopeConfig(theta=500000.0, llama31=s)
    D = 128
    got = ref.rope_frequencies(D, rope)
    base = ref.rope_frequencies(D, ref.RopeConfig(theta=500000.0))
    assert_close(base, 500000.0 ** (-torch.arange(0, D, 2, dtype=F64) / D))
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4  # short wavelengths: unchanged
    low = wavelen > 8192 / 1   # long wavelengths: divided by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(got[high], base[high])
    assert_close(got[low], base[low] / 8)
    # Medium band: linear blend in 1/wavelength between base/8 (at the low edge) and base (at the high edge).
    blend = (8192 / wavelen[mid] - 1) / 3
    assert torch.all((blend >= 0) & (blend <= 1))
    assert_close(got[mid], base[mid] * (blend + (1 - blend) / 8))
    assert torch.all(got[mid] <= base[mid]) and torch.all(got[mid] >= base[mid] / 8)
    assert_close(got, scalar_inv_freq(D, rope))


def test_alibi_slopes():
    for n in (1, 2, 8, 32):
        s = ref.alibi_slopes(n)
        assert_close(s, torch.tensor([2.0 ** (-8 * (i + 1) / n) for i in range(n)], dtype=F64), rtol=0, atol=0)
    # Not a power of two: the 8-head series, then every other slope of the 16-head series.
    s12 = ref.alibi_slopes(12)
    assert_close(s12[:8], ref.alibi_slopes(8), rtol=0, atol=0)
    assert_close(s12[8:], ref.alibi_slopes(16)[0::2][:4], rtol=0, atol=0)
    assert_close(ref.alibi_slopes(12)[8:], torch.tensor([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5], dtype=F64))


# ------------------------------------------------------------------------------------------- fp8


@pytest.mark.parametrize("seed", range(2))
def test_fp8_kv_dequantised_with_scales(seed):
    g = gen("fp8", seed)
    Lq, Lkv, Hq, Hkv, D = 4, 50, 8, 2, 32
    q, k, v = randn(g, Lq, Hq, D), 3 * randn(g, Lkv, Hkv, D), 0.2 * randn(g, Lkv, Hkv, D)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    k_scale, v_scale = float(k.abs().max()) / fp8_max, float(v.abs().max()) / fp8_max
    k8, v8 = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
    kw = dict(causal=True, logits_soft_cap=10.0)
    o, lse = ref.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale, **kw)
    o_d, lse_d = ref.attention(q, k8.double() * k_scale, v8.double() * v_scale, **kw)
    assert_close(o, o_d)
    assert_close(lse, lse_d)
    # The scales really are applied: the result is near the unquantised one (e4m3 has 3 mantissa bits).
    o_x, _ = ref.attention(q, k, v, **kw)
    assert (o - o_x).abs().max() < 0.1 * v.abs().max()
    o_noscale, _ = ref.attention(q, k8, v8, **kw)
    assert (o_noscale - o_x).abs().max() > 0.5 * v.abs().max()


# --------------------------------------------------------------------------------------- batches


def paged_batch(g, page_size, q_lens, kv_lens, Hkv, D, max_blocks_pad=2):
    """A paged KV cache holding each request's KV on randomly permuted pages, vLLM block-table style."""
    nblk = [-(-n // page_size) for n in kv_lens]
    max_blocks = max(nblk) + max_blocks_pad
    total = sum(nblk)
    num_pages = total + 5  # spare pages hold garbage nobody reads
    perm = torch.randperm(num_pages, generator=g)[:total]
    k_cache, v_cache = randn(g, num_pages, page_size, Hkv, D), randn(g, num_pages, page_size, Hkv, D)
    block_table = torch.full((len(kv_lens), max_blocks), -1, dtype=torch.int32)
    ks, vs, at = [], [], 0
    for i, (n, b) in enumerate(zip(kv_lens, nblk)):
        pages = perm[at : at + b]
        at += b
        block_table[i, :b] = pages.to(torch.int32)
        ks.append(k_cache[pages].reshape(-1, Hkv, D)[:n])
        vs.append(v_cache[pages].reshape(-1, Hkv, D)[:n])
    R = len(kv_lens)
    bsr = BSR(
        qo_indptr=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        kv_indices=block_table.view(-1),
        kv_block_start=torch.arange(R) * max_blocks,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_width=page_size,
        num_kv_blocks=num_pages,
    )
    return k_cache, v_cache, bsr, torch.cat(ks), torch.cat(vs)


def indptr(lens):
    return torch.tensor([0] + [int(x) for x in torch.tensor(lens).cumsum(0)], dtype=torch.int32)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", ["causal", "all_but_mask", "sigmoid"])
def test_attention_bsr_matches_batch_attention(page_size, variant):
    g = gen("bsr", page_size, variant)
    R, Hq, Hkv, D = 5, 4, 2, 16
    kv_lens = [int(x) for x in torch.randint(1, 60, (R,), generator=g)]
    kv_lens[2] = 16  # a full last page
    q_lens = [min(n, int(x)) for n, x in zip(kv_lens, torch.randint(1, 6, (R,), generator=g))]
    k_cache, v_cache, bsr, k, v = paged_batch(g, page_size, q_lens, kv_lens, Hkv, D)
    Nq = sum(q_lens)
    q = randn(g, Nq, Hq, D)
    kw = {
        "causal": dict(causal=True, rope=ref.RopeConfig()),
        "all_but_mask": dict(causal=True, window_left=7, logits_soft_cap=4.0, alibi_slopes=ref.alibi_slopes(Hq),
                             rope=ref.RopeConfig(interleave=True)),
        "sigmoid": dict(use_sigmoid=True, sigmoid_bias=0.3, causal=True),
    }[variant]
    o_b, lse_b = ref.batch_attention(q, indptr(q_lens), k, v, indptr(kv_lens), **kw)
    o, lse = ref.attention_bsr(q, k_cache, v_cache, bsr, **kw)
    assert_close(o, o_b)
    if variant == "sigmoid":
        assert lse is None and lse_b is None
    else:
        assert_close(lse, lse_b)

    # Scattered query rows (qo_rows) and logical positions offset by kv_pos_start give the same states
    # as the ragged batch with explicit positions.
    rows = torch.randperm(Nq + 3, generator=g)[:Nq]  # three query rows no row block covers
    q_big = randn(g, Nq + 3, Hq, D)
    q_big[rows] = q
    pos_start = torch.randint(0, 1000, (R,), generator=g)
    bsr.qo_rows = rows.to(torch.int32)
    bsr.kv_pos_start = pos_start.to(torch.int32)
    o2, lse2 = ref.attention_bsr(q_big, k_cache, v_cache, bsr, **kw)
    kv_pos = torch.cat([p + torch.arange(n) for p, n in zip(pos_start.tolist(), kv_lens)])
    q_pos = torch.cat([p + n - m + torch.arange(m) for p, n, m in zip(pos_start.tolist(), kv_lens, q_lens)])
    o_b2, lse_b2 = ref.batch_attention(q, indptr(q_lens), k, v, indptr(kv_lens), q_pos=q_pos, kv_pos=kv_pos, **kw)
    assert_close(o2[rows], o_b2)
    uncovered = torch.ones(Nq + 3, dtype=torch.bool)
    uncovered[rows] = False
    assert torch.equal(o2[uncovered], torch.zeros_like(o2[uncovered]))
    if variant != "sigmoid":
        assert_close(lse2[rows], lse_b2)
        assert torch.all(lse2[uncovered] == -math.inf)


def test_shared_prefix_composable_formats_merge_to_full_attention():
    """A shared prefix in a Br > 1 BSR matrix plus unique suffixes in a Br = 1 matrix, merged, equals
    attention over each request's whole KV (DESIGN.md idea 2)."""
    g = gen("prefix")
    page, Hq, Hkv, D, P = 4, 4, 1, 16, 10
    suffix_lens, q_lens = [3, 9, 5], [1, 4, 2]
    R = len(suffix_lens)
    k_cache, v_cache, suffix, k_sfx, v_sfx = paged_batch(g, page, q_lens, suffix_lens, Hkv, D)
    # The prefix lives on pages appended to the cache.
    kp, vp = randn(g, P, Hkv, D), randn(g, P, Hkv, D)
    npp = -(-P // page)
    pad = npp * page - P
    k_cache = torch.cat((k_cache, torch.cat((kp, randn(g, pad, Hkv, D))).reshape(npp, page, Hkv, D)))
    v_cache = torch.cat((v_cache, torch.cat((vp, randn(g, pad, Hkv, D))).reshape(npp, page, Hkv, D)))
    first = k_cache.shape[0] - npp
    Nq = sum(q_lens)
    prefix = BSR(qo_indptr=torch.tensor([0, Nq], dtype=torch.int32),
                 kv_indices=torch.arange(first, first + npp, dtype=torch.int32),
                 kv_block_start=torch.zeros(1, dtype=torch.int64),
                 kv_lens=torch.tensor([P], dtype=torch.int32), block_width=page)
    suffix.kv_pos_start = torch.full((R,), P, dtype=torch.int32)
    q_pos = torch.cat([P + n - m + torch.arange(m) for n, m in zip(suffix_lens, q_lens)])
    q = randn(g, Nq, Hq, D)
    kw = dict(causal=True, alibi_slopes=ref.alibi_slopes(Hq), rope=ref.RopeConfig())
    o_p, lse_p = ref.attention_bsr(q, k_cache, v_cache, prefix, q_pos=q_pos, **kw)
    o_s, lse_s = ref.attention_bsr(q, k_cache, v_cache, suffix, q_pos=q_pos, **kw)
    o, lse = ref.merge_state(o_p, lse_p, o_s, lse_s)

    so = indptr(suffix_lens).tolist()
    k_full = torch.cat([torch.cat((kp, k_sfx[so[i] : so[i + 1]])) for i in range(R)])
    v_full = torch.cat([torch.cat((vp, v_sfx[so[i] : so[i + 1]])) for i in range(R)])
    o_b, lse_b = ref.batch_attention(q, indptr(q_lens), k_full, v_full, indptr([P + n for n in suffix_lens]), **kw)
    assert_close(o, o_b)
    assert_close(lse, lse_b)


def test_attention_bsr_rejects_a_row_covered_twice_and_bad_arguments():
    g = gen("bsr-dup")
    k_cache, v_cache, bsr, _, _ = paged_batch(g, 16, [2, 2], [20, 30], 1, 8)
    q = randn(g, 4, 2, 8)
    bsr.qo_rows = torch.tensor([0, 1, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="merge_state"):
        ref.attention_bsr(q, k_cache, v_cache, bsr)
    bsr.qo_rows = None
    with pytest.raises(ValueError, match="mask"):
        ref.attention_bsr(q, k_cache, v_cache, bsr, mask=torch.ones(4, 50, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_width"):
        ref.attention_bsr(q, k_cache.reshape(-1, 8, 1, 8), v_cache.reshape(-1, 8, 1, 8), bsr)


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_cuda_matches_cpu():
    g = gen("cuda")
    dev = torch.device("cuda")
    Lq, Lkv, Hq, Hkv, D = 9, 70, 8, 2, 64
    q, k, v = randn(g, Lq, Hq, D, dtype=torch.bfloat16), randn(g, Lkv, Hkv, D), randn(g, Lkv, Hkv, D)
    k8 = k.to(torch.float8_e4m3fn)
    mask = torch.rand(Lq, Lkv, generator=g) < 0.7
    kw = dict(causal=True, window_left=30, logits_soft_cap=5.0, alibi_slopes=ref.alibi_slopes(Hq),
              rope=ref.RopeConfig(theta=500000.0, llama31=ref.Llama31Scaling()), k_scale=0.5, v_scale=2.0)
    o_c, lse_c = ref.attention(q, k8, v, mask=mask, **kw)
    o_g, lse_g = ref.attention(q.to(dev), k8.to(dev), v.to(dev), mask=mask.to(dev),
                               **{**kw, "alibi_slopes": kw["alibi_slopes"].to(dev)})
    assert o_g.device.type == "cuda" and lse_g.device.type == "cuda"
    assert_close(o_g.cpu(), o_c)
    assert_close(lse_g.cpu(), lse_c)

    k_cache, v_cache, bsr, _, _ = paged_batch(g, 16, [3, 1, 2], [40, 17, 33], Hkv, D)
    qb = randn(g, 6, Hq, D)
    o_c, lse_c = ref.attention_bsr(qb, k_cache, v_cache, bsr, causal=True)
    bsr_g = BSR(**{f: (x.to(dev) if torch.is_tensor(x) else x) for f, x in vars(bsr).items()})
    o_g, lse_g = ref.attention_bsr(qb.to(dev), k_cache.to(dev), v_cache.to(dev), bsr_g, causal=True)
    assert_close(o_g.cpu(), o_c)
    assert_close(lse_g.cpu(), lse_c)

    o, lse = randn(g, 5, 4, Hq, D), randn(g, 5, 4, Hq)
    lse[0, :2] = -math.inf
    m_c = ref.merge_states(o, lse)
    m_g = ref.merge_states(o.to(dev), lse.to(dev))
    assert_close(m_g[0].cpu(), m_c[0])
    assert_close(m_g[1].cpu(), m_c[1])
