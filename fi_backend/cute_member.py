"""The prefill family's CuTe member (issue 30, docs/prefill.md): FlashAttention-3's CTA built on CUTLASS / CuTe's SM90
atoms (csrc/attention/cute/attn_ws.cu, entry fi_cute_attn_bsr). A producer warpgroup, two consumer warpgroups of 64
query rows with the intra-warpgroup overlap, 128 x 128 tiles of one query head (steps of long prompts at head size 64:
three consumer warpgroups, 192 x 128), a persistent grid taking tiles from a counter in L2-sized sections. It reads
the step's BSR directly (pages as TMA boxes, or below GATHER_BELOW tokens rows gathered by the producer's threads; for
a ragged wrapper, BatchAttention(ragged=True), K / V rows as one TMA box a KV tile) and needs no plan items. Here
page_size 0 names ragged K / V.

BatchAttention(kernel="prefill") loads it where it applies (`unsupported` says why not: Hopper, the default, sliding
window, soft-cap or soft-cap + window variant, head size 64, 96, 128 or 256, 16-bit KV, ragged K / V or pages of
16..256 tokens (1..256 where gathered), a power of two, the CUTLASS headers) and plan() gives it the steps it runs
well (`takes_step`); every other step, and every step captured in a CUDA graph, runs the tile family as before.
On pages of 16..127 tokens, a step whose keys many queries read (stage_min_reuse) is staged: its pages copied into
contiguous rows (entry fi_cute_stage_pages of the ragged modules), then the ragged CTA runs over them
(FI_BACKEND_PREFILL_STAGE=0: never). FI_BACKEND_PREFILL_CUTE=0 turns the member off.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import env, kernels
from . import variants as V
from .variants import Variant

# The tiles the step rule counts, 128 x 128 (the CTA's are 192 rows on three warpgroups and 64 keys at head size
# 256), and the member's head sizes.
ROWS = KV_TILE = 128
HEAD_DIMS = (64, 96, 128, 256)
# Head sizes whose member also loads the CTA with three consumer warpgroups (192-row query tiles, FlashAttention-3's at
# head size 64: a KV tile's MMAs are short against its softmax), for steps whose requests average at least
# WIDE_MIN_QUERY query rows (H100, causal, 32 heads, perf/results/cute_probe_d64_wg3.json: 1 x 16k 1.09-1.12x ragged
# and 1.20x on pages of 16, 4 x 4k 0.96-1.03x, 16 x 1k 0.77-0.82x, where a 1024-row prompt leaves a third of its
# sixth tile empty)
WIDE_HEAD_DIMS = (64,)
WIDE_MIN_QUERY = 8192
# Pages below GATHER_BELOW tokens are gathered: K / V rows copied by the producer warpgroup's threads (cp.async), not
# loaded as TMA boxes (one a page and 64-dim block: 8-16 of them a KV tile at pages of 16); pages of fewer than 16
# tokens (SGLang's of one) only so. Off (0): gathering took 1.11-1.19x the boxes' time at pages of 16, and at pages of
# one 1.19-1.27x the tile family's (H100, 32/8/128, perf/results/cute_probe_gather_fast.json; docs/prefill.md)
GATHER_BELOW = 0
# Paged steps are staged (pages of STAGE_PAGES tokens: K in more TMA boxes a KV tile than ragged rows take) where each
# staged key serves at least STAGE_MIN_REUSE (query head, query row) pairs: the step's pages copied into contiguous
# rows (attn_ws.cu fi_cute_stage_pages), the ragged CTA run over them. Against the CTA on pages of 16 (H200, copy
# included, perf/results/probe_staged_{causal,full}_h200.json), head size 128: reuse 512 0.83x, 1024 0.92x, 2048
# 0.99-1.04x, 4096 1.12x, 8192 1.08-1.22x, 16384 and more 1.11-1.18x; head size 64 (probe_d64_staged_h200.json): 512
# 0.94x, 2048 1.12-1.15x, 8192 and more 1.18-1.20x; head size 256 (probe_d256_staged_h200.json) as 128.
# Pages of 32 cost less (K in half the boxes): 2048 0.93-0.99x, 8192 1.01-1.05x, 32768 1.05x. So the bound is
# STAGE_MIN_REUSE at head size 128 on pages of 16, scaled by STAGE_REUSE_SCALE at other head sizes and by the page
# size over 16. At most STAGE_BYTES of K and V rows a wrapper (made by its first staged step, grown with larger
# ones); steps of more rows read their pages.
STAGE_PAGES = range(16, 128)
STAGE_MIN_REUSE = 3072
STAGE_REUSE_SCALE = {64: 1 / 3}
STAGE_BYTES = 256 << 20


# At these (head size, paged) pairs the consumer warpgroups issue their MMAs in turns (attn_ws.cu PINGPONG) and a
# row keeps its maximum until a KV tile's exceeds it by more than 2^8, O rescaled only where a warp's rows moved
# (LAZY). Against the plain overlap on the H200 (docs/prefill.md "Ping-pong, lazy rescale and page-id prefetch,
# measured"): at head size 128 on pages of 16 1-6% faster in all 12 cells, causal or not, ragged level
# (perf/results/probe_{causal,full}_pp_h200.json); at head size 64 on pages of 16 0-4% faster on two and three
# warpgroups, ragged 1-4% slower (causal, perf/results/probe_d64_pp_h200.json); at head size 256 1-5% faster ragged
# and 3-6% on pages of 16 (causal, 32/8 and 32/32, probe_d256_staged_h200.json). Head size 96 is not measured.
PINGPONG_LAZY = ((128, False), (128, True), (64, True), (256, False), (256, True))


def schedule(head_dim: int, paged: bool) -> tuple:
    """(ping-pong, lazy O rescale) of the member's modules at this head size, on pages or ragged K / V."""
    on = (head_dim, bool(paged)) in PINGPONG_LAZY
    return on, on


# A sliding window narrower than WINDOW_MIN_KEYS keys (and than the step's longest KV) leaves the step to the tile
# family: a window of 1024 keys on pages of 16 ran 0.94-0.96x the family (H200, 32/8/128, 16x1k / 4x4k / 1x16k,
# perf/results/flex_member_h200.json). 2048 (16 KV tiles a query tile) is where causal steps turn the member's way
# (4x4k: 1.04x), not a measured window.
WINDOW_MIN_KEYS = 2048


def gathers(page_size: int) -> bool:
    """Whether the member gathers K / V rows at this page size (else TMA boxes)."""
    return page_size < GATHER_BELOW


# A step goes to the member where it has at least MIN_TILES_PER_SM work tiles an SM: a 128-row prompt's 32 heads
# (32 tiles) ran 0.83-0.91x the tile family, whose KV splits use the idle SMs, but 256 and 512 rows (64 and 128
# tiles) 1.33-1.85x (H100, page 16, heads 32/8, 32/32, 28/4: perf/results/member_steps_*.json) ...
MIN_TILES_PER_SM = 0.4
# ... and where requests of fewer than SHORT_QUERY rows (decode rows of a mixed step: each takes a whole 128-row tile
# a query head, GQA not packed) cost at most SHORT_SHARE of its tile pairs. Without GQA (one query head a KV head)
# the tile family packs no heads either, and the member ran such steps 1.19-1.30x faster (H200, 32/32/128, 1 x 2048
# over 8192 + 16..256 decode rows; with 8 or 7 query heads a KV head 0.28-0.75x: perf/results/member_steps_h200.json).
SHORT_QUERY = 64
SHORT_SHARE = 0.1
# KV of (request, head) pairs a tile section spans: the CTAs at work at once read it from L2 (32 MB beat one KV head
# in 5 of 6 cells, docs/prefill.md "Measured").
L2_SECTION_BYTES = 32 << 20
CAPTURE_REFUSED = -2  # fi_cute_attn_bsr's code for a capturing stream (the launch holds the step's sizes)


# The variants the member computes, as the built-ins define them (a window: its KV tiles skipped and masked in the CTA;
# a soft-cap: a template parameter), by their variant: soft-cap or not
VARIANTS = ((V.DEFAULT, False), (V.SLIDING_WINDOW, False), (V.SOFT_CAP, True),
            (V.BUILTIN_VARIANTS["soft_cap_window"], True))


def _supported(variant: Variant) -> bool:
    return any(variant == v for v, _ in VARIANTS)


def _softcap(variant: Variant) -> bool:
    return next(cap for v, cap in VARIANTS if variant == v)


def unsupported(variant: Variant, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int,
                device: Optional[torch.device] = None, *, deterministic: bool = False,
                tuning: Optional[dict] = None) -> Optional[str]:
    """Why a prefill wrapper of these arguments does not load the member (None: it does). device None: whether a
    build for the architectures in effect ($FI_BACKEND_CUDA_ARCH_LIST) would (models.modules_of)."""
    if not env.flag(env.PREFILL_CUTE, True):
        return f"{env.PREFILL_CUTE}=0"
    if tuning is not None:
        return "a tuning override (benchmarks) names the tile family's shape"
    if deterministic:
        return "deterministic plans keep tile member 0"
    if not _supported(variant):
        names = ", ".join(sorted(v.name for v, _ in VARIANTS))
        return f"variant {variant.name} (the member runs {names}; other hooks need the tile family)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the member runs {HEAD_DIMS})"
    if q_dtype not in (torch.bfloat16, torch.float16) or kv_dtype != q_dtype:
        return f"KV dtype {kv_dtype} (the member reads 16-bit KV of the query's dtype)"
    if page_size != 0 and (page_size < 1 or page_size > 256 or page_size & (page_size - 1)
                           or (page_size < 16 and not gathers(page_size))):
        least = 1 if gathers(1) else 16
        return (f"page_size {page_size} (the member takes ragged K / V, a BatchAttention made with ragged=True, or "
                f"pages of {least}..256 tokens, a power of two)")
    if device is not None and (device.type != "cuda" or not torch.cuda.is_available()
                               or torch.cuda.get_device_capability(device) != (9, 0)):
        return "not an sm_90 GPU"
    from .shapes import prefill_uses_wgmma
    if not prefill_uses_wgmma():
        return f"modules are not built for sm_90a alone (${env.CUDA_ARCH_LIST})"
    try:
        from .kernels import cutlass
        cutlass.include_dir()
    except Exception as e:  # CutlassNotFound: the wheel is not installed
        return str(e)
    return None


def stages(page_size: int, head_dim: int) -> bool:
    """Whether the member stages steps on pages of this size (some: stage_min_reuse) into rows for its ragged CTA:
    pages shorter than its KV tile (64 keys at head size 256), where K takes more TMA boxes a tile than rows do."""
    return (page_size in STAGE_PAGES and page_size < (64 if head_dim == 256 else 128) and not gathers(page_size)
            and STAGE_BYTES > 0 and env.flag(env.PREFILL_STAGE, True))


def specs(head_dim: int, q_dtype: torch.dtype, page_size: int, variant: Variant = V.DEFAULT) -> list:
    """The member's modules for a variant it computes: non-causal and causal, then (WIDE_HEAD_DIMS) the same with
    three consumer warpgroups; where it stages pages (`stages`), the same list again for ragged K / V."""
    from .kernels import cutlass
    dtype = "bf16" if q_dtype == torch.bfloat16 else "fp16"

    def of(page):
        pingpong, lazy = schedule(head_dim, page > 0)
        return [cutlass.attn_ws_spec(head_dim, causal, overlap=True, pingpong=pingpong, page_size=page, dtype=dtype,
                                     softcap=_softcap(variant), warpgroups=wgs, gather=page > 0 and gathers(page),
                                     lazy=lazy)
                for wgs in ((2, 3) if head_dim in WIDE_HEAD_DIMS else (2,)) for causal in (False, True)]
    return of(page_size) + (of(0) if stages(page_size, head_dim) else [])


def stage_min_reuse(head_dim: int, page_size: int) -> float:
    """The reuse (stage_reuse) from which the member stages a step's pages of this size at this head size."""
    return STAGE_MIN_REUSE * STAGE_REUSE_SCALE.get(head_dim, 1) * page_size / 16


def stage_pages(q_lens: torch.Tensor, kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pages staged for each request (int64 CPU [B]): all of its KV's, none for a request without query rows."""
    return torch.where(q_lens > 0, (kv_lens + page_size - 1) // page_size, torch.zeros_like(kv_lens))


def stage_reuse(q_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool, group: int, page_size: int,
                window_left: int = -1) -> float:
    """(query head, query row) pairs a staged key serves in a step of these lengths (int64 CPU [B]): group x the
    step's (query, key) pairs over its staged rows (stage_pages' whole pages). Causal: row i of a request sees
    kv - q + 1 + i keys, at most window_left + 1 with a window; not causal: every key, or window_left + 1."""
    if causal:
        first = kv_lens - q_lens + 1  # keys of each request's first row
        if window_left >= 0:
            w = window_left + 1
            m = (w - first + 1).clamp(min=0).minimum(q_lens)  # rows below the window's width
            pairs = m * first + m * (m - 1) // 2 + (q_lens - m) * w
        else:
            pairs = q_lens * first + q_lens * (q_lens - 1) // 2
    else:
        pairs = q_lens * (kv_lens if window_left < 0 else kv_lens.clamp(max=window_left + 1))
    rows = int(stage_pages(q_lens, kv_lens, page_size).sum()) * page_size
    return group * int(pairs.sum()) / max(1, rows)


def specs_for(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, page_size: int, *,
              deterministic: bool = False, device: Optional[torch.device] = None) -> list:
    """The member's modules that a prefill wrapper of these arguments loads ([] where it loads none), by the kernels'
    dtype names ("bf16", "fp16", "fp8_e4m3", ...); device None: on an H100 (ahead-of-time builds)."""
    names = {"bf16": torch.bfloat16, "fp16": torch.float16}
    q, kv = names.get(q_dtype), names.get(kv_dtype)
    if q is None or kv is None or unsupported(variant, head_dim, q, kv, page_size, device,
                                              deterministic=deterministic) is not None:
        return []
    return specs(head_dim, q, page_size, variant)


class CuteMember:
    """The member's modules (non-causal, causal; at WIDE_HEAD_DIMS those of three warpgroups too), its tile counter,
    and the step rule."""

    def __init__(self, head_dim: int, q_dtype: torch.dtype, page_size: int, num_qo_heads: int, num_kv_heads: int,
                 device: torch.device, variant: Variant = V.DEFAULT):
        self.modules = [kernels.load(s) for s in specs(head_dim, q_dtype, page_size, variant)]
        from .kernels.cutlass import ATTN_BSR_ARGS, STAGE_PAGES_ARGS
        fns = [m.function("fi_cute_attn_bsr", ATTN_BSR_ARGS) for m in self.modules]
        staging = stages(page_size, head_dim)
        # on pages: the paged modules', then (staging) the ragged modules' entries
        self._fns, self._staged_fns = (fns[:len(fns) // 2], fns[len(fns) // 2:]) if staging else (fns, [])
        self.softcap = _softcap(variant)
        self.heads, self.kv_heads, self.wide = num_qo_heads, num_kv_heads, head_dim in WIDE_HEAD_DIMS
        self.head_dim, self.page, self._dtype = head_dim, page_size, q_dtype
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)  # zeroed by each launch, on its stream
        # (module: causal + 2 x wide, batch, max_q_len, total_q, total_kv, window_left, soft-cap) planned, or None
        self._step = None
        # Staging: at most _stage_rows K and V rows, [2, rows, kv_heads, D] made by the first step staged and grown
        # by a larger one (a wrapper that never stages holds none); each request's first staged row (pinned host,
        # device; copied asynchronously by plan(), which waits for the last copy before rewriting the host's); the
        # planned step's staged page count (None: it reads its pages)
        self._stage_kv = self._stage_fn = None
        self._stage_rows = STAGE_BYTES // (2 * num_kv_heads * head_dim * 2) // page_size * page_size if staging else 0
        self._start_host = self._start_dev = self._start_copied = None
        self._start_pending = False
        self._staged = None
        if staging:
            self._stage_fn = self.modules[len(fns) // 2].function("fi_cute_stage_pages", STAGE_PAGES_ARGS)

    @property
    def module_names(self) -> list:
        return [m.name for m in self.modules]

    def takes_step(self, q_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool, window_left: int = -1) -> bool:
        """Whether the member runs a step of these query / KV lengths (CPU int32 [B]; no per-request Python):
        every request's KV covers its queries (at least one key), its tiles fill the GPU (MIN_TILES_PER_SM), short
        requests cost at most SHORT_SHARE of its tile pairs (with GQA), and a sliding window (window_left >= 0) is
        at least WINDOW_MIN_KEYS keys wide or covers every request's KV."""
        if q_lens.numel() == 0:
            return False
        q, kv = q_lens.to(torch.int64), kv_lens.to(torch.int64)
        if 0 <= window_left < WINDOW_MIN_KEYS - 1 and window_left + 1 < int(kv.max()):
            return False
        live = q > 0
        need = torch.where(live, q.clamp(min=1) if causal else torch.ones_like(q), torch.zeros_like(q))
        if bool((kv < need).any()):
            return False
        q_tiles = (q + ROWS - 1) // ROWS
        if int(q_tiles.sum()) * self.heads < MIN_TILES_PER_SM * self.sms:
            return False
        if self.heads == self.kv_heads:
            return True
        pairs = q_tiles * ((kv + KV_TILE - 1) // KV_TILE)
        short = int(pairs[live & (q < SHORT_QUERY)].sum())
        return short <= SHORT_SHARE * int(pairs.sum())

    def plan(self, q_lens: Optional[torch.Tensor], kv_lens: Optional[torch.Tensor], causal: bool,
             allowed: bool = True, window_left: int = -1, logits_soft_cap: float = 0.0) -> bool:
        """plan()'s part: remember the step's sizes and the variant's scalars (window_left: -1 none; the soft-cap
        of a soft-capping variant) where the member takes the step (allowed, and takes_step); whether it does.
        Not allowed: forget the last step's (the lengths may be None)."""
        self._step = None
        if (not allowed or (self.softcap and not logits_soft_cap > 0)
                or not self.takes_step(q_lens, kv_lens, causal, int(window_left))):
            return False
        total_q, live = int(q_lens.sum()), int((q_lens > 0).sum())
        wide = self.wide and total_q >= WIDE_MIN_QUERY * live  # the modules of three warpgroups: 2, 3
        self._step = (int(bool(causal)) + 2 * wide, q_lens.numel(), int(q_lens.max()), total_q, int(kv_lens.sum()),
                      max(-1, int(window_left)), float(logits_soft_cap))
        self._staged = None
        if self._stage_rows:
            q, kv = q_lens.to(torch.int64), kv_lens.to(torch.int64)
            pages = stage_pages(q, kv, self.page)
            staged = int(pages.sum())
            if (staged * self.page <= self._stage_rows
                    and stage_reuse(q, kv, causal, self.heads // self.kv_heads, self.page, int(window_left))
                    >= stage_min_reuse(self.head_dim, self.page)
                    and self._stage_room(staged * self.page)):
                self._plan_starts(pages)
                self._staged = staged
        return True

    def _stage_room(self, rows: int) -> bool:
        """Whether the staging rows hold `rows` (made or grown here: a power of two from 4096 rows up, at most
        _stage_rows); a device out of memory turns staging off for this wrapper, with a warning."""
        if self._stage_kv is not None and self._stage_kv.shape[1] >= rows:
            return True
        size = min(self._stage_rows, max(4096, 1 << (rows - 1).bit_length()))
        self._stage_kv = None
        try:
            self._stage_kv = torch.empty((2, size, self.kv_heads, self.head_dim), dtype=self._dtype,
                                         device=self.counter.device)
        except torch.OutOfMemoryError:
            self._stage_rows = 0
            warnings.warn(f"fi-backend: no device memory for the CuTe member's staging rows ({size} rows); its steps "
                          f"read their pages from now on")
            return False
        return True

    def _plan_starts(self, pages: torch.Tensor) -> None:
        """Each request's first staged row (page counts' prefix sum x page size) into the device buffer, by an
        asynchronous copy on the current stream from pinned memory; the buffers grow (only) for a larger batch."""
        n = pages.numel() + 1
        dev = self.counter.device
        if self._start_dev is None or self._start_dev.numel() < n:
            size = max(256, 1 << (n - 1).bit_length())
            self._start_host = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._start_dev = torch.empty(size, dtype=torch.int32, device=dev)
            self._start_copied, self._start_pending = torch.cuda.Event(), False
        elif self._start_pending:
            self._start_copied.synchronize()  # the last copy may still read the host buffer
        host = self._start_host[:n]
        host[0] = 0
        host[1:] = torch.cumsum(pages * self.page, 0)
        self._start_dev[:n].copy_(host, non_blocking=True)
        self._start_copied.record(torch.cuda.current_stream(dev))
        self._start_pending = True

    @property
    def planned(self) -> bool:
        return self._step is not None

    def launch(self, p, v_strides: tuple, stream: int) -> int:
        """The planned step on the BatchAttention's Params `p` (its q / out / lse / KV / BSR fields, as run() set
        them; V by v_strides, (block, token, head)): 0, CAPTURE_REFUSED, or a CUDA error code."""
        module, batch, max_q, total_q, total_kv, window, cap = self._step
        if self._staged is not None:
            return self._launch_staged(p, v_strides, stream)
        return self._fns[module](
            p.q, p.out, p.lse, p.k, p.v, p.qo_indptr, p.kv_lens, p.kv_indices, p.kv_block_start,
            self.counter.data_ptr(), p.error_flags, p.num_kv_indices, p.q_stride_row, p.q_stride_head,
            p.out_stride_row, p.out_stride_head, p.lse_stride_row, p.kv_stride_block, p.kv_stride_token,
            p.kv_stride_head, *v_strides, p.num_kv_blocks, p.kv_block_start_int64, batch, max_q, self.heads,
            self.kv_heads, total_q, total_kv, L2_SECTION_BYTES, window, p.logits_scale, cap, stream)

    @property
    def staged(self) -> bool:
        """Whether the planned step's pages are staged into rows for the ragged CTA."""
        return self._step is not None and self._staged is not None

    def _launch_staged(self, p, v_strides: tuple, stream: int) -> int:
        """The planned step's pages copied into the staging rows, then the ragged CTA over them (request b's keys
        at rows _start_dev[b] ..): 0, CAPTURE_REFUSED or a CUDA error code."""
        module, batch, max_q, total_q, total_kv, window, cap = self._step
        kp, vp = self._stage_kv[0].data_ptr(), self._stage_kv[1].data_ptr()
        starts = self._start_dev.data_ptr()
        rc = self._stage_fn(p.k, p.v, kp, vp, p.kv_lens, p.kv_indices, p.kv_block_start, starts, p.error_flags,
                            p.num_kv_indices, p.num_kv_blocks, p.kv_stride_block, p.kv_stride_token, p.kv_stride_head,
                            *v_strides, p.kv_block_start_int64, batch, self.kv_heads, self.page, self._staged, stream)
        if rc:
            return rc
        row = self.kv_heads * self.head_dim
        return self._staged_fns[module](
            p.q, p.out, p.lse, kp, vp, p.qo_indptr, p.kv_lens, p.kv_indices, starts,
            self.counter.data_ptr(), p.error_flags, p.num_kv_indices, p.q_stride_row, p.q_stride_head,
            p.out_stride_row, p.out_stride_head, p.lse_stride_row, row, row, self.head_dim, row, row, self.head_dim,
            self._staged * self.page, 0, batch, max_q, self.heads, self.kv_heads, total_q, total_kv,
            L2_SECTION_BYTES, window, p.logits_scale, cap, stream)

    def release_staging(self) -> None:
        """Give back the staging rows and stage no more (a wrapper a CUDA graph froze to the tile family)."""
        self._stage_kv, self._stage_rows, self._staged = None, 0, None

    def check(self, rc: int) -> None:
        self.modules[0].check(rc, "fi_cute_stage_pages + fi_cute_attn_bsr" if self.staged else "fi_cute_attn_bsr")
