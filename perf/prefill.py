"""Prefill attention: fi-backend's prefill kernel against FlashInfer 0.6.14 (FA2 and FA3 templates), vLLM's
FlashAttention-3 and PyTorch FlexAttention, on identical inputs in one process (issue 4, Performance).

    python -m perf.prefill [--sections fa2,paged,flex,variant_compile] [--quick] [--no-fa3] [--name prefill_h100]

Sections:
  fa2              causal, bf16, 32 query / 32 KV heads (32 / 8 GQA as extra rows), head_dim 128, batch x
                   length 16x1k, 4x4k, 1x16k; ours reads this step's K/V as a ragged tensor (formats.from_ragged,
                   Bc = 1). Anchors on the same q/k/v: FlashInfer's BatchPrefillWithRaggedKVCacheWrapper with
                   backend="fa2" (the bar: ratio >= 1.00) and backend="fa3" (its first call JIT-compiles for about
                   100 s there, timed; --no-fa3 skips it), vLLM's flash_attn_varlen_func(fa_version=3) when
                   importable (else recorded as unavailable, with the reason). TFLOP/s = 4 * b * h * d * s^2 / 2
                   / time with h the query heads (the issue's convention, which ENGINES.md's anchor figures use).
  paged            the same shapes and 32 / 32 heads, ours only: ragged KV vs a paged pool at page 16 and page 1
                   (pages in a random permutation of the pool, as in a serving engine). Bar: paged time / ragged
                   time <= 1.10. --fi-paged adds FlashInfer's FA2 paged wrapper at both page sizes for context
                   (one more JIT build there).
  flex             against torch.nn.attention.flex_attention under torch.compile(dynamic=False), AttentionGym-style:
                   batch 16 (halved while the inputs of both layouts exceed 24 GiB), 16 heads, head_dim 128,
                   lengths 512..16k (--quick: 1k, 4k; --flex-lengths to choose), for causal, causal + tanh soft-cap
                   30, causal + ALiBi, causal + sliding window 1024 (a query attends to itself and the 1024 keys
                   before it, AttentionGym's `q - kv <= 1024`; ours window_left=1024). Block masks are made once
                   per (mask, length) outside the timing; flex's compile time is recorded per row. FLOPs count
                   unmasked (query, key) pairs only: 4 * b * h * d * pairs (unmasked_pairs below). Ours gets the
                   same values in its [tokens, heads, D] layout, flex in [b, h, s, D]. Bar: flex time / ours >= 1.2.
  family           the query-tile family's per-step pick (BatchAttention plans each step with one member) against
                   every member forced, ours only: causal, 32 / 8 heads, short to long batches (FAMILY_SHAPES).
                   Records each time, the picked member and the fastest; a pick more than 10% slower than the
                   fastest member is flagged (no bar: this tunes wrappers.FAMILY_TILES_PER_CTA / FAMILY_WAVE_SLACK).
  variant_compile  seconds to JIT-build a brand-new user variant (a FlashSigmoid-style functor string) for the
                   prefill kernel, from an empty cache (a child process with a fresh FI_BACKEND_CACHE_DIR; the
                   rest of the run keeps its cache), and to its first result, which is checked against
                   fi_backend.reference. Bar: <= 30 s (FlashInfer: 26 s decode, 102 s Hopper prefill there).

Timing: perf.common.time_us (CUDA events, median, >= 200 ms warm-up), repeats cut so that one figure takes about
3 s of timed calls (at least 10). One input set per shape: K/V exceed the 50 MB L2 in every shape, and prefill is
compute-bound (each KV tile is reused by a whole query tile), so rotating sets as perf/decode does would change
nothing. Correctness spot check per shape: ours against an anchor's output on the same inputs (max |diff| and
relative L2 difference, recorded); a relative difference above 2e-2 fails the run after the JSON is written.
Not a substitute for tests.

Every section records device, date, commit, shapes, ours, anchors and ratios (anchor time / our time, > 1: ours
faster). Results: perf/results/<name>.json (and $OUT/<name>.json), a markdown table beside it. On the GPU machine
a command may run 10 minutes: run sections in separate commands (`--sections fa2`, `--sections flex
--flex-lengths 512,1024,2048`, ...) and pass --merge so that each adds its sections (flex: its rows) to the
JSON already in perf/results (copy each run's JSON back there first).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from perf.common import RESULTS, commit, device_info, time_us, write_result

DTYPE = torch.bfloat16
HQ, D = 32, 128
KV_HEADS = (32, 8)                            # 32 / 32 is the issue's figure; 32 / 8 (GQA) an extra row
SHAPES = ((16, 1024), (4, 4096), (1, 16384))  # (batch, length)
FAMILY_SHAPES = ((1, 256), (1, 512), (16, 128), (64, 64), (8, 300), (1, 1291), (1, 2048), (4, 1291), (2, 4096))
PAGE_SIZES = (16, 1)
PAGED_ROUNDS = 5                              # interleaved rounds of the paged section (2 with --quick)
FLEX_ROUNDS = 3                               # alternating ours / flex rounds a flex cell (2 with --quick)
FLEX_BATCH, FLEX_HEADS = 16, 16
FLEX_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
FLEX_QUICK_LENGTHS = (1024, 4096)
FLEX_VARIANTS = ("causal", "soft_cap_30", "alibi", "sliding_window_1024")
FLEX_MEMORY_BYTES = 24 << 30   # budget for q, k, v, out in both layouts
SOFT_CAP = 30.0
WINDOW = 1024
TIMED_BUDGET_S = 3.0
MAX_REL_DIFF = 2e-2
BARS = {"fa2_ratio_min": 1.0, "paged_over_ragged_max": 1.10, "flex_ratio_min": 1.2, "variant_compile_max_s": 30.0}
# Measured on the same H100 on 2026-11-22 (ENGINES.md): context for the report, never used as an anchor.
REFERENCE_FIGURES = {
    "fa2_tflops_16x1k_4x4k_1x16k": {"flashinfer_fa2": [300, 354, 382], "flashinfer_fa3": [427, 575, 658],
                                    "vllm_fa3": [393, 563, 657]},
    "flex_tflops_1k_4k": {"causal": [263, 364], "soft_cap_30": [146, 180], "alibi": [251, 256],
                          "sliding_window_1024": [259, 278]},
    "flashinfer_variant_compile_s": {"decode": 26, "hopper_prefill": 102},
}
_failures: list = []


def log(msg):
    print(msg, file=sys.stderr, flush=True)


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


def timed_reps(estimate_us: float, rep: int, budget_s: float = TIMED_BUDGET_S, minimum: int = 10) -> int:
    """Repeats for time_us: `rep`, fewer when one call is long, so that a figure takes about budget_s."""
    if estimate_us <= 0:
        return rep
    return max(min(minimum, rep), min(rep, int(budget_s * 1e6 / estimate_us)))


def fit_batch(batch: int, seq_len: int, heads: int, head_dim: int, budget_bytes: int = FLEX_MEMORY_BYTES,
              tensors: int = 8, element_bytes: int = 2) -> int:
    """Largest batch <= `batch` (halving) whose `tensors` [b, s, h, d] tensors fit budget_bytes (at least 1)."""
    while batch > 1 and tensors * batch * seq_len * heads * head_dim * element_bytes > budget_bytes:
        batch //= 2
    return batch


def diff_stats(ours: torch.Tensor, other: torch.Tensor) -> dict:
    """max |ours - other| and ||ours - other|| / ||other||, in float32."""
    a, b = ours.float(), other.float()
    d = a - b
    return {"max_abs_diff": d.abs().max().item(), "rel_diff": (d.norm() / b.norm().clamp_min(1e-30)).item()}


def _check(label: str, stats: dict) -> dict:
    stats = dict(stats)
    stats["ok"] = bool(stats["rel_diff"] < MAX_REL_DIFF)
    if not stats["ok"]:
        _failures.append(f"{label}: relative difference {stats['rel_diff']:.3e} (max |diff| "
                         f"{stats['max_abs_diff']:.3e})")
        log(f"MISMATCH {_failures[-1]}")
    return stats


def _stamp() -> dict:
    """What every section records about where and when it ran."""
    return {"device": device_info(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit()}


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

    def __init__(self, case: Case, page_size: int, seed=1, group: int = 0):
        """group > 0: pages shuffled only within consecutive groups of `group` pages (perf/page1_gather.py: how
        far apart a tile's rows lie); 0: one random permutation of the whole pool."""
        from fi_backend import formats
        P, s = page_size, case.seq_len
        blocks = (s + P - 1) // P
        self.page_size, self.num_pages = P, case.batch * blocks
        dev = case.q.device
        gen = torch.Generator().manual_seed(seed)
        if group > 0:
            perm = torch.cat([g[torch.randperm(len(g), generator=gen)]
                              for g in torch.arange(self.num_pages).split(group)]).to(torch.int32)
        else:
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


# ------------------------------------------------------------------------------------------ implementations

def ours_fn(case: Case, *, paged: Paged = None, variant=None, params=None, tuning=None, num_ctas=None):
    """(fn, out, info): our prefill kernel (kernel="prefill") on the case, ragged KV unless `paged`; tuning: one
    kernel shape instead of the tile family; num_ctas: CTAs of the grid (default: the recommended count)."""
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
    if paged is None:  # this step's K/V as a cache [total, 1, Hkv, D] with one token per block
        page_size = 1
        bsr = formats.from_ragged(case.indptr_dev, case.indptr_dev, num_kv_tokens=case.rows)
        kv = (case.k.unsqueeze(1), case.v.unsqueeze(1))
    else:
        page_size, bsr, kv = paged.page_size, paged.bsr, (paged.k, paged.v)
    attn = BatchAttention(ws, case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=DTYPE, page_size=page_size,
                          kv_layout="NHD", variant=variant, kernel="prefill", tuning=tuning)
    t0 = time.perf_counter()
    attn.plan(case.indptr, case.lens, bsr, causal=True, **(params or {}))
    plan_ms = (time.perf_counter() - t0) * 1e3
    out = torch.empty_like(case.q)

    def fn():
        attn.run(case.q, kv, out=out)
    fn.attn = attn  # the wrapper, for scripts that inspect it (perf/run_host.py)
    return fn, out, {"num_ctas": num_ctas, "rows_per_tile": int(attn.rows_per_tile), "plan_ms": plan_ms}


class FlashInferRagged:
    """FlashInfer's BatchPrefillWithRaggedKVCacheWrapper with one backend, re-planned per case; the first
    plan + run + synchronise (its JIT build when the cache is cold) is timed."""

    def __init__(self, backend: str):
        import flashinfer
        self.backend = backend
        self.buf = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        self.w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.buf, "NHD", backend=backend)
        self.first_call_s = None

    def fn(self, case: Case):
        t0 = time.perf_counter()
        self.w.plan(case.indptr, case.indptr, case.hq, case.hkv, case.d, causal=True, q_data_type=DTYPE,
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


def flashinfer_paged_fn(case: Case, paged: Paged, state: dict):
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


def vllm_fn(func, case: Case):
    out = torch.empty_like(case.q)
    scale = 1.0 / math.sqrt(case.d)

    def fn():
        func(case.q, case.k, case.v, max_seqlen_q=case.seq_len, cu_seqlens_q=case.indptr_dev,
             max_seqlen_k=case.seq_len, cu_seqlens_k=case.indptr_dev, softmax_scale=scale, causal=True, out=out,
             fa_version=3)
    return fn, out


def measure(fn, rep: int) -> dict:
    """time_us with repeats scaled to the call's length (one untimed call, then one timed, for the estimate)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time_us(fn, rep=timed_reps((time.perf_counter() - t0) * 1e6, rep))


def time_rounds(fns: dict, rounds: int, rep: int, on_round=None) -> dict:
    """{label: [median us, one a round]}: each fn timed once a round, in order, the rounds one after another,
    so the figures compared within a round were taken seconds apart (perf/results/ab49_page1.md: a shape's
    time moves by up to 8% within minutes). on_round(i, times) after each round (progress)."""
    times = {k: [] for k in fns}
    for i in range(rounds):
        for k, f in fns.items():
            times[k].append(measure(f, rep)["median_us"])
        if on_round:
            on_round(i, times)
    return times


def time_tunings(case: Case, tunings: list, rep: int, out, label: str, **kw) -> dict:
    """Median us of ours with each kernel shape forced, on the same inputs in the same process (an A/B of
    shapes), keyed by the tuning's JSON; each output checked against `out` (the wrapper's own pick)."""
    by = {}
    for tuning in tunings:
        tfn, tout, _ = ours_fn(case, tuning=tuning, **kw)
        by[json.dumps(tuning)] = measure(tfn, rep)["median_us"]
        _check(f"{label} {json.dumps(tuning)} vs the pick", diff_stats(tout, out))
        del tfn, tout
    return by


# ------------------------------------------------------------------------------------------------ sections

def fa2_section(a) -> dict:
    import flashinfer
    rows, broken = [], {}
    fa2 = FlashInferRagged("fa2")
    fa3 = None
    if not a.no_fa3:
        try:
            fa3 = FlashInferRagged("fa3")
        except Exception as e:
            broken["fi_fa3"] = f"{type(e).__name__}: {e}"
    vfunc, vllm_reason = (None, "skipped (--no-vllm)") if a.no_vllm else vllm_fa3()
    if vllm_reason:
        log(f"vLLM FA3 anchor unavailable: {vllm_reason}")
    for hkv in KV_HEADS:
        for b, s in SHAPES:
            case = Case(b, s, HQ, hkv, seed=s + hkv)
            flops = issue_flops(b, HQ, D, s)
            fn, out, info = ours_fn(case, tuning=a.tuning)
            r = {**case.shape(), **info, "flops": flops}
            t = measure(fn, a.rep)
            r.update(ours_us=t["median_us"], ours_p10_us=t["p10_us"], ours_p90_us=t["p90_us"], rep=t["rep"])
            r["ours_tflops"] = tflops(flops, r["ours_us"])
            if a.fa2_tunings:
                r["ours_us_by_tuning"] = time_tunings(case, a.fa2_tunings, a.rep, out, f"fa2 {hkv} kv heads {b}x{s}")
            anchors = [("fi_fa2", fa2.fn)] + ([("fi_fa3", fa3.fn)] if fa3 else [])
            if vfunc is not None:
                anchors.append(("vllm_fa3", lambda c: vllm_fn(vfunc, c)))
            msg = f"fa2 {HQ}/{hkv} {b:2d}x{s:5d}: ours {r['ours_us']:8.1f} us {r['ours_tflops']:5.0f} TF/s"
            for key, make in anchors:
                if key in broken:
                    continue
                try:  # an anchor that fails (e.g. its JIT build) is recorded and dropped, not fatal
                    afn, aout = make(case)
                    at = measure(afn, a.rep)
                except Exception as e:
                    broken[key] = f"{type(e).__name__}: {e}"
                    log(f"anchor {key} failed, dropped: {broken[key]}")
                    continue
                r[f"{key}_us"] = at["median_us"]
                r[f"{key}_tflops"] = tflops(flops, at["median_us"])
                r[f"ratio_{key}_over_ours"] = at["median_us"] / r["ours_us"]
                r[f"check_vs_{key}"] = _check(f"fa2 {hkv} kv heads {b}x{s} ours vs {key}", diff_stats(out, aout))
                msg += f" | {key} {r[f'{key}_tflops']:5.0f} TF/s ratio {r[f'ratio_{key}_over_ours']:.3f}"
                del afn, aout
            if "ours_us_by_tuning" in r and "fi_fa2_us" in r:
                r["ratio_fi_fa2_over_ours_by_tuning"] = {t: r["fi_fa2_us"] / us for t, us in r["ours_us_by_tuning"].items()}
                msg += " | by tuning " + ", ".join(f"{t} {us:.1f} us ({r['fi_fa2_us'] / us:.3f})"
                                                   for t, us in r["ours_us_by_tuning"].items())
            if "ratio_fi_fa2_over_ours" in r:
                r["bar_met"] = r["ratio_fi_fa2_over_ours"] >= BARS["fa2_ratio_min"]
                msg += f" | max|diff| vs fa2 {r['check_vs_fi_fa2']['max_abs_diff']:.2e}"
            rows.append(r)
            log(msg)
            del fn, out, case
            torch.cuda.empty_cache()
    return {**_stamp(), "tuning": a.tuning, "tunings": a.fa2_tunings, "flashinfer": flashinfer.__version__,
            "vllm_fa3": "available" if vfunc else vllm_reason,
            "first_call_s": {"fi_fa2": fa2.first_call_s, "fi_fa3": fa3.first_call_s if fa3 else None},
            "anchor_errors": broken,
            "flops": "4 * b * h * d * s^2 / 2, h = query heads (the issue's convention)",
            "kv": "ours: ragged (formats.from_ragged, page 1); anchors: FlashInfer ragged wrapper / vLLM varlen",
            "bar": f"ratio_fi_fa2_over_ours >= {BARS['fa2_ratio_min']} on the 32/32 rows", "rows": rows}


def paged_section(a) -> dict:
    """Ragged, page 16 and page 1 timed in interleaved rounds in one process: a shape's times move by up to
    8% between measurements a few seconds apart (4x4k ragged 1098-1223 us, perf/results/ab49_page1.md), so
    each round's ratio compares neighbours and the bar reads the median of the rounds' ratios."""
    rows = []
    fi_state = {} if a.fi_paged else None
    rounds = 2 if a.quick else PAGED_ROUNDS
    for b, s in SHAPES:
        case = Case(b, s, HQ, HQ, seed=s)
        fn, ragged_out, info = ours_fn(case)
        fn()
        fns, pools = {"ragged": fn}, {}  # pools: page size -> (Paged, our output on it)
        r = {**case.shape(), "ragged_rows_per_tile": info["rows_per_tile"], "rounds": rounds}
        for P in PAGE_SIZES:
            paged = Paged(case, P)
            pfn, pout, pinfo = ours_fn(case, paged=paged)
            pfn()
            r[f"page{P}_plan_ms"] = pinfo["plan_ms"]
            r[f"check_page{P}_vs_ragged"] = _check(f"paged {b}x{s} page {P} vs ragged", diff_stats(pout, ragged_out))
            fns[f"page{P}"] = pfn
            pools[P] = (paged, pout)
        per_round = time_rounds(fns, rounds, a.rep)
        r["us_per_round"] = per_round
        r["ragged_us"] = statistics.median(per_round["ragged"])
        msg = f"paged {b:2d}x{s:5d}: ragged {r['ragged_us']:8.1f} us"
        for P in PAGE_SIZES:
            ratios = [x / y for x, y in zip(per_round[f"page{P}"], per_round["ragged"])]
            r[f"page{P}_us"] = statistics.median(per_round[f"page{P}"])
            r[f"page{P}_over_ragged_per_round"] = ratios
            r[f"page{P}_over_ragged"] = statistics.median(ratios)
            msg += f" | page {P} {r[f'page{P}_us']:8.1f} us ({r[f'page{P}_over_ragged']:.3f}x)"
            if fi_state is not None:
                ffn, fout = flashinfer_paged_fn(case, pools[P][0], fi_state)
                r[f"fi_fa2_page{P}_us"] = measure(ffn, a.rep)["median_us"]
                r[f"check_page{P}_vs_fi_fa2"] = _check(f"paged {b}x{s} page {P} vs FlashInfer",
                                                       diff_stats(pools[P][1], fout))
                msg += f" (FI fa2 {r[f'fi_fa2_page{P}_us']:.1f})"
                del ffn, fout
        if fi_state is not None:  # FlashInfer's own paged cost against its ragged one, for context
            if "ragged" not in fi_state:
                fi_state["ragged"] = FlashInferRagged("fa2")
            ffn, fout = fi_state["ragged"].fn(case)
            r["fi_fa2_ragged_us"] = measure(ffn, a.rep)["median_us"]
            del ffn, fout
        r["bar_met"] = all(r[f"page{P}_over_ragged"] <= BARS["paged_over_ragged_max"] for P in PAGE_SIZES)
        rows.append(r)
        log(msg)
        del fn, fns, pools, ragged_out, case
        torch.cuda.empty_cache()
    return {**_stamp(), "num_qo_heads": HQ, "num_kv_heads": HQ, "head_dim": D, "page_sizes": list(PAGE_SIZES),
            "layout": "paged pool [pages, page, Hkv, D] for k and v, pages a random permutation; ragged = this "
                      "step's k, v [tokens, Hkv, D]",
            "method": f"ragged, page 16 and page 1 in interleaved rounds ({rounds}), one process; a time is the median "
                      "of its rounds, a ratio the median of the rounds' paged / ragged",
            "bar": f"page{{P}}_over_ragged <= {BARS['paged_over_ragged_max']}", "rows": rows}


def family_section(a) -> dict:
    from fi_backend import wrappers
    members = wrappers.prefill_family_shapes(D, "bf16")
    hkv = 8
    rows = []
    for b, s in FAMILY_SHAPES:
        case = Case(b, s, HQ, hkv, seed=s + b)
        fn, out, info = ours_fn(case)
        r = {**case.shape(), "picked_rows_per_tile": info["rows_per_tile"], "pick_us": measure(fn, a.rep)["median_us"]}
        msg = f"family {HQ}/{hkv} {b:2d}x{s:5d}: pick ({info['rows_per_tile']} rows) {r['pick_us']:8.1f} us"
        forced = []
        for m, shape in enumerate(members):
            mfn, mout, minfo = ours_fn(case, tuning=shape)
            us = measure(mfn, a.rep)["median_us"]
            r[f"member{m}_us"] = us
            r[f"member{m}_rows_per_tile"] = minfo["rows_per_tile"]
            r[f"check_member{m}_vs_pick"] = _check(f"family {b}x{s} member {m} vs pick", diff_stats(mout, out))
            forced.append(us)
            msg += f" | member {m} ({minfo['rows_per_tile']} rows) {us:8.1f} us"
            del mfn, mout
        r["fastest_member"] = min(range(len(forced)), key=forced.__getitem__)
        r["pick_over_fastest"] = r["pick_us"] / min(forced)
        r["pick_ok"] = r["pick_over_fastest"] <= 1.10
        rows.append(r)
        log(msg + f" | pick / fastest {r['pick_over_fastest']:.3f}")
        del fn, out, case
        torch.cuda.empty_cache()
    return {**_stamp(), "num_qo_heads": HQ, "num_kv_heads": hkv, "head_dim": D, "members": members,
            "tiles_per_cta": wrappers.FAMILY_TILES_PER_CTA, "wave_slack": wrappers.FAMILY_WAVE_SLACK,
            "note": "pick: the wrapper's per-step choice; member m: that shape forced (tuning)", "rows": rows}


def _flex_specs(slopes):
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


def flex_section(a) -> dict:
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fi_backend import reference
    cfg = torch._dynamo.config
    # One compile per (score_mod, length); past the limit dynamo would run flex eagerly, which materialises the
    # S x S scores: raise the limit, and fail rather than fall back (names vary across torch versions).
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, limit):
            setattr(cfg, limit, max(getattr(cfg, limit), 128))
    for fail in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(cfg, fail):
            setattr(cfg, fail, True)
    flex = torch.compile(flex_attention, dynamic=False)
    slopes = reference.alibi_slopes(FLEX_HEADS).to(torch.float32).cuda()
    specs = _flex_specs(slopes)
    names = a.flex_variants.split(",") if a.flex_variants else list(FLEX_VARIANTS)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise SystemExit(f"--flex-variants: unknown {unknown}; accepted: {', '.join(FLEX_VARIANTS)}")
    lengths = ([int(x) for x in a.flex_lengths.split(",")] if a.flex_lengths
               else list(FLEX_QUICK_LENGTHS if a.quick else FLEX_LENGTHS))
    stamp = _stamp()
    rows = []
    scale = 1.0 / math.sqrt(D)
    flex_rounds = 2 if a.quick else FLEX_ROUNDS
    for s in lengths:
        b = fit_batch(FLEX_BATCH, s, FLEX_HEADS, D)
        case = Case(b, s, FLEX_HEADS, FLEX_HEADS, seed=s)
        # the same values in flex's [b, h, s, D] layout
        flex_in = [x.view(b, s, FLEX_HEADS, D).transpose(1, 2).contiguous() for x in (case.q, case.k, case.v)]
        masks = {}
        for name in names:
            variant, params, score_mod, mask_mod, window = specs[name]
            if mask_mod not in masks:
                masks[mask_mod] = create_block_mask(mask_mod, None, None, s, s, device="cuda")
            block_mask = masks[mask_mod]
            pairs = unmasked_pairs(s, s, causal=True, window_left=window)
            flops = attention_flops(pairs, FLEX_HEADS, D) * b
            fn, out, info = ours_fn(case, variant=variant, params=params)
            r = {"variant": name, **case.shape(), "pairs_per_request": pairs, "flops": flops, **info,
                 "date": stamp["date"], "commit": stamp["commit"]}
            res = {}

            def flex_fn():
                res["o"] = flex(*flex_in, score_mod=score_mod, block_mask=block_mask, scale=scale)
            t0 = time.perf_counter()
            flex_fn()
            torch.cuda.synchronize()
            r["flex_first_call_s"] = time.perf_counter() - t0   # torch.compile of this (score_mod, shape)
            # Ours and flex in alternating rounds, after flex's compile: a figure timed right after seconds
            # of idle GPU (a compile) or after another's load would otherwise carry the clocks' state into
            # the ratio. Times are the rounds' medians, the ratio the median of the rounds' ratios.
            rounds = time_rounds({"ours": fn, "flex": flex_fn}, flex_rounds, a.rep)
            ratios = [f / o for o, f in zip(rounds["ours"], rounds["flex"])]
            r["us_per_round"], r["ratio_per_round"] = rounds, ratios
            r["ours_us"], r["flex_us"] = statistics.median(rounds["ours"]), statistics.median(rounds["flex"])
            r["ours_tflops"], r["flex_tflops"] = tflops(flops, r["ours_us"]), tflops(flops, r["flex_us"])
            r["ratio_flex_over_ours"] = statistics.median(ratios)
            if a.flex_tunings:
                r["ours_us_by_tuning"] = time_tunings(case, a.flex_tunings, a.rep, out, f"flex {name} {b}x{s}",
                                                      variant=variant, params=params)
                log(f"flex {name:20s} {b:2d}x{s:5d}: ours us " + ", ".join(
                    f"{k} {v:.1f}" for k, v in [("pick", r["ours_us"]), *r["ours_us_by_tuning"].items()]))
            if "ours_us_by_tuning" in r:
                r["ratio_flex_over_ours_by_tuning"] = {t: r["flex_us"] / us for t, us in r["ours_us_by_tuning"].items()}
            r["bar_met"] = r["ratio_flex_over_ours"] >= BARS["flex_ratio_min"]
            flex_out = res.pop("o").transpose(1, 2).reshape(case.rows, FLEX_HEADS, D)
            r["check_vs_flex"] = _check(f"flex {name} {b}x{s} ours vs flex", diff_stats(out, flex_out))
            rows.append(r)
            log(f"flex {name:20s} {b:2d}x{s:5d}: ours {r['ours_tflops']:5.0f} TF/s, flex {r['flex_tflops']:5.0f} TF/s "
                f"(compile {r['flex_first_call_s']:.1f} s), ratio {r['ratio_flex_over_ours']:.3f}, "
                f"max|diff| {r['check_vs_flex']['max_abs_diff']:.2e}")
            del fn, out, flex_out
        flex_in = masks = case = None   # free this length's tensors before the next length's are made
        torch.cuda.empty_cache()
    return {**stamp, "batch": FLEX_BATCH, "heads": FLEX_HEADS, "head_dim": D, "soft_cap": SOFT_CAP,
            "window_left": WINDOW, "flex": "torch.compile(flex_attention, dynamic=False), block mask made once per "
                                          "(mask, length) outside the timing; output allocated by flex per call",
            "method": f"ours and flex in {flex_rounds} alternating rounds after flex's compile, one process; a time is "
                      "the median of its rounds, the ratio the median of the rounds' flex / ours",
            "flops": "4 * b * h * d * unmasked (query, key) pairs (causal: s(s+1)/2 per request and head)",
            "bar": f"ratio_flex_over_ours >= {BARS['flex_ratio_min']}", "rows": rows}


# A user variant as a user writes it (the paper's FlashSigmoid): sigmoid(logits * scale + bias), no softmax.
USER_VARIANT = {
    "name": "perf_flash_sigmoid",
    "use_softmax": False,
    "params": {"scale": "float", "bias": "float"},
    "logits_transform": "return 1.f / (1.f + __expf(-(logits * params.scale + params.bias)));",
}


def variant_compile_child(out_path: str) -> None:
    """In a fresh process with an empty FI_BACKEND_CACHE_DIR: build USER_VARIANT's prefill module (timed), run it
    once on an append-shaped batch (timed), check it against fi_backend.reference, write JSON to out_path."""
    t_import = time.perf_counter()
    from fi_backend import formats, kernels, reference
    from fi_backend.variants import Variant
    from fi_backend.workspace import Workspace
    from fi_backend.wrappers import BatchAttention
    import_s = time.perf_counter() - t_import
    torch.zeros(1, device="cuda")   # CUDA context outside the timing
    torch.cuda.synchronize()
    variant = Variant(**USER_VARIANT)
    hq, hkv, d, scale, bias = 32, 8, 128, 0.7, -1.5
    t0 = time.perf_counter()
    num_ctas = BatchAttention.recommended_num_ctas("cuda", hq, hkv, d, q_dtype=DTYPE, kv_dtype=DTYPE, variant=variant,
                                                   kernel="prefill")
    build_s = time.perf_counter() - t0

    q_lens, kv_lens = [300, 77], [300, 1077]        # a prefill and an append (bottom-right causal)
    g = torch.Generator(device="cuda").manual_seed(0)
    qo_indptr = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    kv_indptr = torch.tensor([0, kv_lens[0], sum(kv_lens)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g, device="cuda", dtype=DTYPE)
    k = torch.randn(sum(kv_lens), hkv, d, generator=g, device="cuda", dtype=DTYPE)
    v = torch.randn(sum(kv_lens), hkv, d, generator=g, device="cuda", dtype=DTYPE)
    out = torch.full_like(q, float("nan"))
    t1 = time.perf_counter()
    tile_q = BatchAttention.query_tile_rows(hq, hkv, d, q_dtype=DTYPE, kv_dtype=DTYPE, variant=variant, kernel="prefill")
    ws = Workspace("cuda", max_requests=2, max_tokens=sum(q_lens), num_ctas=num_ctas, max_tile_q=tile_q,
                   num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    attn = BatchAttention(ws, hq, hkv, d, q_dtype=DTYPE, kv_dtype=DTYPE, page_size=1, variant=variant, kernel="prefill")
    bsr = formats.from_ragged(kv_indptr.cuda(), qo_indptr.cuda(), num_kv_tokens=sum(kv_lens))
    attn.plan(qo_indptr, torch.tensor(kv_lens, dtype=torch.int32), bsr, causal=True, scale=scale, bias=bias)
    attn.run(q, (k.unsqueeze(1), v.unsqueeze(1)), out=out)
    torch.cuda.synchronize()
    first_run_s = time.perf_counter() - t1
    expect, _ = reference.batch_attention(q, qo_indptr, k, v, kv_indptr, causal=True, use_sigmoid=True,
                                          sm_scale=scale / math.sqrt(d), sigmoid_bias=bias)
    stats = diff_stats(out, expect)
    root = kernels.cache_dir(kernels.resolve_arch_list())
    modules = [{"name": m.name, "build_seconds": (meta or {}).get("build_seconds"), "bytes": size}
               for m, meta, size in kernels.list_cached(root)]
    Path(out_path).write_text(json.dumps({
        "import_s": import_s, "build_s": build_s, "first_run_s": first_run_s, "total_s": build_s + first_run_s,
        "modules": modules, "check_vs_reference": stats, "num_ctas": num_ctas,
        "check_shape": {"q_lens": q_lens, "kv_lens": kv_lens, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d},
    }))


def variant_compile_section(a) -> dict:
    from fi_backend import kernels
    tmp = Path(tempfile.mkdtemp(prefix="fi_cold_cache_"))
    env = dict(os.environ)
    env["FI_BACKEND_CACHE_DIR"] = str(tmp / "cache")   # empty: this measurement only
    env.pop("FI_BACKEND_JIT", None)                    # a shipped cache may have turned the JIT off
    env["FI_BACKEND_QUIET"] = "1"
    out_json = tmp / "result.json"
    repo = Path(__file__).resolve().parent.parent
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "perf.prefill", "--compile-child", str(out_json)], cwd=repo,
                              env=env, capture_output=True, text=True, timeout=a.compile_timeout)
        wall_s = time.perf_counter() - t0
        if proc.returncode != 0 or not out_json.is_file():
            raise RuntimeError(f"variant_compile child failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                               f"{proc.stderr[-4000:]}")
        child = json.loads(out_json.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    nvcc = kernels.find_nvcc()
    r = {**_stamp(), "variant": USER_VARIANT, **child, "child_wall_s": wall_s,
         "nvcc": kernels.nvcc_version(nvcc) if nvcc else None,
         "cuda_arch_list": os.environ.get("FI_BACKEND_CUDA_ARCH_LIST") or "the GPU's", "cpus": os.cpu_count(),
         "bar": f"total_s (build + first result) <= {BARS['variant_compile_max_s']}",
         "bar_met": child["total_s"] <= BARS["variant_compile_max_s"]}
    r["check_vs_reference"] = _check("variant_compile user variant vs reference", child["check_vs_reference"])
    log(f"variant_compile: build {child['build_s']:.1f} s + first run {child['first_run_s']:.2f} s = "
        f"{child['total_s']:.1f} s ({len(child['modules'])} module(s)); rel diff vs reference "
        f"{child['check_vs_reference']['rel_diff']:.2e}")
    return r


# ------------------------------------------------------------------------------------------------ report

SECTIONS = ("fa2", "paged", "flex", "family", "variant_compile")


def _merge(old: dict, new: dict) -> dict:
    """new's sections over old's; flex rows merged by (variant, seq_len), new rows winning."""
    merged = {k: v for k, v in old.items() if k in SECTIONS}
    for k in SECTIONS:
        if k not in new:
            continue
        if k == "flex" and "flex" in old:
            key = lambda x: (x["variant"], x["seq_len"])
            fresh = {key(x) for x in new["flex"]["rows"]}
            rows = [x for x in old["flex"]["rows"] if key(x) not in fresh] + new["flex"]["rows"]
            rows.sort(key=lambda x: (FLEX_VARIANTS.index(x["variant"]) if x["variant"] in FLEX_VARIANTS else 99,
                                     x["seq_len"]))
            merged["flex"] = {**new["flex"], "rows": rows}
        else:
            merged[k] = new[k]
    return {**{k: v for k, v in new.items() if k not in SECTIONS}, **merged}


def _f(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def _tuning_table(rows: list, anchor: str, anchor_key: str, label: str, label_of) -> list:
    """Markdown lines of ours with kernel shapes forced (--fa2-tunings / --flex-tunings; none: no lines), us and
    the anchor's time over ours from the same run, beside the wrapper's own pick."""
    tunings = list(dict.fromkeys(t for x in rows for t in x.get("ours_us_by_tuning", {})))
    if not tunings:
        return []
    lines = [f"Ours with the kernel shape forced (us, and {anchor} / ours from the same run; `pick`: the wrapper's "
             "own choice):", "",
             f"| {label} | batch x len | pick | " + " | ".join(f"`{t}`" for t in tunings) + " |",
             "|---|---|---|" + "---|" * len(tunings)]
    for x in rows:
        by, ref = x.get("ours_us_by_tuning", {}), x.get(anchor_key)
        cell = lambda us: "-" if us is None else f"{us:.1f}" + (f" ({ref / us:.3f})" if ref else "")  # noqa: E731
        lines.append(f"| {label_of(x)} | {x['batch']}x{x['seq_len']} | {cell(x['ours_us'])} | "
                     + " | ".join(cell(by.get(t)) for t in tunings) + " |")
    return lines + [""]


def write_report(json_path) -> Path:
    """perf/results/<name>.md: the tables of a results JSON (its figures; nothing recomputed but formatting)."""
    r = json.loads(Path(json_path).read_text())
    dev = r.get("device", {}).get("name", "?")
    lines = [f"# Prefill attention, {dev}, {r.get('date', '?')[:10]}, commit {str(r.get('commit', '?'))[:12]}", "",
             "Causal, bf16, head_dim 128; median of CUDA-event timings, one input set per shape (compute-bound; "
             "K/V exceed L2). ratio = anchor time / our time (> 1: ours faster). Each section below names its own "
             "date and commit.", ""]
    if "fa2" in r:
        s = r["fa2"]
        fl = s.get("first_call_s", {})
        lines += [f"## Ragged prefill against FlashInfer and vLLM ({s['date'][:10]}, commit {s['commit'][:12]})", "",
                  f"TFLOP/s = {s['flops']}. FlashInfer {s.get('flashinfer')}; vLLM FA3: {s.get('vllm_fa3')}. "
                  f"First plan + run (JIT build when cold): FA2 {_f(fl.get('fi_fa2'))} s, FA3 {_f(fl.get('fi_fa3'))} s. "
                  f"Bar: {s['bar']}."
                  + (f" Ours with the shape forced: {json.dumps(s['tuning'])}." if s.get("tuning") else ""), "",
                  "| heads q/kv | batch x len | ours us | ours TF/s | FI FA2 TF/s | ratio | FI FA3 TF/s | ratio | "
                  "vLLM FA3 TF/s | ratio | max abs diff vs FA2 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in s["rows"]:
            cells = [f"{x['num_qo_heads']}/{x['num_kv_heads']}", f"{x['batch']}x{x['seq_len']}", _f(x["ours_us"]),
                     _f(x["ours_tflops"], ".0f")]
            for key in ("fi_fa2", "fi_fa3", "vllm_fa3"):
                cells += [_f(x.get(f"{key}_tflops"), ".0f"), _f(x.get(f"ratio_{key}_over_ours"), ".3f")]
            cells.append(_f(x.get("check_vs_fi_fa2", {}).get("max_abs_diff"), ".2e"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += _tuning_table(s["rows"], "FI FA2", "fi_fa2_us", "heads q/kv",
                               lambda x: f"{x['num_qo_heads']}/{x['num_kv_heads']}")
    if "paged" in r:
        s = r["paged"]
        fi = any("fi_fa2_page16_us" in x for x in s["rows"])
        lines += [f"## Paged against ragged KV, ours ({s['date'][:10]}, commit {s['commit'][:12]})", "",
                  f"{s['num_qo_heads']}/{s['num_kv_heads']} heads; {s['layout']}. Bar: {s['bar']}.", "",
                  "| batch x len | ragged us | page 16 us | page 16 / ragged | page 1 us | page 1 / ragged |"
                  + (" FI FA2 ragged us | FI page 16 us | FI page 1 us |" if fi else ""),
                  "|---|---|---|---|---|---|" + ("---|---|---|" if fi else "")]
        for x in s["rows"]:
            line = (f"| {x['batch']}x{x['seq_len']} | {_f(x['ragged_us'])} | {_f(x['page16_us'])} | "
                    f"{_f(x['page16_over_ragged'], '.3f')} | {_f(x['page1_us'])} | {_f(x['page1_over_ragged'], '.3f')} |")
            if fi:
                line += (f" {_f(x.get('fi_fa2_ragged_us'))} | {_f(x.get('fi_fa2_page16_us'))} | "
                         f"{_f(x.get('fi_fa2_page1_us'))} |")
            lines.append(line)
        lines.append("")
    if "flex" in r:
        s = r["flex"]
        lines += [f"## Variants against FlexAttention ({s['date'][:10]}, commit {s['commit'][:12]})", "",
                  f"{s['heads']} heads, head_dim {s['head_dim']}, batch {s['batch']} unless noted; soft-cap "
                  f"{s['soft_cap']}, window_left {s['window_left']}, all causal. FLOPs: {s['flops']}. Flex: {s['flex']}. "
                  f"Bar: {s['bar']}.", "",
                  "| variant | batch x len | ours us | ours TF/s | flex us | flex TF/s | flex / ours | flex compile s | "
                  "max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
        for x in s["rows"]:
            lines.append(f"| {x['variant']} | {x['batch']}x{x['seq_len']} | {_f(x['ours_us'])} | "
                         f"{_f(x['ours_tflops'], '.0f')} | {_f(x['flex_us'])} | {_f(x['flex_tflops'], '.0f')} | "
                         f"{_f(x['ratio_flex_over_ours'], '.3f')} | {_f(x.get('flex_first_call_s'))} | "
                         f"{_f(x['check_vs_flex']['max_abs_diff'], '.2e')} |")
        lines.append("")
        lines += _tuning_table(s["rows"], "flex", "flex_us", "variant", lambda x: x["variant"])
    if "family" in r:
        s = r["family"]
        n = len(s["members"])
        lines += [f"## Query-tile family: the per-step pick against each member ({s['date'][:10]}, commit "
                  f"{s['commit'][:12]})", "",
                  f"Causal, {s['num_qo_heads']}/{s['num_kv_heads']} heads, ours only. Members: "
                  + "; ".join(f"{m}: {json.dumps(x)}" for m, x in enumerate(s["members"]))
                  + f". Pick rule: the largest tile giving each CTA {s['tiles_per_cta']} tiles"
                  + (f" or whole waves of tiles (slack {s['wave_slack']})" if "wave_slack" in s else "") + ".", "",
                  "| batch x len | picked rows | pick us | " + " | ".join(f"member {m} us" for m in range(n))
                  + " | pick / fastest |", "|---|---|---|" + "---|" * n + "---|"]
        for x in s["rows"]:
            lines.append(f"| {x['batch']}x{x['seq_len']} | {x['picked_rows_per_tile']} | {_f(x['pick_us'])} | "
                         + " | ".join(_f(x[f"member{m}_us"]) for m in range(n))
                         + f" | {_f(x['pick_over_fastest'], '.3f')} |")
        lines.append("")
    if "variant_compile" in r:
        s = r["variant_compile"]
        mods = ", ".join(f"{m['name']} ({_f(m.get('build_seconds'))} s)" for m in s.get("modules", []))
        lines += [f"## New user variant, cold JIT build ({s['date'][:10]}, commit {s['commit'][:12]})", "",
                  f"`{s['variant']['logits_transform']}` (use_softmax=False), prefill kernel, empty cache, "
                  f"nvcc {s.get('nvcc')}, {s.get('cpus')} CPUs. Bar: {s['bar']}.", "",
                  "| build s | first run s | total s | bar met | rel diff vs reference | modules built |",
                  "|---|---|---|---|---|---|",
                  f"| {_f(s['build_s'])} | {_f(s['first_run_s'], '.2f')} | {_f(s['total_s'])} | {s['bar_met']} | "
                  f"{_f(s['check_vs_reference']['rel_diff'], '.2e')} | {mods} |", ""]
    out = Path(json_path).with_suffix(".md")
    out.write_text("\n".join(lines))
    log(f"wrote {out}")
    return out


# ------------------------------------------------------------------------------------------------ main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (30) and flex lengths 1k, 4k only")
    ap.add_argument("--rep", type=int, default=100, help="timed calls per figure at most (default 100)")
    ap.add_argument("--name", default="prefill_h100", help="results name: perf/results/<name>.json")
    ap.add_argument("--tuning", type=json.loads, default=None,
                    help="fa2 section: time ours with this kernel shape forced, a JSON tuning dict (e.g. "
                         "'{\"warps\": 8, \"mfrags\": 1, \"tile\": 64, \"stages\": 2, \"step\": 64, \"wgmma\": 1, "
                         "\"min_blocks\": 2}'); give it its own --name")
    ap.add_argument("--merge", action="store_true",
                    help="add this run's sections (flex: rows) to perf/results/<name>.json instead of replacing it")
    ap.add_argument("--no-fa3", action="store_true", help="skip FlashInfer's FA3 template (its first call "
                                                         "JIT-compiles for about 100 s)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's FlashAttention-3 anchor")
    ap.add_argument("--fi-paged", action="store_true", help="paged section: also FlashInfer's FA2 paged wrapper")
    ap.add_argument("--flex-lengths", help="flex lengths, comma-separated (default 512..16384; --quick 1024,4096)")
    ap.add_argument("--fa2-tunings", type=json.loads, default=None,
                    help="fa2 section: also time ours with each of these kernel shapes forced, same inputs, a JSON list "
                         "of tuning dicts (rows gain ours_us_by_tuning; outputs checked against the default's)")
    ap.add_argument("--flex-tunings", type=json.loads, default=None,
                    help="flex section: also time ours with each of these kernel shapes forced, a JSON list of tuning "
                         "dicts (rows gain ours_us_by_tuning)")
    ap.add_argument("--flex-variants", help=f"flex variants, comma-separated, of {', '.join(FLEX_VARIANTS)}")
    ap.add_argument("--compile-timeout", type=int, default=540, help="variant_compile child time limit, seconds")
    ap.add_argument("--report", metavar="JSON", help="only write the markdown table of a results JSON")
    ap.add_argument("--compile-child", metavar="OUT_JSON", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compile_child:
        variant_compile_child(a.compile_child)
        return
    if a.report:
        write_report(a.report)
        return
    sections = [x for x in a.sections.split(",") if x]
    bad = [x for x in sections if x not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; accepted: {', '.join(SECTIONS)}")
    if a.quick:
        a.rep = min(a.rep, 30)
    results = {"device": device_info(), "bars": BARS, "reference_figures": REFERENCE_FIGURES,
               "notes": ["one input set per shape: prefill is compute-bound; K/V exceed the 50 MB L2 in every shape",
                         f"correctness spot checks: relative L2 difference < {MAX_REL_DIFF} (not a substitute for tests)"]}
    runners = {"fa2": fa2_section, "paged": paged_section, "flex": flex_section, "family": family_section,
               "variant_compile": variant_compile_section}
    for name in sections:
        log(f"== {name}")
        results[name] = runners[name](a)
    old_path = RESULTS / f"{a.name}.json"
    if a.merge and old_path.is_file():
        results = _merge(json.loads(old_path.read_text()), results)
    path = write_result(a.name, results)
    md = write_report(path)
    if os.environ.get("OUT"):
        shutil.copy(md, Path(os.environ["OUT"], md.name))
    if _failures:
        log("correctness spot checks failed:\n  " + "\n  ".join(_failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
