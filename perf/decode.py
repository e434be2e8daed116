"""Decode attention inputs and implementations for the benchmarks (perf.kernels, perf.zoo, perf/tools): ours,
FlashInfer 0.6.14's decode wrapper and vLLM's FlashAttention-3 on the same q and the same paged KV.

The pool is FlashInfer's NHD layout [pages, 2, page, Hkv, D] (ours reads its k and v views by strides), or split
(k, v) caches [pages, page, Hkv, D]; pages are a random permutation of the pool, as in a serving engine's cache.
KV sets are rotated so that the 50 MB L2 flatters no side: each timed call reads another set. Bytes counted:
every KV byte once, plus q and o.
"""
from __future__ import annotations

import math

import torch

from perf.common import time_us

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
L2_ROTATE_BYTES = 256 << 20      # rotate sets until this many bytes separate two reads of one set
MAX_SET_BYTES = 40 << 30         # skip shapes whose KV does not fit next to everything else


class Case:
    """One batch: lengths, a paged KV pool with `sets` independent KV caches, q, and block tables. Heads and
    head_dim default to HQ / HKV / D (perf/zoo.py passes the model zoo's)."""

    def __init__(self, kv_lens, page_size, sets=None, seed=0, kv_dtype=DTYPE, split_kv=False, *, hq=None, hkv=None,
                 d=None, device="cuda"):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.hq, self.hkv, self.d = hq or HQ, hkv or HKV, d or D
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32)
        self.B = len(kv_lens)
        self.page = page_size
        blocks = (self.kv_lens + page_size - 1) // page_size
        self.max_blocks = int(blocks.max())
        self.num_pages = int(blocks.sum())
        self.kv_dtype = kv_dtype
        kv_bytes = int(self.kv_lens.sum()) * self.hkv * self.d * 2 * torch.tensor([], dtype=kv_dtype).element_size()
        self.kv_bytes = kv_bytes
        self.sets = sets or max(1, min(64, math.ceil(L2_ROTATE_BYTES / max(kv_bytes, 1))))
        # pages of a request are a random permutation of the pool, as in a serving engine's cache
        perm = torch.randperm(self.num_pages, generator=g).to(torch.int32)
        table = torch.zeros(self.B, self.max_blocks, dtype=torch.int32)
        starts = torch.cumsum(blocks, 0) - blocks
        col = torch.arange(self.max_blocks)
        used = col[None, :] < blocks[:, None]
        table[used] = perm[(starts[:, None] + col[None, :])[used]]
        self.block_table = table.to(device)
        self.indptr = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(blocks, 0).to(torch.int32)]).to(device)
        self.indices = perm[(starts[:, None] + col[None, :])[used]].to(device)  # compact CSR for FlashInfer, same order
        self.last_page_len = (self.kv_lens - (blocks - 1) * page_size).to(torch.int32).to(device)
        # FlashInfer's NHD layout [pages, 2, page, Hkv, D], or split (k, v) caches [pages, page, Hkv, D]
        head = (self.hkv, self.d)
        shape = (self.num_pages, page_size, *head) if split_kv else (self.num_pages, 2, page_size, *head)
        make = lambda: torch.randn(shape, dtype=DTYPE, device=device).to(kv_dtype)
        self.caches = [(make(), make()) if split_kv else make() for _ in range(self.sets)]
        # the same caches as ours reads them: a (k, v) pair of [pages, page, Hkv, D] views
        self.kv_pairs = [c if split_kv else (c[:, 0], c[:, 1]) for c in self.caches]
        self.q = torch.randn(self.B, self.hq, self.d, dtype=DTYPE, device=device)
        self.out = torch.empty_like(self.q)
        self.qo_indptr = torch.arange(self.B + 1, dtype=torch.int32)
        self.bytes = kv_bytes + 2 * self.q.numel() * self.q.element_size()


def ours(case: Case, *, split=True, variant=None, plan_kw=None, num_ctas=None, tuning=None, min_kv_chunk=None,
         plan_ctas=None):
    """(fn, setup, workspace): our decode kernel on the case; setup(i) picks KV set i; num_ctas: CTAs of the grid
    (default: the recommended count); tuning: a kernel-shape override (fi_backend.wrappers.decode_spec);
    min_kv_chunk: the plan's shortest KV split (experiments; split=False: no split at all); plan_ctas: the CTAs of
    the grid the plan gives work to (experiments)."""
    from fi_backend import formats, scheduler
    from fi_backend.workspace import Workspace
    from fi_backend.wrappers import BatchAttention

    from fi_backend import variants
    variant = variant or variants.DEFAULT
    if num_ctas is None:
        num_ctas = BatchAttention.recommended_num_ctas("cuda", case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=case.kv_dtype,
                                                       variant=variant, tuning=tuning)
    ws = Workspace("cuda", max_requests=case.B, max_tokens=case.B, num_ctas=num_ctas, max_tile_q=16,
                   num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d)
    attn = BatchAttention(ws, case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=case.kv_dtype, page_size=case.page,
                          variant=variant, tuning=tuning)
    bsr = formats.from_block_table(case.block_table, case.kv_lens.cuda(), case.qo_indptr.cuda(), case.page,
                                   num_kv_blocks=case.num_pages)
    attn.plan(case.qo_indptr, case.kv_lens, bsr, **(plan_kw or {}))
    if not split:  # the same kernel with one work item per request: the plan without KV splitting
        min_kv_chunk = 1 << 30
    if min_kv_chunk is not None or plan_ctas is not None:
        ws.plan(case.qo_indptr, case.kv_lens, tile_q=attn.rows_per_tile, num_units=attn.num_units,
                min_kv_chunk=int(min_kv_chunk or scheduler.DEFAULT_MIN_KV_CHUNK), kv_chunk_align=int(attn.kv_tile),
                cost_q=attn._cost_q, num_ctas=plan_ctas or attn.grid[0])   # the member's grid
    kv = case.kv_pairs
    state = {"i": 0}

    def setup(i):
        state["i"] = i % case.sets

    def fn():
        attn.run(case.q, kv[state["i"]], out=case.out)
    return fn, setup, ws


def flashinfer_fn(case: Case, tensor_cores: bool):
    import flashinfer
    buf = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(buf, "NHD", use_tensor_cores=tensor_cores)
    w.plan(case.indptr, case.indices, case.last_page_len, case.hq, case.hkv, case.d, case.page,
           q_data_type=DTYPE, kv_data_type=case.kv_dtype)
    out = torch.empty_like(case.q)
    state = {"i": 0}

    def setup(i):
        state["i"] = i % case.sets

    def fn():
        w.run(case.q, case.caches[state["i"]], out=out)
    return fn, setup, out


def check_close(case: Case, ours_out, fi_out):
    err = ((ours_out.float() - fi_out.float()).norm() / fi_out.float().norm()).item()
    if not err < 2e-2:
        raise AssertionError(f"ours and FlashInfer disagree: relative difference {err:.3e}")
    return err


def flashinfer_best_us(case: Case, rep: int = 50) -> float:
    """The anchor's median time on the case: FlashInfer's faster decode path (tensor cores on or off)."""
    return min(time_us(f, setup=s, rep=rep)["median_us"] for f, s, _ in (flashinfer_fn(case, tc) for tc in (True, False)))


def vllm_fa3_fn(func, case: Case):
    """(fn, setup, out): vLLM's FlashAttention-3 (flash_attn_varlen_func, fa_version=3) on the case's pages: one
    query row per request, block_table and seqused_k, k and v the strided views of the NHD pool."""
    out = torch.empty_like(case.q)
    cu_q = torch.arange(case.B + 1, dtype=torch.int32, device=case.q.device)
    seqused = case.kv_lens.to(case.q.device)
    max_len = int(case.kv_lens.max())
    scale = 1.0 / math.sqrt(case.d)
    state = {"i": 0}

    def setup(i):
        state["i"] = i % case.sets

    def fn():
        k, v = case.kv_pairs[state["i"]]
        func(case.q, k, v, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=max_len, seqused_k=seqused,
             block_table=case.block_table, softmax_scale=scale, causal=True, out=out, fa_version=3)
    return fn, setup, out
