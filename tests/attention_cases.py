"""Shared pieces of the attention kernels' GPU tests (test_decode_gpu.py, test_prefill_gpu.py): wrapper
construction, random paged caches and BSRs (vLLM block tables, SGLang token tables), the float64
reference through a BSR, the output check, one end-to-end case, and the variant cases."""
from __future__ import annotations

import itertools
import math
import random

import torch

from fi_backend import reference as ref
from fi_backend import variants as V
from fi_backend.formats import BSR, from_block_table, from_token_table

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DEV = "cuda"


def _lazy():
    from fi_backend.wrappers import BatchAttention
    from fi_backend.workspace import Workspace
    return BatchAttention, Workspace


def make_wrapper(Hq, Hkv, D, *, q_dtype=torch.bfloat16, kv_dtype=None, page_size=16, kv_layout="NHD",
                 variant=V.DEFAULT, max_tokens=1024, max_requests=256, kernel="decode", tuning=None, ragged=False):
    BatchAttention, Workspace = _lazy()
    num_ctas = BatchAttention.recommended_num_ctas(DEV, Hq, Hkv, D, q_dtype=q_dtype, kv_dtype=kv_dtype, variant=variant,
                                                   kernel=kernel, tuning=tuning)
    tile_q = BatchAttention.query_tile_rows(Hq, Hkv, D, q_dtype=q_dtype, kv_dtype=kv_dtype, variant=variant, kernel=kernel,
                                            tuning=tuning)
    ws = Workspace(DEV, max_requests=max_requests, max_tokens=max_tokens, num_ctas=num_ctas, max_tile_q=tile_q,
                   num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    return BatchAttention(ws, Hq, Hkv, D, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=page_size,
                          kv_layout=kv_layout, variant=variant, kernel=kernel, tuning=tuning, ragged=ragged)


def random_kv(num_blocks, page, Hkv, D, dtype, *, layout="NHD", packed=False):
    """A paged cache in one of the layouts, plus NHD views [blocks, page, Hkv, D] of k and v for the
    reference. layout "SGL": 3-D [slots, Hkv, D] pair (page must be 1)."""
    gen_dtype = torch.bfloat16 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    def rnd(*shape):
        return torch.randn(*shape, device=DEV, dtype=torch.float32).to(gen_dtype).to(dtype)
    if layout == "SGL":
        k, v = rnd(num_blocks, Hkv, D), rnd(num_blocks, Hkv, D)
        return (k, v), k.unsqueeze(1), v.unsqueeze(1)
    if packed:
        shape = (num_blocks, page, Hkv, 2 * D) if layout == "NHD" else (num_blocks, Hkv, page, 2 * D)
        kv = rnd(*shape)
        k, v = kv[..., :D], kv[..., D:]
        cache = kv
    else:
        shape = (num_blocks, page, Hkv, D) if layout == "NHD" else (num_blocks, Hkv, page, D)
        k, v = rnd(*shape), rnd(*shape)
        cache = (k, v)
    if layout == "HND":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    return cache, k, v


def make_bsr(kv_lens, q_lens, page, *, num_blocks=None, sglang=False, consecutive=False):
    """A vLLM block table (random distinct pages) or an SGLang token table as a device BSR. consecutive:
    the pages in order instead (request 0's first, then request 1's, ...: a ragged tensor at page 1);
    "runs": runs of pages in order, of random lengths up to 256 tokens, in random order (within one request,
    KV tiles the producer copies by TMA and tiles it gathers, in either order)."""
    B = len(kv_lens)
    nblk = [(l + page - 1) // page for l in kv_lens]
    total = sum(nblk)
    num_blocks = num_blocks or total + 7
    if consecutive == "runs":
        cuts = torch.randint(1, max(2, 256 // page) + 1, (num_blocks,)).cumsum(0)
        runs = torch.arange(num_blocks).tensor_split(cuts[cuts < num_blocks])
        perm = torch.cat([runs[i] for i in torch.randperm(len(runs))])
    else:
        perm = torch.arange(num_blocks) if consecutive else torch.randperm(num_blocks)
    perm = perm[:total].to(torch.int32)
    qo_indptr = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32)
    if sglang:
        assert page == 1
        pool_rows, max_len = B + 3, max(max(kv_lens), 1) + 5
        table = torch.randint(0, num_blocks, (pool_rows, max_len), dtype=torch.int32)
        rows = torch.randperm(pool_rows)[:B]
        off = 0
        for b in range(B):
            table[rows[b], :kv_lens[b]] = perm[off:off + kv_lens[b]]
            off += kv_lens[b]
        bsr = from_token_table(table.to(DEV), rows.to(DEV), kv_lens_t.to(DEV), qo_indptr.to(DEV),
                               num_kv_slots=num_blocks)
    else:
        max_blocks = max(max(nblk), 1) + 2
        table = torch.full((B, max_blocks), -5, dtype=torch.int32)  # padding past a request is never read
        off = 0
        for b in range(B):
            table[b, :nblk[b]] = perm[off:off + nblk[b]]
            off += nblk[b]
        bsr = from_block_table(table.to(DEV), kv_lens_t.to(DEV), qo_indptr.to(DEV), page, num_kv_blocks=num_blocks)
    return bsr, qo_indptr, kv_lens_t, num_blocks


def reference(q, k, v, bsr, **kw):
    """float64 reference through the BSR; `mask` (list of per-request bool masks) goes per request."""
    masks = kw.pop("masks", None)
    if masks is None:
        return ref.attention_bsr(q, k, v, bsr, **kw)
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
    qo = bsr.qo_indptr.tolist()
    starts, lens = bsr.kv_block_start.tolist(), bsr.kv_lens.tolist()
    bc = bsr.block_width
    for i in range(len(lens)):
        n = (lens[i] + bc - 1) // bc
        blocks = bsr.kv_indices[starts[i]:starts[i] + n].long()
        ki = k[blocks].reshape(-1, *k.shape[2:])[:lens[i]]
        vi = v[blocks].reshape(-1, *v.shape[2:])[:lens[i]]
        oi, li = ref.attention(q[qo[i]:qo[i + 1]], ki, vi, mask=masks[i].to(q.device), **kw)
        o[qo[i]:qo[i + 1]] = oi
        if li is not None:
            lse[qo[i]:qo[i + 1]] = li
    return o, (None if kw.get("use_sigmoid") else lse)


def check(out, lse, o_ref, lse_ref, tol, what="", lse_tol=None):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (a row was not written)"
    o = out.double()
    scale = o_ref.abs().amax(dim=-1).clamp_min(1e-3)
    err = ((o - o_ref).abs().amax(dim=-1) / scale).max().item()
    assert err < tol, f"{what}: max relative error {err:.3g} >= {tol}"
    if lse is not None and lse_ref is not None:
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE finiteness differs"
        lerr = (lse.double()[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
        bound = lse_tol if lse_tol is not None else max(tol / 2, 1e-3)
        assert lerr < bound, f"{what}: LSE error {lerr:.3g} >= {bound}"


def poison_unused(k, v, bsr):
    """NaN in every cache slot of k, v (NHD views [blocks, page, Hkv, D]) that no request of the BSR reads:
    a kernel that reads past a request's tokens meets them."""
    page = bsr.block_width
    used = torch.zeros(k.shape[0] * page, dtype=torch.bool, device=k.device)
    starts, lens = bsr.kv_block_start.tolist(), bsr.kv_lens.tolist()
    for s0, n in zip(starts, lens):
        blocks = bsr.kv_indices[s0:s0 + (n + page - 1) // page].long()
        slots = (blocks[:, None] * page + torch.arange(page, device=blocks.device)).reshape(-1)[:n]
        used[slots] = True
    unused = ~used.view(k.shape[0], page)
    for t in (k, v):
        if t.element_size() == 1:  # fp8: NaN by its bits (0x7F is NaN in e4m3fn and e5m2)
            t.view(torch.uint8)[unused] = 0x7F
        else:
            t[unused] = float("nan")


def run_case(attn, kv_lens, q_lens, *, dtype, kv_dtype=None, layout="NHD", packed=False, causal=False,
             variant_kw=None, ref_kw=None, k_scale=1.0, v_scale=1.0, tol=None, lse_tol=None, what="",
             consecutive=False, poison=False):
    """consecutive: pages in order, or in runs (make_bsr); poison: the slots no request reads hold NaN (poison_unused)."""
    kv_dtype = kv_dtype or dtype
    page = attn.page_size
    sglang = layout == "SGL"
    bsr, qo_cpu, kv_cpu, nb = make_bsr(kv_lens, q_lens, page, sglang=sglang, consecutive=consecutive)
    cache, k, v = random_kv(nb, page, attn.num_kv_heads, attn.head_dim, kv_dtype, layout=layout, packed=packed)
    if poison:
        poison_unused(k, v, bsr)
    return plan_run_check(attn, bsr, qo_cpu, kv_cpu, cache, k, v, dtype=dtype, kv_dtype=kv_dtype, causal=causal,
                          plan_kw=variant_kw, ref_kw=ref_kw, k_scale=k_scale, v_scale=v_scale, tol=tol,
                          lse_tol=lse_tol, what=what)


def plan_run_check(attn, bsr, qo_cpu, kv_cpu, cache, k, v, *, dtype, kv_dtype, causal, plan_kw=None, ref_kw=None,
                   k_scale=1.0, v_scale=1.0, tol=None, lse_tol=None, what=""):
    """Plan (plan_kw: plan()'s further arguments), run on fresh queries into NaN-poisoned outputs, and check
    against the float64 reference; returns the output."""
    rows = int(qo_cpu[-1])
    q = (1.5 * torch.randn(rows, attn.num_qo_heads, attn.head_dim, device=DEV)).to(dtype)
    attn.plan(qo_cpu, kv_cpu, bsr, causal=causal, **(plan_kw or {}))
    out = torch.full_like(q, float("nan"))
    use_lse = attn.variant.use_softmax
    lse = torch.full((rows, attn.num_qo_heads), float("nan"), device=DEV) if use_lse else None
    attn.run(q, cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    attn.check_errors()
    rk = dict(ref_kw or {})
    if kv_dtype != dtype:
        rk.update(k_scale=k_scale, v_scale=v_scale)
    o_ref, lse_ref = reference(q, k, v, bsr, causal=causal, **rk)
    check(out, lse, o_ref, lse_ref, tol or TOL[dtype], what, lse_tol)
    return out


def replay_check(graph, attn, q_buf, out_buf, k, v, bsr, tol, what):
    """Replay a graph that captured attn.run(q_buf, ..., out=out_buf) on fresh queries into a NaN-poisoned output,
    and check it against the reference over the step's BSR (causal)."""
    q_buf.normal_()
    out_buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    attn.check_errors()
    o_ref, _ = reference(q_buf, k, v, bsr, causal=True)
    check(out_buf, None, o_ref, None, tol, what)


_VARIANT_NAMES = ["default", "soft_cap", "window", "alibi", "sigmoid", "custom_mask", "rope_llama", "rope_llama31",
                  "rope_interleave", "soft_cap_window", "rope_window", "alibi_window"]


def _variant_case(name, Hq):
    """(name, variant, plan kwargs, reference kwargs) built when a test runs (tensors live on the GPU)."""
    return next(c for c in _variant_cases(Hq) if c[0] == name)


def run_variant_case(attn, name, kv_lens, q_lens, dtype, consecutive=False, poison=False):
    """run_case of built-in variant case `name` on a wrapper built with its variant (causal): custom masks are
    drawn for these lengths; RoPE rounds the rotated k to the MMA type once more, so logits (and the LSE)
    carry its error and get twice the tolerance."""
    _, _, vkw, rkw = _variant_case(name, attn.num_qo_heads)
    if callable(vkw):
        masks = vkw(q_lens, kv_lens)
        vkw = dict(zip(("mask_packed", "mask_indptr"), V.pack_custom_mask(masks, device=DEV)))
        rkw = {"masks": masks}
    tol = TOL[dtype] * (2 if "rope" in name else 1)
    run_case(attn, kv_lens, q_lens, dtype=dtype, causal=True, variant_kw=vkw, ref_kw=rkw, tol=tol,
             lse_tol=2 * tol if "rope" in name else None, what=f"variant {name} {dtype}", consecutive=consecutive,
             poison=poison)


def _variant_cases(Hq):
    masks_fn = lambda qls, kls: [torch.rand(ql, kl) < 0.7 for ql, kl in zip(qls, kls)]  # noqa: E731
    cfg31 = ref.RopeConfig(theta=500000.0, llama31=ref.Llama31Scaling())
    return [
        ("default", V.DEFAULT, {}, {}),
        ("soft_cap", V.SOFT_CAP, {"logits_soft_cap": 2.5}, {"logits_soft_cap": 2.5}),
        ("window", V.SLIDING_WINDOW, {"window_left": 37}, {"window_left": 37}),
        ("alibi", V.ALIBI, {"alibi_slopes": ref.alibi_slopes(Hq).float().to(DEV)}, {"alibi_slopes": ref.alibi_slopes(Hq)}),
        ("sigmoid", V.SIGMOID, {"sigmoid_bias": -1.5}, {"use_sigmoid": True, "sigmoid_bias": -1.5}),
        ("custom_mask", V.CUSTOM_MASK, masks_fn, None),
        ("rope_llama", V.ROPE, {"rope": ref.RopeConfig(theta=10000.0)}, {"rope": ref.RopeConfig(theta=10000.0)}),
        ("rope_llama31", V.ROPE, {"rope": cfg31}, {"rope": cfg31}),
        ("rope_interleave", V.ROPE_INTERLEAVE, {"rope": ref.RopeConfig(interleave=True)},
         {"rope": ref.RopeConfig(interleave=True)}),
        ("soft_cap_window", V.BUILTIN_VARIANTS["soft_cap_window"], {"logits_soft_cap": 3.0, "window_left": 100},
         {"logits_soft_cap": 3.0, "window_left": 100}),
        ("rope_window", V.BUILTIN_VARIANTS["rope_window"], {"rope": cfg31, "window_left": 0},
         {"rope": cfg31, "window_left": 0}),
        ("alibi_window", V.BUILTIN_VARIANTS["alibi_window"],
         {"alibi_slopes": ref.alibi_slopes(Hq).float().to(DEV), "window_left": 50},
         {"alibi_slopes": ref.alibi_slopes(Hq), "window_left": 50}),
    ]




class PersistentBatch:
    """An engine's per-step buffers that live across steps (block table, KV lengths, query offsets, row
    starts) and the BSR over them. Each step is written into the same storage, as vLLM does, so a run()
    captured in a CUDA graph keeps reading valid tensors after a re-plan. Pages: a fresh random
    permutation of the pool every step, or (consecutive) the pool in order from a fresh random start,
    wrapping around at its end."""

    def __init__(self, max_batch: int, max_blocks: int, page: int, consecutive: bool = False):
        self.max_blocks, self.page, self.consecutive = max_blocks, page, consecutive
        self.num_blocks = max_batch * max_blocks
        self.table = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=DEV)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=DEV)
        self.qsl = torch.zeros(max_batch + 1, dtype=torch.int32, device=DEV)
        self.kbs = torch.arange(max_batch, dtype=torch.int32, device=DEV) * max_blocks

    def write(self, q_lens, kv_lens):
        """(bsr, qo_indptr_cpu, kv_lens_cpu) of a step written into the persistent buffers."""
        B = len(q_lens)
        if self.consecutive:
            perm = (torch.arange(B * self.max_blocks) + random.randrange(self.num_blocks)) % self.num_blocks
        else:
            perm = torch.randperm(self.num_blocks)[: B * self.max_blocks]
        self.table[:B] = perm.view(B, self.max_blocks).to(torch.int32).to(DEV)
        kv_cpu = torch.tensor(kv_lens, dtype=torch.int32)
        self.seq_lens[:B] = kv_cpu.to(DEV)
        qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
        self.qsl[:B + 1] = qo.to(DEV)
        bsr = BSR(qo_indptr=self.qsl[:B + 1], kv_indices=self.table.view(-1), kv_block_start=self.kbs[:B],
                  kv_lens=self.seq_lens[:B], block_width=self.page, num_kv_blocks=self.num_blocks)
        return bsr, qo, kv_cpu
