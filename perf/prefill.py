"""Prefill attention inputs and implementations for the benchmarks (perf.kernels, perf.zoo, perf/tools): ours,
FlashInfer 0.6.14 (FA2 / FA3 templates, ragged and paged), vLLM's FlashAttention-3 and PyTorch FlexAttention on the
same tensors, plus the FLOP conventions.

Inputs: Case (requests prefilled from scratch, this step's K/V ragged), Paged (a Case's K/V in a paged pool, pages a
random permutation as in a serving engine) and AppendCase (a query chunk appended to a paged KV cache). One input
set per shape: K/V exceed the 50 MB L2 in every benchmark shape and prefill is compute-bound (each KV tile is
reused by a whole query tile), so rotating sets as decode does would change nothing.
"""
from __future__ import annotations

import math
import time

import torch

from perf.common import log

DTYPE = torch.bfloat16
HQ, D = 32, 128
FLEX_MEMORY_BYTES = 24 << 30   # budget for q, k, v, out in both layouts
SOFT_CAP = 30.0
WINDOW = 1024
MAX_REL_DIFF = 2e-2            # a spot check, not a test: relative L2 difference between two implementations
_failures: list = []


# ------------------------------------------------------------------------------ pure helpers (tested on the CPU)

def _prefix_pairs(n: int, window_left: int) -> int:
    """Causal pairs of query positions 0 .. n-1 against keys from position 0: sum of min(p, W) + 1."""
    if n <= 0:
        return 0
    if window_left < 0 or n <= window_left + 1:
        return n * (n + 1) // 2
    w = window_left + 1
    return w * (w + 1) // 2 + (n - w) * w


def _excess(x: int, window_left: int) -> int:
    """sum over p <= x of max(0, p - W) (keys a window cuts off the left of positions up to x)."""
    m = max(0, x - window_left)
    return m * (m + 1) // 2


def unmasked_pairs(q_len: int, kv_len: int, *, causal: bool = True, window_left: int = -1) -> int:
    """(query, key) pairs one request attends to, with the reference's masks (fi_backend.reference.attention):
    query row r sits at position kv_len - q_len + r (bottom-right aligned); key j at position j; causal keeps
    j <= position, window_left >= 0 keeps j >= position - window_left."""
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"q_len and kv_len must be >= 0 (got {q_len}, {kv_len})")
    first = kv_len - q_len           # position of the first query row (negative: rows above the KV)
    if causal:
        # positions run up to kv_len - 1 and a row at position p < 0 sees no key
        return _prefix_pairs(kv_len, window_left) - _prefix_pairs(max(first, 0), window_left)
    pairs = q_len * kv_len
    if window_left >= 0:
        pairs -= _excess(kv_len - 1, window_left) - _excess(first - 1, window_left)
    return pairs


def attention_flops(pairs: int, heads: int, head_dim: int) -> int:
    """Two matmuls (q.k and p.v) of 2 * head_dim FLOPs per attended pair and head."""
    return 4 * heads * head_dim * pairs


def issue_flops(batch: int, heads: int, head_dim: int, seq_len: int) -> float:
    """The issue's causal convention, 4 * b * h * d * s^2 / 2 (the anchors' published figures use it)."""
    return 4 * batch * heads * head_dim * seq_len * seq_len / 2


def tflops(flops: float, us: float) -> float:
    return flops / (us * 1e-6) / 1e12


def fit_batch(batch: int, seq_len: int, heads: int, head_dim: int, budget_bytes: int = FLEX_MEMORY_BYTES,
              tensors: int = 8, element_bytes: int = 2) -> int:
    """Largest batch <= `batch` (halving) whose `tensors` [b, s, h, d] tensors fit budget_bytes (at least 1)."""
    while batch > 1 and tensors * batch * seq_len * heads * head_dim * element_bytes > budget_bytes:
        batch //= 2
    return batch


def check(label: str, stats: dict) -> dict:
    """stats (perf.common.diff_stats) with "ok": relative difference below MAX_REL_DIFF; a miss is logged and kept
    in failures() so that the run can fail after its results are written."""
    stats = dict(stats)
    stats["ok"] = bool(stats["rel_diff"] < MAX_REL_DIFF)
    if not stats["ok"]:
        _failures.append(f"{label}: relative difference {stats['rel_diff']:.3e} (max |diff| "
                         f"{stats['max_abs_diff']:.3e})")
        log(f"MISMATCH {_failures[-1]}")
    return stats


def failures() -> list:
    return list(_failures)


# ------------------------------------------------------------------------------------------------ inputs

class Case:
    """One batch of equal requests prefilled from scratch (q_len = kv_len = s): q [b * s, Hq, D] and this
    step's k, v [b * s, Hkv, D] (ragged, contiguous per request), bf16 normal; indptrs on the CPU and GPU."""

    def __init__(self, batch, seq_len, num_qo_heads, num_kv_heads, head_dim=D, seed=0, device="cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.seq_len, self.hq, self.hkv, self.d = batch, seq_len, num_qo_heads, num_kv_heads, head_dim
        self.rows = batch * seq_len
        make = lambda h: torch.randn(self.rows, h, head_dim, generator=g, device=device, dtype=DTYPE)
        self.q, self.k, self.v = make(num_qo_heads), make(num_kv_heads), make(num_kv_heads)
        self.lens = torch.full((batch,), seq_len, dtype=torch.int32)
        self.indptr = torch.arange(batch + 1, dtype=torch.int32) * seq_len
        self.indptr_dev = self.indptr.to(device)
        self.kv_bytes = 2 * self.k.numel() * self.k.element_size()

    def shape(self) -> dict:
        return {"batch": self.batch, "seq_len": self.seq_len, "num_qo_heads": self.hq, "num_kv_heads": self.hkv,
                "head_dim": self.d, "kv_bytes": self.kv_bytes}


class Paged:
    """The case's K/V copied into a paged pool [pages, P, Hkv, D] (k and v caches) whose pages are a random
    permutation, with its block table, a compact CSR of it (FlashInfer) and our BSR."""

    def __init__(self, case: Case, page_size: int, seed=1):
        from fi_backend import formats
        P, s = page_size, case.seq_len
        blocks = (s + P - 1) // P
        self.page_size, self.num_pages = P, case.batch * blocks
        dev = case.q.device
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.num_pages, generator=gen).to(torch.int32)
        self.table = perm.view(case.batch, blocks).to(dev)
        tok = torch.arange(case.rows, device=dev)
        t = tok % s
        page = self.table[tok // s, t // P].long()
        shape = (self.num_pages, P, case.hkv, case.d)
        self.k = torch.zeros(shape, dtype=DTYPE, device=dev)
        self.v = torch.zeros(shape, dtype=DTYPE, device=dev)
        self.k[page, t % P] = case.k
        self.v[page, t % P] = case.v
        self.bsr = formats.from_block_table(self.table, case.lens.to(dev), case.indptr_dev, P,
                                            num_kv_blocks=self.num_pages)
        self.csr_indptr = torch.arange(case.batch + 1, dtype=torch.int32) * blocks
        self.csr_indices = self.table.reshape(-1)
        self.last_page_len = torch.full((case.batch,), s - (blocks - 1) * P, dtype=torch.int32)


class StepCase:
    """One engine step of any mix: request i has q_lens[i] new query tokens at the end of kv_lens[i] tokens of KV
    (bottom-right causal; a decode row is q_len 1): q [sum(q_lens), Hq, D] and a paged pool (.pool: page_size, k, v
    [pages, P, Hkv, D], block table, FlashInfer's CSR and our BSR) whose pages are a random permutation."""

    def __init__(self, q_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim=D, page_size=16, seed=0, device="cuda"):
        from types import SimpleNamespace

        from fi_backend import formats
        if len(q_lens) != len(kv_lens) or not q_lens or any(not 1 <= q <= k for q, k in zip(q_lens, kv_lens)):
            raise ValueError(f"{type(self).__name__}: need 1 <= q_len <= kv_len a request (got {q_lens}, {kv_lens})")
        g = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.hq, self.hkv, self.d = len(q_lens), num_qo_heads, num_kv_heads, head_dim
        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        self.rows = sum(q_lens)
        self.q = torch.randn(self.rows, num_qo_heads, head_dim, generator=g, device=device, dtype=DTYPE)
        self.lens = torch.tensor(kv_lens, dtype=torch.int32)
        self.indptr = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.indptr_dev = self.indptr.to(device)
        P = page_size
        blocks = [(k + P - 1) // P for k in kv_lens]
        num_pages = sum(blocks)
        # request i's pages: the next blocks[i] of a random permutation (so the CSR's indices are the permutation)
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed + 1)).to(torch.int32)
        table = torch.zeros(self.batch, max(blocks), dtype=torch.int32)
        for i, pages in enumerate(perm.split(blocks)):
            table[i, :len(pages)] = pages
        table = table.to(device)
        shape = (num_pages, P, num_kv_heads, head_dim)
        k = torch.randn(shape, generator=g, device=device, dtype=DTYPE)
        v = torch.randn(shape, generator=g, device=device, dtype=DTYPE)
        self.pool = SimpleNamespace(
            page_size=P, num_pages=num_pages, table=table, k=k, v=v,
            bsr=formats.from_block_table(table, self.lens.to(device), self.indptr_dev, P, num_kv_blocks=num_pages),
            csr_indptr=torch.tensor([0] + blocks, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            csr_indices=perm.to(device),
            last_page_len=torch.tensor([k - (n - 1) * P for k, n in zip(kv_lens, blocks)], dtype=torch.int32))
        self.kv_bytes = 2 * sum(kv_lens) * num_kv_heads * head_dim * k.element_size()

    def shape(self) -> dict:
        return {"batch": self.batch, "q_lens": self.q_lens, "kv_lens": self.kv_lens, "num_qo_heads": self.hq,
                "num_kv_heads": self.hkv, "head_dim": self.d, "page_size": self.pool.page_size}


class AppendCase(StepCase):
    """`batch` requests each appending a chunk of q_len query tokens to a cache of kv_len tokens (the chunk's own
    K/V included, bottom-right causal): a StepCase of equal requests."""

    def __init__(self, batch, q_len, kv_len, num_qo_heads, num_kv_heads, head_dim=D, page_size=16, seed=0,
                 device="cuda"):
        super().__init__([q_len] * batch, [kv_len] * batch, num_qo_heads, num_kv_heads, head_dim, page_size, seed,
                         device)
        self.q_len, self.kv_len = q_len, kv_len

    def shape(self) -> dict:
        return {"batch": self.batch, "q_len": self.q_len, "kv_len": self.kv_len, "num_qo_heads": self.hq,
                "num_kv_heads": self.hkv, "head_dim": self.d, "page_size": self.pool.page_size,
                "kv_bytes": self.kv_bytes}


# ------------------------------------------------------------------------------------------ implementations

def ours_fn(case, *, paged=None, variant=None, params=None, tuning=None, num_ctas=None, causal=True):
    """(fn, out, info): our prefill kernel (kernel="prefill") on a Case (ragged KV, a ragged=True wrapper whose CuTe
    member reads K / V rows, unless `paged`, a Paged) or an
    AppendCase (paged = case.pool); tuning: one kernel shape instead of the tile family; num_ctas: CTAs of the grid
    (default: the recommended count)."""
    from fi_backend import formats, variants
    from fi_backend.workspace import Workspace
    from fi_backend.wrappers import BatchAttention
    variant = variant or variants.DEFAULT
    if num_ctas is None:
        num_ctas = BatchAttention.recommended_num_ctas("cuda", case.hq, case.hkv, case.d, q_dtype=DTYPE,
                                                       kv_dtype=DTYPE, variant=variant, kernel="prefill", tuning=tuning)
    tile_q = BatchAttention.query_tile_rows(case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=DTYPE, variant=variant,
                                            kernel="prefill", tuning=tuning)
    ws = Workspace("cuda", max_requests=case.batch, max_tokens=case.rows, num_ctas=num_ctas, max_tile_q=tile_q,
                   num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d)
    if paged is None:  # this step's K/V as a cache [total, 1, Hkv, D] with one token per block (a ragged wrapper)
        page_size = 1
        bsr = formats.from_ragged(case.indptr_dev, case.indptr_dev, num_kv_tokens=case.rows)
        kv = (case.k.unsqueeze(1), case.v.unsqueeze(1))
    else:
        page_size, bsr, kv = paged.page_size, paged.bsr, (paged.k, paged.v)
    attn = BatchAttention(ws, case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=DTYPE, page_size=page_size,
                          kv_layout="NHD", variant=variant, kernel="prefill", tuning=tuning, ragged=paged is None)
    t0 = time.perf_counter()
    attn.plan(case.indptr, case.lens, bsr, causal=causal, **(params or {}))
    plan_ms = (time.perf_counter() - t0) * 1e3
    out = torch.empty_like(case.q)

    def fn():
        attn.run(case.q, kv, out=out)
    return fn, out, {"num_ctas": num_ctas, "rows_per_tile": int(attn.rows_per_tile), "plan_ms": plan_ms,
                     "cute_step": attn.cute_step, "cute_staged": attn.cute_staged,
                     "cute_unsupported": attn.cute_unsupported}


class FlashInferRagged:
    """FlashInfer's BatchPrefillWithRaggedKVCacheWrapper with one backend, re-planned per case; the first
    plan + run + synchronise (its JIT build when the cache is cold) is timed."""

    def __init__(self, backend: str):
        import flashinfer
        self.backend = backend
        self.buf = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        self.w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.buf, "NHD", backend=backend)
        self.first_call_s = None

    def fn(self, case: Case, causal=True):
        t0 = time.perf_counter()
        self.w.plan(case.indptr, case.indptr, case.hq, case.hkv, case.d, causal=causal, q_data_type=DTYPE,
                    kv_data_type=DTYPE)
        out = torch.empty_like(case.q)

        def fn():
            self.w.run(case.q, case.k, case.v, out=out)
        if self.first_call_s is None:
            fn()
            torch.cuda.synchronize()
            self.first_call_s = time.perf_counter() - t0
            log(f"flashinfer {self.backend}: first plan + run {self.first_call_s:.1f} s (JIT build if cold)")
        return fn, out


def flashinfer_paged_fn(case, paged, state: dict):
    """(fn, out): FlashInfer's FA2 paged prefill wrapper (one per `state`, re-planned per case) on a Case with a
    Paged pool or an AppendCase with its pool; causal (bottom-right aligned, as ours)."""
    import flashinfer
    if "w" not in state:
        state["buf"] = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        state["w"] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(state["buf"], "NHD", backend="fa2")
    w = state["w"]
    t0 = time.perf_counter()
    w.plan(case.indptr, paged.csr_indptr, paged.csr_indices, paged.last_page_len, case.hq, case.hkv, case.d,
           paged.page_size, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)
    out = torch.empty_like(case.q)

    def fn():
        w.run(case.q, (paged.k, paged.v), out=out)
    if "first_call_s" not in state:
        fn()
        torch.cuda.synchronize()
        state["first_call_s"] = time.perf_counter() - t0
        log(f"flashinfer paged fa2: first plan + run {state['first_call_s']:.1f} s (JIT build if cold)")
    return fn, out


def vllm_fa3():
    """(flash_attn_varlen_func, None), or (None, why it is unavailable)."""
    try:
        from vllm.vllm_flash_attn import fa_version_unsupported_reason, flash_attn_varlen_func, is_fa_version_supported
    except Exception as e:  # not installed, or an import-time failure of the engine: recorded, not fatal
        return None, f"vllm.vllm_flash_attn not importable: {type(e).__name__}: {e}"
    try:
        if not is_fa_version_supported(3):
            return None, f"FlashAttention-3 unsupported: {fa_version_unsupported_reason(3)}"
    except Exception as e:
        return None, f"is_fa_version_supported(3) failed: {type(e).__name__}: {e}"
    return flash_attn_varlen_func, None


def vllm_fn(func, case: Case, causal=True):
    out = torch.empty_like(case.q)
    scale = 1.0 / math.sqrt(case.d)

    def fn():
        func(case.q, case.k, case.v, max_seqlen_q=case.seq_len, cu_seqlens_q=case.indptr_dev,
             max_seqlen_k=case.seq_len, cu_seqlens_k=case.indptr_dev, softmax_scale=scale, causal=causal, out=out,
             fa_version=3)
    return fn, out

def vllm_paged_fn(func, case, pool=None, causal=True):
    """(fn, out): vLLM's FlashAttention-3 on a paged pool (block_table, seqused_k): an AppendCase's own, or a
    Case's Paged copy (`pool`: every request's queries are its whole KV)."""
    out = torch.empty_like(case.q)
    scale = 1.0 / math.sqrt(case.d)
    pool = case.pool if pool is None else pool
    seqused = case.lens.to(case.q.device)
    q_len, kv_len = (case.q_len, case.kv_len) if isinstance(case, AppendCase) else (case.seq_len, case.seq_len)

    def fn():
        func(case.q, pool.k, pool.v, max_seqlen_q=q_len, cu_seqlens_q=case.indptr_dev, max_seqlen_k=kv_len,
             seqused_k=seqused, block_table=pool.table, softmax_scale=scale, causal=causal, out=out, fa_version=3)
    return fn, out


# ------------------------------------------------------------------------------------------------ FlexAttention

def flex_specs(slopes):
    """name -> (our variant, its plan() params, flex score_mod or None, flex mask_mod, window_left)."""
    from fi_backend import variants

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return SOFT_CAP * torch.tanh(score / SOFT_CAP)

    def alibi(score, b, h, q_idx, kv_idx):  # the reference's sign: slope * (kv_pos - q_pos) <= 0 for past keys
        return score + slopes[h] * (kv_idx - q_idx)

    return {
        "causal": (variants.DEFAULT, {}, None, causal, -1),
        "soft_cap_30": (variants.SOFT_CAP, {"logits_soft_cap": SOFT_CAP}, soft_cap, causal, -1),
        "alibi": (variants.ALIBI, {"alibi_slopes": slopes}, alibi, causal, -1),
        "sliding_window_1024": (variants.SLIDING_WINDOW, {"window_left": WINDOW}, None, sliding_window, WINDOW),
    }


def compiled_flex():
    """torch.compile(flex_attention, dynamic=False), with dynamo's recompile limit raised: one compile per
    (score_mod, shape); past the limit dynamo would run flex eagerly, which materialises the S x S scores, so it
    fails instead of falling back (the config names vary across torch versions)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention
    cfg = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, limit):
            setattr(cfg, limit, max(getattr(cfg, limit), 128))
    for fail in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(cfg, fail):
            setattr(cfg, fail, True)
    return torch.compile(flex_attention, dynamic=False)


def flex_fn(flex, case: Case, score_mod, mask_mod):
    """(fn, result): flex on the case's values in its [b, h, s, D] layout, block mask made here (outside the
    timing); result() is flex's last output in ours' [tokens, heads, D] layout. GQA through enable_gqa."""
    from torch.nn.attention.flex_attention import create_block_mask
    b, s = case.batch, case.seq_len
    q, k, v = (x.view(b, s, -1, case.d).transpose(1, 2).contiguous() for x in (case.q, case.k, case.v))
    block_mask = create_block_mask(mask_mod, None, None, s, s, device=case.q.device)
    scale = 1.0 / math.sqrt(case.d)
    res = {}

    def fn():
        res["o"] = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                        enable_gqa=case.hq != case.hkv)

    def result():
        return res["o"].transpose(1, 2).reshape(case.rows, case.hq, case.d)
    return fn, result
