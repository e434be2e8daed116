"""Plan/run wrappers (the FlashInfer paper's API shape): plan() once per generation step, run() per layer.

    ws = Workspace(device, max_requests=..., max_tokens=..., num_ctas=BatchAttention.recommended_num_ctas(...),
                   max_tile_q=16, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    attn = BatchAttention(ws, 32, 8, 128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=16)
    attn.plan(qo_indptr_cpu, kv_lens_cpu, bsr)             # once per step (bsr: fi_backend.formats.BSR)
    out = attn.run(q, kv_cache)                            # once per layer; CUDA-graph capturable

The kernel (csrc/attention/decode.cuh) is persistent with a fixed grid (workspace.num_ctas CTAs, all
the GPU's: each work item names its unit, a KV head and a chunk of its query heads, so every CTA serves
every head) and reads everything that depends on the step from device memory: the
plan section of the workspace and the BSR arrays. So a run() captured in a CUDA graph replays
correctly after plan() is called again with other lengths or a smaller batch, provided the BSR arrays
keep their storage (write the new step's indices into the same tensors, as engines do) and plan()
keeps the same scalar settings (causal, sm_scale, variant scalars): both are checked.

KV cache layouts, addressed by strides (no copies):
  * one tensor with K and V packed in the last dim, 2 * head_dim: vLLM-style
    [num_blocks, page_size, num_kv_heads, 2 D] ("NHD") or [num_blocks, num_kv_heads, page_size, 2 D] ("HND");
  * a (k, v) pair of [num_blocks, page_size, num_kv_heads, D] ("NHD") / [num_blocks, num_kv_heads,
    page_size, D] ("HND") views (e.g. kv[:, 0], kv[:, 1] of FlashInfer's 5-D layout), or of
    [num_slots, num_kv_heads, D] (SGLang's k_buffer / v_buffer, page_size 1).
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from . import env, kernels
from .formats import BSR
from .kv_cache import parse_cached
from .scheduler import DETERMINISTIC_MIN_CHUNK, DETERMINISTIC_PIECES
from .kernels.sets import module_set
from .variants import DEFAULT, PARAM_TYPES, Variant, VariantError
from .workspace import Workspace

__all__ = ["BatchAttention", "decode_spec", "prefill_spec", "KERNELS", "HEAD_DIMS", "Q_DTYPES", "KV_DTYPES"]

HEAD_DIMS = (64, 80, 96, 128, 256)
Q_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
KV_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8_e4m3",
                    torch.float8_e5m2: "fp8_e5m2"}
MAX_PAGE_SIZE = 256
_C_TYPE = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp8_e4m3": "__nv_fp8_e4m3", "fp8_e5m2": "__nv_fp8_e5m2"}

# Error bits of the kernel's error word (csrc/attention/decode.cuh, ErrorBits).
_ERROR_BITS = {
    1: "a KV block index (kv_indices entry) outside [0, num_kv_blocks) was met; those tokens were read as zeros",
    2: "kv_block_start + block offset pointed past the end of kv_indices; those tokens were read as zeros",
}


# ------------------------------------------------------------------------------------ kernel config

# Measured on the H100 (perf notes in the module docstring of csrc/attention/decode.cuh): warps per
# CTA, 16-token blocks per warp per tile, pipeline stages, by (head_dim, KV bytes per element).
# Variants with a KeyTransform (RoPE) do more work per tile and prefer two 4-warp CTAs per SM.
_SHAPES = {
    (64, 2): (4, 2, 3), (64, 1): (4, 4, 3),
    (128, 2): (8, 1, 3), (128, 1): (4, 2, 3),
    (256, 2): (4, 1, 3), (256, 1): (4, 1, 3),
}
_SHAPES_KEY_TRANSFORM = {(128, 2): (4, 1, 3)}
SMEM_PER_SM = 228 * 1024   # Hopper; 227 KiB per CTA at most
SMEM_PER_CTA = 227 * 1024


def _row_dim(head_dim: int) -> int:
    """The width of the kernels' shared-memory rows for a head size: whole 64-column blocks (80 and 96 run in
    128-wide rows, their pad never loaded from memory), so tile shapes and shared memory go by it."""
    return (head_dim + 63) // 64 * 64


def _check_head_dim(head_dim: int, variant: Variant) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if head_dim != _row_dim(head_dim) and (variant.query_transform or variant.key_transform):
        raise ValueError(f"variant {variant.name}: fused rotary transforms (query_transform / key_transform) need "
                         f"head_dim 64, 128 or 256, got {head_dim}; apply RoPE before attention")


def _kernel_shape(head_dim: int, kv_bytes: int, group: int, key_transform: bool = False) -> dict:
    """Kernel shape for a head_dim, KV element size and GQA group: rows (packed rows per tile),
    hpc (query heads per chunk), warps, sub (16-token blocks per warp per tile), stages.

    Heads per chunk: the largest divisor of the group that fits a 16-row tile (8 rows for head_dim
    256, where 16 rows exceed the register file); 8-row tiles when the chunk fits (half the P.V work).
    Warps / tile / stages from _SHAPES: about 8 warps per SM with two ~64 KiB tiles in flight."""
    head_dim = _row_dim(head_dim)
    max_rows = 8 if head_dim == 256 else 16
    hpc = max(d for d in range(1, min(group, max_rows) + 1) if group % d == 0)
    rows = 8 if hpc <= 8 else 16
    warps, sub, stages = (_SHAPES_KEY_TRANSFORM if key_transform else {}).get((head_dim, kv_bytes),
                                                                           _SHAPES[(head_dim, kv_bytes)])
    return {"rows": rows, "hpc": hpc, "warps": warps, "sub": sub, "stages": stages}


def _smem_bytes(head_dim: int, kv_bytes: int, shape: dict) -> int:
    """Shared memory of a kernel shape; mirrors Config::kSmemBytes (decode.cuh)."""
    head_dim = _row_dim(head_dim)
    record = 80
    stage = 2 * 16 * shape["sub"] * shape["warps"] * head_dim * kv_bytes + shape["rows"] * head_dim * 2 + record
    stage = (stage + 127) // 128 * 128
    row_offsets = 2 * 16 * shape["sub"] * shape["warps"] * 8  # the loader's published row offsets, two tiles
    return shape["stages"] * stage + shape["warps"] * shape["rows"] * 8 + 16 + row_offsets


def _blocks_by_smem(head_dim: int, kv_bytes: int, shape: dict) -> int:
    """CTAs per SM that the kernel's shared memory allows (1 KiB reserved per CTA)."""
    return max(1, min(4, SMEM_PER_SM // (_smem_bytes(head_dim, kv_bytes, shape) + 1024)))


def decode_spec(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int, *,
                tuning: Optional[dict] = None) -> kernels.ModuleSpec:
    """The JIT module of the decode kernel for one (variant, head_dim, dtypes, GQA group).

    tuning (benchmarks): overrides of warps / sub / stages, and l2_prefetch (0, 64, 128, 256 bytes)
    / index_ahead (tiles) compiled in as FI_DECODE_L2_PREFETCH / FI_DECODE_INDEX_AHEAD."""
    _check_head_dim(head_dim, variant)
    kv_bytes = 1 if kv_dtype.startswith("fp8") else 2
    shape = _kernel_shape(head_dim, kv_bytes, group, key_transform=bool(variant.key_transform))
    tuning = dict(tuning or {})
    flags, suffix = [], ""
    if "l2_prefetch" in tuning:
        flags.append(f"-DFI_DECODE_L2_PREFETCH={int(tuning['l2_prefetch'])}")
        suffix += f"_l2{int(tuning.pop('l2_prefetch'))}"
    if "index_ahead" in tuning:
        flags.append(f"-DFI_DECODE_INDEX_AHEAD={int(tuning['index_ahead'])}")
        suffix += f"_ia{int(tuning.pop('index_ahead'))}"
    unknown = set(tuning) - {"warps", "sub", "stages"}
    if unknown:
        raise ValueError(f"unknown decode tuning keys {sorted(unknown)}")
    shape.update(tuning)
    smem = _smem_bytes(head_dim, kv_bytes, shape)
    if smem > SMEM_PER_CTA:
        raise ValueError(f"decode kernel shape {shape} for head_dim {head_dim} needs {smem} bytes of shared memory; "
                         f"a CTA may use at most {SMEM_PER_CTA}")
    config = ", ".join([str(head_dim), str(shape["rows"]), str(shape["hpc"]), _C_TYPE[q_dtype], _C_TYPE[kv_dtype],
                        str(shape["warps"]), str(shape["stages"]), str(shape["sub"])])
    tag = f"{variant.name}_{q_dtype}_{kv_dtype}_d{head_dim}_r{shape['rows']}_h{shape['hpc']}"
    if tuning or flags:
        tag += "_w{warps}s{stages}k{sub}".format(**shape) + suffix
    return _attention_spec("decode", variant, config, _blocks_by_smem(head_dim, kv_bytes, shape), tag, flags)


# Prefill (csrc/attention/prefill.cuh): warps, m fragments (16 packed query rows) per warp, KV tokens
# per stage, stages, KV tokens per compute step, by (head_dim, KV bytes per element). Measured on the
# H100 (causal 16x1k / 4x4k / 1x16k, 32 heads, D 128, ratio to FlashInfer's FA2 in the same process,
# with one page lookup per KV row): 8 warps x 2 fragments (256-row query tiles), 64-token tiles, 2
# stages 0.64 / 0.78 / 0.83; the same with 32-token compute steps 0.58 / 0.66 / 0.72, with 128-token
# tiles 0.58 / 0.69 / 0.80; 4 x 2 with 2 CTAs per SM 0.59 / 0.70 / 0.78; 8 x 1, 3 stages 0.61 / 0.64 / 0.65.
# Two fragments per warp halve the shared-memory reads per MMA (each K/V fragment feeds both).
# A family per head_dim, largest query tile first; plan() picks per step (_pick_member): the largest tile
# that gives every CTA FAMILY_TILES_PER_CTA query tiles, or whole waves of tiles (at most
# FAMILY_WAVE_SLACK more tile slots than tiles), else the smallest. Measured with the Hopper family at
# 32/8 heads, 16 CTAs per KV head (perf/results/prefill_h100.md, us, 256-row vs 128-row tiles, tiles of
# 256 rows per KV head): 1x2048 113 vs 143 (32 tiles: two whole waves), 16x128 36 vs 40 (32), 8x300
# 67 vs 62 (40: 2.5 waves), 1x1291 85 vs 87 (21), 1x512 39 vs 32 (8), 64x64 62 vs 73 (64), 4x1291 219
# vs 258 (84), 2x4096 769 vs 996 (128).
_PREFILL_SHAPES_SYNC = {
    (64, 2): [(8, 1, 64, 3, 64)], (64, 1): [(8, 1, 64, 3, 64)],
    (128, 2): [(8, 2, 64, 2, 64), (8, 1, 64, 3, 64)], (128, 1): [(8, 2, 64, 2, 64), (8, 1, 64, 3, 64)],
    (256, 2): [(4, 1, 32, 2, 32)], (256, 1): [(4, 1, 32, 2, 32)],
}
# Hopper (modules built for sm_90a only, prefill_uses_wgmma): warpgroup MMAs, the same tuple fields; a
# fragment is one m64 MMA of a warpgroup (64 rows), compute steps of 32 tokens at least (the MMA's n).
# Measured on the H100 as above (32/32 and 32/8 heads): 16 warps x 1 fragment, 64-token tiles, 2 stages
# 0.85 / 0.94 / 1.07 and 0.83 / 1.03 / 1.06; 8 x 2 (one fragment's softmax overlapping the other's MMAs)
# 0.79 / 0.94 / 1.05 and 0.77 / 1.01 / 1.07; 16 x 1 with 32-token steps 0.79 / 0.85 / 0.92; 12 x 1, 3
# stages 0.74 / 0.88 / 0.97; 8 x 1 with 128-token tiles 0.60 / 0.61 / 0.84, with 64-token tiles and 3
# stages 0.71 / 0.77 / 0.82; 4 x 2 with 2 CTAs per SM 0.70 / 0.84 / 0.95. Sixteen warps hide the
# latency of each warpgroup's MMA -> softmax -> MMA chain; they leave 128 registers a thread.
_PREFILL_SHAPES_WGMMA = {
    (64, 2): [(16, 1, 64, 2, 64)], (64, 1): [(16, 1, 64, 2, 64)],
    (128, 2): [(16, 1, 64, 2, 64), (8, 1, 64, 3, 64)], (128, 1): [(16, 1, 64, 2, 64), (8, 1, 64, 3, 64)],
    (256, 2): [(8, 1, 64, 2, 64)], (256, 1): [(8, 1, 64, 2, 64)],
}
# Variants with per-logit hooks spill 150-600 bytes in 128 registers (perf/ptxas.py) and are still faster
# with 16 warps than with 8 x 2 (16x1k / 16x4k, 16 heads): soft-cap 438 / 4236 us vs 491 / 4447, sigmoid
# 479 / 5503 vs 668 / 8164, ALiBi 372 / 3937 vs 400 / 4032, ALiBi + window 432 / 2723 vs 475 / 3006.
# ptxas also reports its wgmma serialized for lack of registers (warning C7512) with window, ALiBi, RoPE
# and fp8 KV at 16 warps: window and ALiBi measured faster there anyway; RoPE and fp8 KV were not timed
# against 8 x 2. 128-row tiles at two CTAs per SM (8 x 1, min_blocks 2) measured slower than 16 x 1:
# 0.854 / 0.954 / 0.990 of FA2 against 0.915 / 1.050 / 0.956 in one run (perf/results/prefill_b2.json).
# The pick rule (FAMILY_*) was re-timed at b105cd5: every pick within 3% of the fastest member.
# Where the rest of the gap to FA2 at 16x1k / 4x4k is (at dea4f06: 32/32 heads 0.91 / 0.99, 32/8 0.89 /
# 0.98; 1.03-1.05 at 1x16k): at 32/32, causal sub-item k of 256 rows gives the four warpgroups 4k+1 ..
# 4k+4 steps and the CTA barrier per KV tile makes each wait for the longest (busy fraction 85% / 95.6% /
# 98.8% at 1k / 4k / 16k). At 32/8 a warpgroup's 64 packed rows are 16 query rows of 4 heads, all four
# warpgroups take the same steps, and the gap is about the same: so per-sub-item costs (the epilogue,
# the masked diagonal tile, the pipeline's turn between sub-items) weigh as much as that idle at 1k.
# Warpgroups that consume tiles at their own pace (per-stage full / empty barriers, a producer warpgroup,
# as FA3 does) came next: _PREFILL_WS_MEMBER0 below. Grids used 128 of the 132 SMs while work queues were per KV
# head (132 // 8 = 16 CTAs each); items now name their unit and the grid is all 132 CTAs: 132 vs 128
# CTAs in one run (perf.sm_scaling, perf/results/sm_scaling.json) 16x1k 516 vs 529 us, 4x4k 1506 vs
# 1532 us, decode batch 256 x 16k 5671 vs 5672 us (memory-bound: no change).
PLAN_GROUPED_MIN_KV = 4096  # see BatchAttention.__init__ (_group_requests)
FAMILY_TILES_PER_CTA = 3
FAMILY_WAVE_SLACK = 1.1
PREFILL_MAX_HEADS_PER_CHUNK = 16


# A sliding window (mask_is_kv_range) runs its largest Hopper member at 12 warps (168 registers a thread:
# no spills, no wgmma serialisation) with the query copy: FlexAttention quick at 16 heads, 16x1k / 16x4k,
# 360 / 2058 us against 385 / 2337 at 16 warps (perf/results/prefill_variant_shapes.json). ALiBi and
# soft-cap measured no better there (ALiBi 357 / 3900 vs 362 / 3855, soft-cap 425 / 4327 vs 432 / 4150).
_PREFILL_SHAPES_WGMMA_WINDOW = {
    (128, 2): [(12, 1, 64, 2, 64), (8, 1, 64, 3, 64)], (128, 1): [(12, 1, 64, 2, 64), (8, 1, 64, 3, 64)],
}


# Warp-specialised member 0 (producer=1, prefill::Config::kProducer: a producer warpgroup issues the tiles,
# the compute warpgroups consume them through mbarriers at their own pace, registers moved to them) for
# the variants that can run it (16-bit KV, no QueryTransform / KeyTransform, heads per chunk dividing the
# producer's query rows per copy round). Same process, same inputs (perf/results/prefill_ws_ab.json,
# prefill_ws_flex.json at c0694a2, H100), us or ratio to FlashInfer's FA2:
#   no logits hooks: 8 compute warps x 2 fragments (256-row tiles, 232 registers) against 16 x 1 without a
#     producer: 32/32 heads 16x1k / 4x4k / 1x16k 0.939 / 1.041 / 1.118 vs 0.895 / 1.005 / 1.065, 32/8
#     0.992 / 1.181 / 1.246 vs 0.877 / 0.990 / 1.071; 12 x 1 0.845 / 0.943 / 1.094 and 0.913 / 1.143 / 1.253;
#     8 x 1 (128-row tiles, 3 stages) 0.776 / 0.792 / 1.035.
#   logits hooks (soft-cap, ALiBi, window; 16 heads 16x1k / 16x4k): 12 x 1 (192-row tiles, 152 registers)
#     soft-cap 327 / 3442 us, ALiBi 316 / 3406, window 307 / 1713 against 432 / 4076, 365 / 3741, 373 / 2135
#     without a producer and 432 / 3968, 354 / 3619, 389 / 2483 at 8 x 2.
#   After the compute step became one copy (no wgmma serialisation) and the query buffers left the stages
#   (perf/results/prefill_ab21.md, prefill_flex21.md at 1e66a28): 8 x 2 with 3 stages against 2, 32/32
#   16x1k / 4x4k / 1x16k 484 / 1313 / 5107 vs 494 / 1293 / 4900 us, 32/8 417 / 1219 / 4613 vs 427 / 1217 /
#   4686; 12 x 1 with logits hooks, 3 stages against 2 (16x1k / 16x4k): soft-cap 307 / 3187 vs 327 / 3402,
#   ALiBi 296 / 3090 vs 316 / 3416, window 284 / 1506 vs 307 / 1702 (4 stages: 303 / 3376, 294 / 3291,
#   283 / 1511).
#   At 67bb9b4 (per-row mask intervals, LogitsCtx::rel_pos), flex quick, same run (prefill_h100_quick_eeba742.md):
#   the sliding window at 8 x 2 224.6 / 1308 us (16 heads, 16x1k / 16x4k) against 240.3 / 1406 at 12 x 1, so a
#   mask that is the KV range ran the plain shape; ALiBi 254.8 / 2792 vs 251.5 / 2819 (even), soft-cap 324.0 /
#   3240 vs 265.3 / 2898 (its tanh: 12 x 1 stays for logits transforms and other masks).
#   Not any more for the window (since the row sums by MMA and the window's plan cost; perf/results/ab47w_*.md,
#   two runs, same process, 16 heads 16x1k / 4k / 8k / 16k): 12 x 1 205.6 / 1269 / 2600 / 5447 and 205.4 / 1153 /
#   2606 / 5453 us against 8 x 2 213.8 / 1209 / 2673 / 5529 and 213.0 / 1297 / 2692 / 5532, faster in 7 of 8
#   pairs (flex ratio 1.18-1.25 -> 1.18-1.30); so every logits mask runs 12 x 1, only ALiBi by its MMA and
#   no hooks at all run 8 x 2.
#   Ping-pong (tuning pingpong=1, prefill::Config::kPingPong: the compute warpgroups issue their S MMAs in turn)
#   measured no better as a default (perf/results/prefill_ab33.md at adef042, prefill_ab34.md at d4fe955, same
#   runs as the default): 8 x 2, 32/32 heads 16x1k / 4x4k / 1x16k 449 / 1242 / 4672 vs 464 / 1289 / 5098 us
#   and 430 / 1199 / 4418 vs 447 / 1278 / 4632, but 32/8 393 / 1237 / 4645 vs 405 / 1201 / 4429 and 370 /
#   1160 / 4459 vs 387 / 1136 / 4173; 12 x 1 with it within 5% either way; flex variants at 12 x 1 5-10% slower
#   (prefill_flex34.md). ncu (1x16k, 8 x 2, adef042): tensor pipe 49% active, the compute warps' top stall
#   fixed-latency waits (31%), MUFU 17% of their samples; no shared-memory or issue limit reached.
#   (Taking an eighth, a quarter or half of the softmax's exponentials off MUFU, by a polynomial on the FMA pipe
#   as FlashAttention-4 does, was slower in 51 of 54 flex pairs at 8 x 2 and 12 x 1, by up to 11%: MUFU is not
#   the limit; perf/results/ab48e_exp_poly.md has the figures and the patch.)
#   Again at 11a97a8 (conditional rescale; perf/results/prefill_pp40_fa2.md, prefill_pp40_flex.md, same runs):
#   32/32 394 / 1167 / 4451 vs 402 / 1231 / 4534 us, 32/8 377 / 1172 / 4403 vs 367 / 1132 / 4305; flex at
#   16 heads, 512..16k, causal 0.95-1.00 of the plain shape's time, window 0.99-1.02, ALiBi 1.01-1.03.
#   Three runs, one answer then: without GQA (one head per chunk) and without logits hooks or masks, ping-pong
#   was 0-8% faster, with GQA 2-7% slower; so member 0 ping-ponged exactly there.
#   Not any more (since the row sums by MMA, the TMA loader and plans by request; perf/results/ab47q_*.md,
#   ab47p_causal_18cade1.md, three runs, each the same process): flex causal, 16 heads, 512..16k, without it
#   faster in all 14 pairs, 0.2-4% (8k 8914 / 8864 vs 9170 / 9253 us, 16k 35341 / 35641 / 34862 vs 36587 /
#   36475 / 36290: ratio to FlexAttention 1.17-1.20 -> 1.21-1.22); fa2 32/32 16x1k 2% faster twice, 4x4k and
#   1x16k one pair each way by 2-4% (the same module timed twice in those runs differs by up to 1.6%);
#   ALiBi by the bias MMA 0-3.5% faster without it (ab47_alibi_8b7627c.md). Member 0 runs without it; the
#   tuning pingpong=1 remains.
#   A window mask without a logits transform at 12 x 1 with 4 stages (perf/results/ab48s_*.md, two runs, and
#   ab48w.md, a third at 8k / 16k; same process, 16 heads, 16x512 / 1k / 2k / 4k / 8k / 16k): 79.5 / 207.7 /
#   507.3 / 1239 / 2576 / 5411 and 80.0 / 207.4 / 511.2 / 1279 / 2581 / 5438 us against 80.6 / 211.3 / 522.2 /
#   1248 / 2634 / 5430 and 80.6 / 205.9 / 523.2 / 1320 / 2629 / 5460 at 3 stages, faster in 11 of 12 pairs
#   (ab48w: 8k 2641 vs 2631, 16k 5433 vs 5574); with GQA 32/8 1-5.5% faster at five shapes
#   (ab48g_window_gqa_573f7e8.md). The extra stage lets the producer run further into the next query tile's
#   short KV range. Soft-cap at 4 stages 1-2% slower from 2k up (ab48s_*), so logits transforms (soft-cap +
#   window too, not timed) keep 3; ALiBi + window's bias MMA operands leave no room for a fourth stage.
_PREFILL_WS_MEMBER0 = {
    128: {"plain": (8, 2, 64, 3, 64), "hooks": (12, 1, 64, 3, 64), "window": (12, 1, 64, 4, 64)},
}
# Query buffers of a warp-specialised kernel: the sub-item running and the next one, whose query tile the
# producer copies ahead; each released through a barrier when its sub-item ends, so the stages are free
# to be more (8 x 2: three 32 KB stages beside two 64 KB query buffers).
PREFILL_PRODUCER_Q_BUFFERS = 2


def _producer_blockers(variant: Optional[Variant], head_dim: int, kv_bytes: int, shape: dict) -> list:
    """Why a shape cannot run warp-specialised (empty: it can): the producer warpgroup copies the query
    tiles (wgmma, no QueryTransform) and K/V straight into the MMAs' layout (16-bit KV, no KeyTransform),
    128 // (head_dim / 8) packed rows per copy round (tile rows a whole number of rounds)."""
    head_dim = _row_dim(head_dim)
    why = []
    if not shape.get("wgmma"):
        why.append("wgmma=1")
    if kv_bytes != 2:
        why.append("a 16-bit KV cache (fp8 KV is converted by every warp per tile)")
    if variant is not None and (variant.query_transform or variant.key_transform):
        why.append("no QueryTransform / KeyTransform (RoPE)")
    rows_per_round = 128 // (head_dim * 2 // 16)
    if (16 * shape["mfrags"] * shape["warps"]) % rows_per_round:
        why.append(f"query tile rows a multiple of {rows_per_round}")
    if shape["warps"] % 4:
        why.append("whole compute warpgroups (warps a multiple of 4)")
    smem = _prefill_smem_bytes(head_dim, kv_bytes, {**shape, "producer": 1}, PREFILL_PRODUCER_Q_BUFFERS)
    if smem > SMEM_PER_CTA:
        why.append(f"{PREFILL_PRODUCER_Q_BUFFERS} query buffers within {SMEM_PER_CTA} bytes of shared memory "
                   f"(this shape: {smem})")
    return why


def _prefill_shape(head_dim: int, kv_bytes: int, group: int, member: int = 0,
                   variant: Optional[Variant] = None) -> dict:
    """Prefill kernel shape (member of the family of the head_dim and variant, _prefill_family): hpc (query
    heads per chunk: the largest divisor of the group up to 16, so a short query's group fills the tile),
    warps, mfrags (16-row m fragments per warp), tile (KV tokens per stage), stages, step (KV tokens per
    compute step, a divisor of the tile), wgmma (1: Hopper's warpgroup MMAs, see prefill_uses_wgmma)."""
    hpc = max(d for d in range(1, min(group, PREFILL_MAX_HEADS_PER_CHUNK) + 1) if group % d == 0)
    return {"hpc": hpc, **_prefill_family(head_dim, kv_bytes, variant=variant, hpc=hpc)[member]}


def prefill_uses_wgmma() -> bool:
    """Whether prefill modules use Hopper's warpgroup MMAs: when every architecture they are built for
    ($FI_BACKEND_CUDA_ARCH_LIST, else the current device) is sm_90a, the only one that has them."""
    try:
        archs = kernels.resolve_arch_list()
    except RuntimeError:  # no device and no arch list: nothing is built here
        return False
    return all(a == "90a" for a in archs)


def _prefill_family(head_dim: int, kv_bytes: int, wgmma: Optional[bool] = None,
                    variant: Optional[Variant] = None, hpc: int = 1) -> list:
    """The family's shapes (variant None: the default variant's), member 0 warp-specialised where the variant,
    KV type and heads per chunk allow it (_PREFILL_WS_MEMBER0); with wgmma the row sums by MMA (rowsum,
    prefill::Config::kRowSumMma): against FADD sums in the same process, fa2 quick faster in 20 of 24 pairs
    over two runs each way (perf/results/ab46r_*.md, ab46s_*.md: 1x16k up to 7%, 4x4k 0-8%), flex within noise."""
    if wgmma is None:
        wgmma = prefill_uses_wgmma()
    head_dim = _row_dim(head_dim)
    table = _PREFILL_SHAPES_WGMMA if wgmma else _PREFILL_SHAPES_SYNC
    if wgmma and variant is not None and variant.mask_is_kv_range:
        table = {**table, **_PREFILL_SHAPES_WGMMA_WINDOW}
    keys = ("warps", "mfrags", "tile", "stages", "step")
    family = []
    for s in table[(head_dim, kv_bytes)]:
        shape = {**dict(zip(keys, s)), "wgmma": int(wgmma), "producer": 0, "pingpong": 0, "rowsum": int(wgmma)}
        family.append({**shape, "bias": int(_bias_mma_possible(variant, shape, hpc))})
    ws = _PREFILL_WS_MEMBER0.get(head_dim) if wgmma else None
    if ws:
        # ALiBi by MMA is no per-element hook: without other hooks it runs the plain shape
        bias = int(_bias_mma_possible(variant, {"wgmma": 1, "warps": ws["plain"][0]}, hpc))
        hooked = variant is not None and _logits_hooks(variant, bias)
        names = ["plain"]
        if hooked:  # a window mask without a transform: 4 stages where they fit (not beside the bias MMA's operands)
            window = variant.mask_is_kv_range and not variant.logits_transform and "window" in ws
            names = ["window", "hooks"] if window else ["hooks"]
        for name in names:
            shape = {**dict(zip(keys, ws[name])), "wgmma": 1, "producer": 1, "pingpong": 0, "rowsum": 1,
                     "bias": bias}  # no ping-pong: measured above
            if not _producer_blockers(variant, head_dim, kv_bytes, {**shape, "hpc": hpc}):
                family[0] = shape
                break
    return family


def _bias_mma_possible(variant: Optional[Variant], shape: dict, hpc: int) -> bool:
    """Whether a variant's ALiBi (alibi_slope) can go by the tensor cores (prefill::Config::kBiasMma): wgmma,
    softmax attention, no LogitsTransform (it would have to see the bias per element), heads per chunk
    dividing 8 and at most 12 compute warps (the bias MMA's A blocks and named barriers)."""
    return (variant is not None and bool(variant.alibi_slope) and variant.use_softmax
            and not variant.logits_transform and bool(shape.get("wgmma")) and 8 % hpc == 0
            and shape["warps"] <= 12)


def _logits_hooks(variant: Variant, bias: int) -> bool:
    """Whether a prefill kernel runs per-element logits hooks: a LogitsTransform or LogitsMask, or ALiBi
    without the bias MMA."""
    return bool(variant.logits_transform or variant.logits_mask or (variant.alibi_slope and not bias))


def prefill_family_shapes(head_dim: int, kv_dtype: str, wgmma: Optional[bool] = None,
                          variant: Optional[Variant] = None) -> list:
    """The prefill tile family's shapes as tuning dicts, largest query tile first: Hopper's warpgroup-MMA
    family when the modules are built for sm_90a only (wgmma None: decide so), else the mma.sync one; a
    sliding-window variant's own where it has one (_PREFILL_SHAPES_WGMMA_WINDOW)."""
    return _prefill_family(head_dim, 1 if kv_dtype.startswith("fp8") else 2, wgmma, variant)


def prefill_family_size(head_dim: int, kv_dtype: str, tuning: Optional[dict] = None) -> int:
    """Members of the prefill tile family (1 with a tuning override: that shape only)."""
    return 1 if tuning else len(prefill_family_shapes(head_dim, kv_dtype))


def _prefill_smem_bytes(head_dim: int, kv_bytes: int, shape: dict, q_buffers: int = 1) -> int:
    """Shared memory of a prefill shape with q_buffers query tiles; mirrors prefill::Config::kSmemBytes."""
    head_dim = _row_dim(head_dim)
    record = 80  # a TileRecord per stage, apart from the stages
    align = 1024 if shape.get("wgmma") else 128
    stage = (2 * shape["tile"] * head_dim * kv_bytes + align - 1) // align * align
    convert = 2 * shape["tile"] * head_dim * 2 if kv_bytes == 1 else 0
    tile_rows = 16 * shape["mfrags"] * shape["warps"]
    row_offsets = 2 * shape["tile"] * 8  # the loader's published row offsets, two tiles
    # full / empty mbarriers per stage, qempty per query buffer; the producer's TMA votes (two tiles x 4 warps)
    barriers = 16 * shape["stages"] + 8 * q_buffers + 32 if shape.get("producer") else 0
    flags = (tile_rows // 8 + 15) // 16 * 16  # a bit a row
    # the bias MMA's A blocks (128 bytes a warpgroup), zeros and columns (16 bytes a token of a step); the
    # row-sum MMA's ones
    bias = 128 * (shape["warps"] // 4) + 128 + 16 * shape["step"] if shape.get("bias") else 0
    ones = 256 if shape.get("rowsum") or shape.get("bias") else 0
    return (shape["stages"] * (stage + record) + q_buffers * tile_rows * head_dim * 2 + convert + bias + ones + flags
            + row_offsets + barriers)


def _prefill_q_buffers(variant: Variant, head_dim: int, kv_bytes: int, shape: dict) -> int:
    """Query buffers of a prefill module: one per stage (the loader copies each sub-item's query tile with
    its first KV tile, so no warp waits on Q at a sub-item's start) on Hopper where they fit, for variants
    without a QueryTransform (Q is rotated in registers); else 1 (the warps load Q). Variants with logits
    hooks at 16 warps (128 registers, where they spill) take no copy: there they measured 4-22% slower
    with it (1f48c9d against 7862c6f; window 457 vs 385 us at 16x1k in prefill_variant_shapes.json), from
    the copy's registers and the shared memory it takes from L1, which holds the spills. At 12 warps the
    copy measured faster with hooks (16x1k: window 360 vs 377 us, ALiBi 357 vs 391); at 8 warps (the
    second member) it was not timed with hooks."""
    if shape.get("producer"):  # the producer warpgroup copies every sub-item's query tile
        return PREFILL_PRODUCER_Q_BUFFERS
    hooks = _logits_hooks(variant, shape.get("bias", 0))
    copy = _prefill_q_copy_possible(variant, head_dim, kv_bytes, shape) and not (hooks and shape["warps"] >= 16)
    return shape["stages"] if copy else 1


def _prefill_q_copy_possible(variant: Variant, head_dim: int, kv_bytes: int, shape: dict) -> bool:
    """Whether a module can have the loader's query copy at all: warpgroup MMAs (they read Q from shared
    memory), no QueryTransform, and a query buffer per stage within the CTA's shared memory."""
    return (bool(shape.get("wgmma")) and not variant.query_transform and
            _prefill_smem_bytes(head_dim, kv_bytes, shape, shape["stages"]) <= SMEM_PER_CTA)


def prefill_spec(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int, *,
                 tuning: Optional[dict] = None, member: int = 0) -> kernels.ModuleSpec:
    """The JIT module of the prefill kernel for one (variant, head_dim, dtypes, GQA group), tile family
    member `member` (0: the largest query tile; see _PREFILL_SHAPES_SYNC / _WGMMA).
    tuning (benchmarks): overrides of warps / mfrags / tile / stages / step (default: min(step, tile)) / wgmma
    (1: Hopper warpgroup MMAs, sm_90a only) / producer (1: warp-specialised, a producer warpgroup loads the
    tiles for `warps` compute warps; wgmma, the query copy, 16-bit KV, no KeyTransform), pingpong (1: with a
    producer and 8, 12 or 16 compute warps, the warpgroups issue their S MMAs in turn; default 0, measured
    slower, see _PREFILL_WS_MEMBER0), rowsum (1: the softmax's row sums by warpgroup
    MMAs, prefill::Config::kRowSumMma; wgmma only), bias (1: a variant's ALiBi by warpgroup MMAs,
    prefill::Config::kBiasMma; default wherever _bias_mma_possible), q_buffers (1, or
    the stages: the loader's query copy; with a producer, 2 or more; default _prefill_q_buffers's choice),
    min_blocks (CTAs per SM the register budget is cut for; default 1: the kernel's own need), and defines
    ({"FI_PREFILL_...": int}: csrc macros for A/B runs, e.g. FI_PREFILL_KV_VOTE, FI_PREFILL_VOTE_EVERY_TILE)."""
    _check_head_dim(head_dim, variant)
    kv_bytes = 1 if kv_dtype.startswith("fp8") else 2
    size = prefill_family_size(head_dim, kv_dtype, tuning)
    if not 0 <= member < size:
        raise ValueError(f"member must be in [0, {size}) (got {member})")
    shape = _prefill_shape(head_dim, kv_bytes, group, member, variant)
    default_shape = dict(shape) if member == 0 else _prefill_shape(head_dim, kv_bytes, group, 0, variant)
    tuning = dict(tuning or {})
    min_blocks = int(tuning.pop("min_blocks", 1))
    q_buffers = tuning.pop("q_buffers", None)
    defines = dict(tuning.pop("defines", {}))
    unknown = set(tuning) - {"warps", "mfrags", "tile", "stages", "step", "wgmma", "producer", "pingpong", "rowsum",
                             "bias"}
    if unknown:
        raise ValueError(f"unknown prefill tuning keys {sorted(unknown)}")
    shape.update(tuning)
    if shape["wgmma"] and not prefill_uses_wgmma():
        raise ValueError("tuning wgmma=1 needs modules built for sm_90a only: set FI_BACKEND_CUDA_ARCH_LIST=90a, or "
                         "leave it unset with an H100 / H200 as the current device")
    if "step" not in tuning:
        shape["step"] = min(shape["step"], shape["tile"])
    shape["producer"] = int(shape.get("producer", 0))
    why = _producer_blockers(variant, head_dim, kv_bytes, shape) if shape["producer"] else []
    if why:
        raise ValueError(f"tuning producer=1 (warp-specialised prefill) needs {', '.join(why)}; shape {shape}")
    shape["pingpong"] = int(shape.get("pingpong", 0))
    if shape["pingpong"] not in (0, 1):
        raise ValueError(f"tuning pingpong must be 0 or 1, got {shape['pingpong']}")
    if shape["pingpong"] and not (shape["producer"] and shape["warps"] in (8, 12, 16)):
        raise ValueError(f"tuning pingpong=1 needs producer=1 and warps 8, 12 or 16 (two to four compute "
                         f"warpgroups taking turns); shape {shape}")
    shape["rowsum"] = int(tuning.get("rowsum", shape["wgmma"]))  # by default wherever there are warpgroup MMAs
    if shape["rowsum"] not in (0, 1) or (shape["rowsum"] and not shape["wgmma"]):
        raise ValueError(f"tuning rowsum must be 0 or 1, and 1 only with wgmma=1 (the softmax's row sums by warpgroup "
                         f"MMAs); got rowsum={shape['rowsum']} with wgmma={shape['wgmma']}")
    possible = _bias_mma_possible(variant, shape, shape["hpc"])
    shape["bias"] = int(tuning.get("bias", possible))
    if shape["bias"] not in (0, 1) or (shape["bias"] and not possible):
        raise ValueError(f"tuning bias must be 0 or 1, and 1 only with wgmma=1, at most 12 warps, heads per chunk "
                         f"dividing 8 and a variant with an alibi_slope, softmax and no logits_transform (the ALiBi "
                         f"bias by warpgroup MMAs); got bias={shape['bias']} with shape {shape}, variant {variant.name}")
    smem = _prefill_smem_bytes(head_dim, kv_bytes, shape)
    if smem > SMEM_PER_CTA:
        raise ValueError(f"prefill kernel shape {shape} for head_dim {head_dim} needs {smem} bytes of shared "
                         f"memory; a CTA may use at most {SMEM_PER_CTA}")
    chosen = _prefill_q_buffers(variant, head_dim, kv_bytes, shape)
    if shape["producer"] and q_buffers is not None and not (isinstance(q_buffers, int) and q_buffers >= 2):
        raise ValueError(f"a warp-specialised prefill kernel (producer=1) needs q_buffers >= 2 (the producer copies "
                         f"the next sub-item's query tile while this one runs); got {q_buffers}")
    if q_buffers is None:
        q_buffers = chosen
    elif shape["producer"]:
        smem = _prefill_smem_bytes(head_dim, kv_bytes, shape, q_buffers)
        if smem > SMEM_PER_CTA:
            raise ValueError(f"tuning q_buffers {q_buffers} with shape {shape} needs {smem} bytes of shared memory; "
                             f"a CTA may use at most {SMEM_PER_CTA}")
    elif q_buffers != 1 and (q_buffers != shape["stages"] or
                             not _prefill_q_copy_possible(variant, head_dim, kv_bytes, shape)):
        raise ValueError(f"tuning q_buffers must be 1 or the stages ({shape['stages']}), and more than 1 only with "
                         f"wgmma, no QueryTransform and within {SMEM_PER_CTA} bytes of shared memory; got {q_buffers}")
    config = ", ".join([str(head_dim), str(shape["hpc"]), _C_TYPE[q_dtype], _C_TYPE[kv_dtype], str(shape["warps"]),
                        str(shape["mfrags"]), str(shape["tile"]), str(shape["stages"]), str(shape["step"]),
                        "true" if shape["wgmma"] else "false", str(q_buffers),
                        "true" if shape["producer"] else "false", "true" if shape["pingpong"] else "false",
                        "true" if shape["rowsum"] else "false", "true" if shape["bias"] else "false"])
    tag = f"{variant.name}_{q_dtype}_{kv_dtype}_d{head_dim}_h{shape['hpc']}"
    if shape != default_shape:  # a tuning equal to the largest member is that member's module
        tag += ("_w{warps}m{mfrags}t{tile}s{stages}k{step}".format(**shape) + ("_wg" if shape["wgmma"] else "")
                + ("_p" if shape["producer"] else "") + ("_pp" if shape["pingpong"] else "")
                + ("_rs" if shape["rowsum"] else "") + ("_ab" if shape["bias"] else ""))
    if q_buffers != chosen:
        tag += f"_q{q_buffers}"
    if min_blocks != 1:
        tag += f"_b{min_blocks}"
    flags = []
    for name, value in sorted(defines.items()):  # A/B runs of a csrc macro (perf/page1_gather.py)
        if not (name.startswith("FI_PREFILL_") and name.replace("_", "").isalnum() and isinstance(value, int)):
            raise ValueError(f"tuning defines: names FI_PREFILL_* with int values, got {name}={value!r}")
        flags.append(f"-D{name}={value}")
        tag += f"_{name[len('FI_PREFILL_'):].lower()}{value}"
    return _attention_spec("prefill", variant, config, min_blocks, tag, flags)


def _attention_spec(kernel: str, variant: Variant, config: str, min_blocks: int, tag: str,
                    flags: list) -> kernels.ModuleSpec:
    params = {"KERNEL": kernel, "CONFIG": config, "MIN_BLOCKS": str(min_blocks)}
    params.update(variant.render())
    return kernels.ModuleSpec(family=kernel, template="attention/attention_module.cu", params=params, tag=tag,
                              nvcc_flags=tuple(flags))


_SPECS = {"decode": decode_spec, "prefill": prefill_spec}
KERNELS = tuple(_SPECS)


class _FastDiv(ctypes.Structure):
    _fields_ = [("d", ctypes.c_uint32), ("m", ctypes.c_uint32), ("s", ctypes.c_uint32)]


# ctypes mirror of fi::attn::Params (csrc/attention/shared.cuh); checked against the module's
# fi_attention_layout offsets when a module is loaded.
class _Params(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("q_stride_row", ctypes.c_int64), ("q_stride_head", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("out_stride_row", ctypes.c_int64), ("out_stride_head", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("lse_stride_row", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("kv_stride_block", ctypes.c_int64),
        ("kv_stride_token", ctypes.c_int64), ("kv_stride_head", ctypes.c_int64),
        ("num_kv_blocks", ctypes.c_int32), ("page_size", ctypes.c_int32), ("page_div", _FastDiv),
        ("kv_block_start_int64", ctypes.c_int32),
        ("kv_indices", ctypes.c_void_p), ("num_kv_indices", ctypes.c_int64), ("kv_block_start", ctypes.c_void_p),
        ("kv_lens", ctypes.c_void_p), ("qo_indptr", ctypes.c_void_p), ("kv_pos_start", ctypes.c_void_p),
        ("plan", ctypes.c_void_p), ("items_offset", ctypes.c_int32), ("merge_indptr_offset", ctypes.c_int32),
        ("partial_o", ctypes.c_void_p), ("partial_lse", ctypes.c_void_p), ("merge_counters", ctypes.c_void_p),
        ("error_flags", ctypes.c_void_p), ("num_qo_heads", ctypes.c_int32), ("num_head_chunks", ctypes.c_int32),
        ("logits_scale", ctypes.c_float), ("v_scale", ctypes.c_float), ("causal", ctypes.c_int32),
    ]


_LAYOUT_FIELDS = ("q", "out", "lse", "k", "num_kv_blocks", "page_div", "kv_block_start_int64", "kv_indices",
                  "kv_pos_start", "plan", "items_offset", "partial_o", "error_flags", "num_qo_heads",
                  "logits_scale", "causal")


def _fastdiv(d: int) -> _FastDiv:
    s = 0
    while (1 << s) < d:
        s += 1
    m = ((1 << 32) * ((1 << s) - d)) // d + 1
    return _FastDiv(d, m & 0xFFFFFFFF, s)


class _Launcher:
    """A loaded attention module: its launcher, its ctypes VariantParams type and its kernel shape."""

    def __init__(self, spec: kernels.ModuleSpec, variant: Variant):
        self.module = kernels.load(spec)
        self.run = self.module.function(
            "fi_attention_run", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p])
        layout_fn = self.module.function("fi_attention_layout", [ctypes.POINTER(ctypes.c_int64), ctypes.c_int])
        buf = (ctypes.c_int64 * 64)()
        n = layout_fn(buf, 64)
        vals = list(buf[:n])
        self.threads, self.smem_bytes, self.tile, self.rows, self.heads_per_chunk, self.rows_per_tile = vals[:6]
        self.vparams_type = type(f"VariantParams_{variant.name}", (ctypes.Structure,),
                                 {"_fields_": variant.ctypes_fields()})
        expected = [ctypes.sizeof(_Params), ctypes.sizeof(self.vparams_type)]
        expected += [getattr(_Params, f).offset for f in _LAYOUT_FIELDS]
        expected += [getattr(self.vparams_type, f).offset for f in variant.params]
        if vals[6:] != expected:
            raise RuntimeError(f"attention module {self.module.name}: the C parameter layout {vals[6:]} does not match "
                               f"fi_backend.wrappers' ctypes mirror {expected}; the two must change together")
        self._occupancy = self.module.function("fi_attention_occupancy", [ctypes.POINTER(ctypes.c_int)])

    def blocks_per_sm(self) -> int:
        out = ctypes.c_int(0)
        rc = self._occupancy(ctypes.byref(out))
        if rc:
            self.module.check(rc, "fi_attention_occupancy")
        return max(1, out.value)


_launchers: dict = {}


def _launcher(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int,
              tuning: Optional[dict] = None, kernel: str = "decode", member: int = 0) -> _Launcher:
    kw = {"member": member} if member else {}
    spec = _SPECS[kernel](variant, head_dim, q_dtype, kv_dtype, group, tuning=tuning, **kw)
    entry = _launchers.get(spec.memo_key)
    if entry is None:
        entry = _Launcher(spec, variant)
        _launchers[spec.memo_key] = entry
    return entry


def _family(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int, tuning: Optional[dict],
            kernel: str) -> list:
    """The kernel's launchers: the prefill tile family (largest query tile first), else the one module."""
    size = prefill_family_size(head_dim, kv_dtype, tuning) if kernel == "prefill" else 1
    return [_launcher(variant, head_dim, q_dtype, kv_dtype, group, tuning, kernel, m) for m in range(size)]


class _Bad(Exception):
    """run()'s fast path met an argument it does not accept; _explain() says which."""


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CAPTURED = -1  # fi_attention_run's return code for a launch into a capturing stream


def _stream(device_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _check_index_tensor(name: str, t, device, dtypes=(torch.int32,)) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.device != device:
        raise ValueError(f"{name} must be on the workspace's device {device} (got {t.device})")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)} (got {t.dtype})")
    if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
        raise ValueError(f"{name} must be a contiguous 1-D tensor (got shape {tuple(t.shape)}, strides {t.stride()})")


class BatchAttention:
    """Batch attention over the BSR KV format with a plan/run split (see the module docstring).

    workspace      a fi_backend.workspace.Workspace on the GPU (num_ctas: see recommended_num_ctas;
                   max_tile_q: see query_tile_rows; num_qo_heads, num_kv_heads and head_dim as here)
    num_qo_heads, num_kv_heads, head_dim   head_dim in HEAD_DIMS, num_qo_heads % num_kv_heads == 0
    q_dtype        torch.bfloat16 or torch.float16 (the output has the same dtype)
    kv_dtype       q_dtype, or torch.float8_e4m3fn / torch.float8_e5m2 (per-tensor k_scale/v_scale in run)
    page_size      KV block width Bc, 1..256 (1 for token-level tables such as SGLang's)
    kv_layout      "NHD" ([blocks, page, heads, D]) or "HND" ([blocks, heads, page, D]) for 4-D caches
    variant        a fi_backend.variants.Variant (default: plain softmax attention)
    kernel         "decode": split-KV kernel for steps where queries are a row or a few per request (it
                   runs any batch correctly, but re-reads KV for every 16 packed rows); "prefill":
                   FlashAttention-2-style kernel with 128-row query tiles for prefill, append, chunked
                   prefill and mixed prefill + decode batches
    tuning         benchmarks only: kernel-shape overrides, see decode_spec() / prefill_spec()
    deterministic  batch-invariant plans (None: FI_BACKEND_DETERMINISTIC, default off): a request's KV
                   splits and merge order depend on that request alone (docs/deterministic.md); the
                   decode kernel needs a Workspace made with deterministic_pieces >= DETERMINISTIC_PIECES

    After construction: rows_per_tile (query rows per tile, the planner's tile_q), kv_tile (KV tokens
    per pipeline stage, the chunk alignment), grid (the fixed launch grid). The prefill kernel is a family
    of query-tile sizes: each plan() picks one (rows_per_tile and kv_tile are then the picked member's);
    once run() has been captured in a CUDA graph, plans keep the captured member.
    """

    def __init__(self, workspace: Workspace, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
                 q_dtype: torch.dtype = torch.bfloat16, kv_dtype: Optional[torch.dtype] = None, page_size: int = 16,
                 kv_layout: str = "NHD", variant: Variant = DEFAULT, kernel: str = "decode",
                 tuning: Optional[dict] = None, deterministic: Optional[bool] = None):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS} (got {kernel!r})")
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a fi_backend.workspace.Workspace (got {type(workspace).__name__})")
        if workspace.device.type != "cuda":
            raise ValueError(f"BatchAttention needs a workspace on a CUDA device (got {workspace.device})")
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (got {value!r})")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported; supported: {HEAD_DIMS}")
        if q_dtype not in Q_DTYPES:
            raise TypeError(f"q_dtype must be torch.bfloat16 or torch.float16 (got {q_dtype})")
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in KV_DTYPES or (kv_dtype in Q_DTYPES and kv_dtype != q_dtype):
            raise TypeError(f"kv_dtype must be q_dtype ({q_dtype}), torch.float8_e4m3fn or torch.float8_e5m2 "
                            f"(got {kv_dtype})")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be an int in [1, {MAX_PAGE_SIZE}] (got {page_size!r})")
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND' (got {kv_layout!r})")
        if not isinstance(variant, Variant):
            raise TypeError(f"variant must be a fi_backend.variants.Variant (got {type(variant).__name__})")
        if (workspace.num_qo_heads, workspace.num_kv_heads, workspace.head_dim) != (num_qo_heads, num_kv_heads, head_dim):
            # partial_o rows are laid out [row, num_qo_heads, head_dim] by the kernel; its item capacity and
            # partial rows are sized for units between num_kv_heads and num_qo_heads
            raise ValueError(f"the workspace's num_qo_heads/num_kv_heads/head_dim ({workspace.num_qo_heads}, "
                             f"{workspace.num_kv_heads}, {workspace.head_dim}) must equal the wrapper's "
                             f"({num_qo_heads}, {num_kv_heads}, {head_dim})")
        self.workspace = workspace
        self.device = workspace.buffer.device  # with its index: torch.device("cuda") != "cuda:0"
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group = num_qo_heads // num_kv_heads
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.page_size, self.kv_layout, self.variant = page_size, kv_layout, variant
        self._fp8 = kv_dtype not in Q_DTYPES

        self.kernel = kernel
        # The tile family (prefill: query tiles of several sizes, largest first; plan() picks one per step).
        self._family = _family(variant, head_dim, Q_DTYPES[q_dtype], KV_DTYPES[kv_dtype], self.group, tuning, kernel)
        tile_q = max(int(f.rows_per_tile) for f in self._family)
        if tile_q > workspace.max_tile_q:
            raise ValueError(f"the workspace's max_tile_q={workspace.max_tile_q} is below the kernel's query tile "
                             f"({tile_q} rows); construct the Workspace with max_tile_q >= {tile_q} "
                             f"(BatchAttention.query_tile_rows gives it)")
        if len({f.blocks_per_sm() for f in self._family}) > 1:  # one fixed grid serves every member
            raise RuntimeError(f"prefill tile family of head_dim {head_dim}: members differ in CTAs per SM")
        self._use_member(0)
        # ---- deterministic mode (issue 31, docs/deterministic.md) ----
        # Decode splits each request at its own chunk (scheduler.DETERMINISTIC_*); prefill splits nothing and
        # keeps tile member 0, since the member (its query tile and KV tile) would otherwise follow the batch.
        self.deterministic = env.flag(env.DETERMINISTIC, False) if deterministic is None else bool(deterministic)
        self._det_pieces = 0
        if self.deterministic:
            self._det_pieces = DETERMINISTIC_PIECES if kernel == "decode" else 1
            if workspace.deterministic_pieces < self._det_pieces:
                raise ValueError(f"deterministic=True with the decode kernel needs a Workspace made with "
                                 f"deterministic_pieces >= {self._det_pieces} (got {workspace.deterministic_pieces}): "
                                 f"every request may be split, whatever the batch")
        # ---- end deterministic mode ----
        self.num_head_chunks = self.group // int(self._launcher.heads_per_chunk)
        # Units: the query-head groups a work item runs for (KV head unit // num_head_chunks). The plan
        # spreads (item, unit) pairs over the whole grid, so no SM idles for want of a head's queue.
        self.num_units = num_kv_heads * self.num_head_chunks
        self.grid = (workspace.num_ctas, 1)

        dev = self.device
        self._error_flags = torch.zeros(4, dtype=torch.int32, device=dev)
        self._merge_counters = torch.zeros(workspace.max_tokens * self.num_units, dtype=torch.int32, device=dev)
        p = _Params()
        p.plan = workspace.plan_ptr
        p.items_offset = workspace.layout.items_offset
        p.merge_indptr_offset = workspace.layout.merge_indptr_offset
        p.partial_o = workspace.partial_o_ptr
        p.partial_lse = workspace.partial_lse_ptr
        p.merge_counters = self._merge_counters.data_ptr()
        p.error_flags = self._error_flags.data_ptr()
        p.num_qo_heads = num_qo_heads
        p.num_head_chunks = self.num_head_chunks
        p.page_size = page_size
        p.page_div = _fastdiv(page_size)
        p.v_scale = 1.0
        self._params = p
        self._params_ref = ctypes.byref(p)
        self._vparams = self._launcher.vparams_type()
        self._vparams_ref = ctypes.byref(self._vparams)
        self._variant_keep = {}   # tensors the variant params point to, kept alive
        self._planned = False
        self._num_rows = 0
        self._sm_scale = 1.0 / math.sqrt(head_dim)
        self._bsr_ptrs = None
        self._frozen = None       # (BSR pointers, scalar settings) baked into a captured graph
        self._kv_obj = None       # the KV cache whose parse is in _params (identity + pointer checked)
        self._kv_is_tensor, self._kv0, self._kv1, self._kv_ptr = True, None, None, 0
        self._lse_on = False
        self._k_scale = self._v_scale = 1.0
        self._q_shape = torch.Size((0, num_qo_heads, head_dim))
        self._dev_index = dev.index

    @property
    def module_names(self) -> list:
        """The kernel modules this wrapper loaded (its tile family), by cache name."""
        return [f.module.name for f in self._family]

    def _use_member(self, member: int) -> None:
        """Make family member `member` the kernel that plan() plans for and run() launches."""
        self._launcher = self._family[member]
        self._launch = self._launcher.run
        self.rows_per_tile = int(self._launcher.rows_per_tile)  # query rows per tile (the planner's tile_q)
        self.kv_tile = int(self._launcher.tile)                  # KV tokens per pipeline stage (chunk alignment)
        # Planner cost of a query row, in KV tokens: decode items cost a tile of KV per row tile; a prefill
        # item's fixed work (its Q tile, its epilogue) is about two KV tiles for a whole 128-row tile.
        self._cost_q = float(self.kv_tile) if self.kernel == "decode" else 2.0 * self.kv_tile / self.rows_per_tile
        # Prefill plans go request by request (scheduler.plan_into's group_requests) for steps of two requests
        # or more with one of PLAN_GROUPED_MIN_KV KV tokens or more, so CTAs running at the same time read the
        # same request and head's KV (shorter steps were not timed with it, and it doubles the planner's host
        # time). With 16 heads, causal, against LPT over all items (perf/results/locality_h_*.json,
        # ab46h_flex_*.md, two runs each): 2 / 4 / 16 x 16k 3-6% / 7% / 9% faster, 16 / 64 x 4k 2-5% / 5%,
        # 4 x 4k even; one 16k request 2-3% slower (LPT's order already keeps its CTAs together), so not there;
        # a sliding window 3-14% slower while the planner counted its tiles' prefix, and even once they cost
        # their window (ab46wg_*.md: 16k 1.18-1.19 against 1.16-1.23 of FlexAttention), so not for a mask that
        # is the KV range. FI_BACKEND_PLAN_GROUPED=0 turns it off.
        # A sliding window's tiles cost their window, not their prefix (scheduler.plan_into's kv_window; the
        # variant's mask is its KV range and a parameter window_left names the window): LPT had balanced the
        # prefixes, so CTAs with the late tiles ran fewer of equal real cost. Flex window 1024, 16 heads, same
        # machine, two runs each way (perf/results/ab46w_*.md): 16k 1.18-1.19 of FlexAttention against
        # 1.10-1.11, 4k 1.23 against 1.19-1.20, 1k even. FI_BACKEND_PLAN_WINDOW=0: the prefix (A/B).
        self._window_cost = (self.kernel == "prefill" and self.variant.mask_is_kv_range
                             and "window_left" in self.variant.params and env.flag(env.PLAN_WINDOW, True))
        self._group_requests = (self.kernel == "prefill" and not self.variant.mask_is_kv_range
                                and env.flag(env.PLAN_GROUPED, True))

    def _pick_member(self, q_lens: torch.Tensor) -> int:
        """The largest query tile that gives each CTA FAMILY_TILES_PER_CTA tiles on this step, or that fills
        whole waves of CTAs (tiles / CTAs at least 1 and within FAMILY_WAVE_SLACK of a whole number from
        below): fewer, larger tiles otherwise leave CTAs idle on short prefills. Else the smallest.
        q_lens: CPU int32 [B]."""
        last = len(self._family) - 1
        for m, launcher in enumerate(self._family[:-1]):
            rows = int(launcher.rows_per_tile)
            tiles = int(torch.div(q_lens + (rows - 1), rows, rounding_mode="floor").sum()) * self.num_units
            waves = tiles / self.grid[0]
            if waves >= FAMILY_TILES_PER_CTA or (waves >= 1 and math.ceil(waves) <= FAMILY_WAVE_SLACK * waves):
                return m
        return last

    # -------------------------------------------------------------------------------- sizing

    @staticmethod
    def recommended_num_ctas(device, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
                             q_dtype: torch.dtype = torch.bfloat16, kv_dtype: Optional[torch.dtype] = None,
                             variant: Variant = DEFAULT, kernel: str = "decode", tuning: Optional[dict] = None) -> int:
        """CTAs that fill the GPU once (SMs x resident CTAs per SM): the num_ctas to construct the Workspace
        with. Builds (or loads) the kernel module to read its occupancy.

        The decode kernel takes the largest multiple of its units (query-head groups) within that: it is
        memory-bound, and 128 CTAs already read KV at the copy rate, so 4 more SMs add no bandwidth, while
        a grid that divides by the units splits a uniform batch evenly without cutting KV into chunks to
        merge, and plans as unit blocks (csrc/scheduler/planner.h). H100, 32/8 heads, batch 256 x 1k / 4k /
        16k (perf/results/decode_grid.json): 132 CTAs 374.6 / 1425 / 5650 us, 128 CTAs 367.1 / 1418 / 5652,
        FlashInfer 366.5 / 1418 / 5633. Prefill is compute-bound and takes every SM
        (perf/results/sm_scaling.json: 132 CTAs 2-3% faster than 128)."""
        device = torch.device(device)
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        group = num_qo_heads // num_kv_heads
        launcher = _launcher(variant, head_dim, Q_DTYPES[q_dtype], KV_DTYPES[kv_dtype], group, tuning, kernel)
        with torch.cuda.device(device):
            per_sm = launcher.blocks_per_sm()
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        total = max(1, sms * per_sm)
        units = num_kv_heads * (group // int(launcher.heads_per_chunk))
        if kernel == "decode" and total >= units:
            total -= total % units
        return total

    @staticmethod
    def query_tile_rows(num_qo_heads: int, num_kv_heads: int, head_dim: int, *, q_dtype: torch.dtype = torch.bfloat16,
                        kv_dtype: Optional[torch.dtype] = None, variant: Variant = DEFAULT, kernel: str = "decode",
                        tuning: Optional[dict] = None) -> int:
        """Query rows of the kernel's tile (the planner's tile_q): the max_tile_q to construct the
        Workspace with. Builds (or loads) the kernel module to read its layout."""
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        return max(int(f.rows_per_tile) for f in _family(variant, head_dim, Q_DTYPES[q_dtype], KV_DTYPES[kv_dtype],
                                                          num_qo_heads // num_kv_heads, tuning, kernel))

    # -------------------------------------------------------------------------------- plan

    def plan(self, qo_indptr, kv_lens, bsr: BSR, *, causal: bool = False, sm_scale: Optional[float] = None,
             debug: bool = False, **variant_params):
        """Plan a step: qo_indptr int32 [B + 1] and kv_lens int32 [B] on the CPU (this step's query rows
        and KV lengths per request), bsr the step's KV as a device BSR with the same rows and lengths
        (block_width == page_size). Variant parameters by name (see fi_backend.variants). debug=True
        also checks the BSR on the host (indices in range, lengths agree) and synchronises."""
        ws = self.workspace
        if not isinstance(bsr, BSR):
            raise TypeError(f"bsr must be a fi_backend.formats.BSR (got {type(bsr).__name__})")
        if bsr.block_width != self.page_size:
            raise ValueError(f"bsr.block_width ({bsr.block_width}) must equal the wrapper's page_size ({self.page_size})")
        if bsr.qo_rows is not None:
            raise ValueError("bsr.qo_rows is not supported by the attention kernels yet: row blocks must be the "
                             "contiguous query rows qo_indptr[i]:qo_indptr[i+1]")
        dev = self.device
        _check_index_tensor("bsr.qo_indptr", bsr.qo_indptr, dev)
        _check_index_tensor("bsr.kv_lens", bsr.kv_lens, dev)
        _check_index_tensor("bsr.kv_indices", bsr.kv_indices, dev)
        _check_index_tensor("bsr.kv_block_start", bsr.kv_block_start, dev, (torch.int32, torch.int64))
        if bsr.kv_pos_start is not None:
            _check_index_tensor("bsr.kv_pos_start", bsr.kv_pos_start, dev)
        B = bsr.kv_lens.numel()
        if bsr.qo_indptr.numel() != B + 1 or bsr.kv_block_start.numel() < B:
            raise ValueError(f"bsr has {B} row blocks but qo_indptr has {bsr.qo_indptr.numel()} entries "
                             f"and kv_block_start {bsr.kv_block_start.numel()}")
        qo_cpu = torch.as_tensor(qo_indptr)
        kv_cpu = torch.as_tensor(kv_lens)
        if qo_cpu.device.type != "cpu" or kv_cpu.device.type != "cpu":
            raise ValueError("qo_indptr and kv_lens passed to plan() must be CPU tensors (the planner runs on "
                             "the host); the BSR carries their device copies")
        if qo_cpu.numel() != B + 1 or kv_cpu.numel() != B:
            raise ValueError(f"qo_indptr ({qo_cpu.numel()} entries) and kv_lens ({kv_cpu.numel()}) must describe "
                             f"the BSR's {B} row blocks")
        scale = 1.0 / math.sqrt(self.head_dim) if sm_scale is None else float(sm_scale)
        if self.variant.alibi_slope and not (math.isfinite(scale) and scale != 0.0):
            raise ValueError(f"sm_scale must be finite and nonzero with ALiBi (variant {self.variant.name}: the prefill "
                             f"kernel adds slope / sm_scale to the raw logits), got {sm_scale}")
        values = self.variant.resolve(variant_params, head_dim=self.head_dim, device=dev)
        if debug:
            self._debug_check(qo_cpu, kv_cpu, bsr)

        bsr_ptrs = (bsr.qo_indptr.data_ptr(), bsr.kv_lens.data_ptr(), bsr.kv_indices.data_ptr(),
                    bsr.kv_block_start.data_ptr(), 0 if bsr.kv_pos_start is None else bsr.kv_pos_start.data_ptr())
        settings = (bool(causal), scale, self._scalar_values(values))
        if self._frozen is not None and (self._frozen[0] != bsr_ptrs or self._frozen[1] != settings):
            raise ValueError(
                "run() was captured in a CUDA graph with other BSR tensors or settings; the graph keeps reading the "
                "BSR arrays it was captured with and its scalar settings (causal, sm_scale, variant scalars). Write "
                "the new step's indices and lengths into the same BSR tensors and keep the settings, or capture again "
                "after calling release_graph()")

        qo32 = qo_cpu.to(torch.int32)
        if len(self._family) > 1 and self._frozen is None and not self.deterministic:  # a captured graph keeps its kernel
            self._use_member(self._pick_member(qo32[1:] - qo32[:-1]))
        kv32 = kv_cpu.to(torch.int32)
        group = self._group_requests and len(kv32) > 1 and int(kv32.numpy().max()) >= PLAN_GROUPED_MIN_KV
        # A causal sliding window (a KV-range mask with a window_left): a row sees window_left + 1 positions.
        window = values.get("window_left") if self._window_cost and causal else None
        kv_window = int(window) + 1 if window is not None and int(window) >= 0 else 0
        ws.plan(qo32, kv32, tile_q=self.rows_per_tile, num_units=self.num_units, causal=bool(causal),
                kv_chunk_align=self.kv_tile, cost_q=self._cost_q, group_requests=group, kv_window=kv_window,
                **({"deterministic_pieces": self._det_pieces, "min_kv_chunk": DETERMINISTIC_MIN_CHUNK}
                   if self.deterministic else {}))

        p = self._params
        p.kv_indices, p.kv_lens, p.qo_indptr = bsr_ptrs[2], bsr_ptrs[1], bsr_ptrs[0]
        p.num_kv_indices = bsr.kv_indices.numel()
        p.kv_block_start = bsr_ptrs[3]
        p.kv_block_start_int64 = int(bsr.kv_block_start.dtype == torch.int64)
        p.kv_pos_start = bsr_ptrs[4]
        p.causal = int(bool(causal))
        self._sm_scale = scale
        p.logits_scale = scale * (float(self._k_scale) if self._fp8 else 1.0)
        self._set_variant_params(values)
        self._bsr_ptrs = bsr_ptrs
        self._bsr = bsr  # run() reads these tensors by address: keep them alive until the next plan
        self._settings = settings
        self._num_rows = int(qo_cpu[-1]) if qo_cpu.numel() else 0
        self._q_shape = torch.Size((self._num_rows, self.num_qo_heads, self.head_dim))
        self._num_kv_blocks_hint = bsr.num_kv_blocks
        self._planned = True

    def release_graph(self) -> None:
        """Forget a captured graph's BSR tensors and settings (after the graph is destroyed)."""
        self._frozen = None

    @staticmethod
    def _scalar_values(values: dict) -> tuple:
        return tuple((k, v if not isinstance(v, torch.Tensor) else v.data_ptr()) for k, v in values.items())

    def _set_variant_params(self, values: dict) -> None:
        keep = {}
        for name, ptype in self.variant.params.items():
            value = values[name]
            _, _, tdtype = PARAM_TYPES[ptype]
            if tdtype is None:
                if isinstance(value, torch.Tensor):
                    value = value.item()
                setattr(self._vparams, name, float(value) if ptype == "float" else int(value))
                continue
            if not isinstance(value, torch.Tensor):
                raise VariantError(f"variant parameter {name} must be a torch.Tensor of {tdtype} (got {type(value).__name__})")
            if value.device != self.device:
                raise VariantError(f"variant parameter {name} must be on {self.device} (got {value.device})")
            if value.dtype != getattr(torch, tdtype):
                raise VariantError(f"variant parameter {name} must have dtype torch.{tdtype} (got {value.dtype})")
            if not value.is_contiguous():
                raise VariantError(f"variant parameter {name} must be contiguous")
            setattr(self._vparams, name, value.data_ptr())
            keep[name] = value
        self._variant_keep = keep

    def _debug_check(self, qo_cpu, kv_cpu, bsr: BSR) -> None:
        torch.cuda.synchronize(self.device)
        if not torch.equal(bsr.qo_indptr.cpu(), qo_cpu.to(torch.int32)):
            raise ValueError("debug: bsr.qo_indptr differs from the qo_indptr given to plan()")
        if not torch.equal(bsr.kv_lens.cpu(), kv_cpu.to(torch.int32)):
            raise ValueError("debug: bsr.kv_lens differs from the kv_lens given to plan()")
        starts = bsr.kv_block_start.cpu().to(torch.int64)
        lens = kv_cpu.to(torch.int64)
        if (lens < 0).any():
            raise ValueError(f"debug: negative kv_lens at requests {torch.nonzero(lens < 0).flatten().tolist()[:8]}")
        nblocks = (lens + self.page_size - 1) // self.page_size
        n_idx = bsr.kv_indices.numel()
        bad = torch.nonzero((starts < 0) | (starts + nblocks > n_idx)).flatten().tolist()
        if bad:
            raise ValueError(f"debug: row blocks {bad[:8]} need kv_indices entries beyond its {n_idx} entries")
        if bsr.num_kv_blocks is not None and n_idx:
            idx = bsr.kv_indices.cpu().to(torch.int64)
            for i in range(lens.numel()):  # debug path only: per-request loop is fine here
                used = idx[int(starts[i]):int(starts[i] + nblocks[i])]
                if used.numel() and (int(used.min()) < 0 or int(used.max()) >= bsr.num_kv_blocks):
                    raise ValueError(f"debug: row block {i} names KV blocks outside [0, {bsr.num_kv_blocks})")

    # -------------------------------------------------------------------------------- run

    def _kv_views(self, kv_cache):
        """(k_ptr, v_ptr, num_blocks, (stride_block, stride_token, stride_head)) of the accepted layouts."""
        # remembered per cache object: an engine's layers call run() with their own caches in turn
        kv = parse_cached(kv_cache, self.kv_layout, head_dim=self.head_dim, page_size=self.page_size)
        if kv.num_heads != self.num_kv_heads:
            raise ValueError(f"the KV cache has {kv.num_heads} KV heads, expected {self.num_kv_heads}")
        if kv.dtype != self.kv_dtype:
            raise TypeError(f"the KV cache has dtype {kv.dtype}, the wrapper was built for {self.kv_dtype}")
        if kv.device != self.device:
            raise ValueError(f"the KV cache is on {kv.device}, the workspace on {self.device}")
        if kv.num_blocks >= 2 ** 31:
            raise ValueError(f"the KV cache has {kv.num_blocks} blocks; at most 2^31 - 1 are addressable")
        return kv.k_ptr, kv.v_ptr, kv.num_blocks, kv.strides

    def run(self, q: torch.Tensor, kv_cache, *, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            return_lse: bool = False, k_scale: float = 1.0, v_scale: float = 1.0):
        """Attention of q [rows, num_qo_heads, head_dim] (rows as planned) against kv_cache.

        out: [rows, num_qo_heads, head_dim] of q's dtype (written in place; allocated when None).
        lse: float32 [rows, num_qo_heads] to receive the natural-log LSE (or return_lse=True to allocate
        one). k_scale / v_scale: per-tensor dequantisation scales of fp8 KV. Returns out, or (out, lse).
        No synchronisation and no allocation when out (and lse) are given; the checks are O(1)."""
        p = self._params
        # Fast path: a few attribute reads; anything unexpected goes to _explain(), which names it.
        try:
            shape, qs, qptr = q.shape, q.stride(), q.data_ptr()
            if (shape != self._q_shape or q.dtype is not self.q_dtype or qs[2] != 1 or (qs[0] | qs[1]) & 7
                    or qptr & 15 or q.device != self.device):
                raise _Bad
            if out is None:
                out = torch.empty(shape, dtype=self.q_dtype, device=self.device)
                os_, optr = out.stride(), out.data_ptr()
            else:
                os_, optr = out.stride(), out.data_ptr()
                if (out.shape != shape or out.dtype is not self.q_dtype or os_[2] != 1 or (os_[0] | os_[1]) & 7
                        or optr & 15 or out.device != self.device):
                    raise _Bad
        except (_Bad, AttributeError, IndexError, TypeError):
            self._explain(q, out)
            raise
        if lse is None and not return_lse:
            if self._lse_on:
                p.lse = None
                self._lse_on = False
        else:
            lse = self._lse_arg(lse, shape[0])
        if kv_cache is not self._kv_obj or (
                self._kv_is_tensor and kv_cache.data_ptr() != self._kv_ptr) or (
                not self._kv_is_tensor and (kv_cache[0] is not self._kv0 or kv_cache[1] is not self._kv1
                                            or kv_cache[0].data_ptr() != self._kv_ptr)):
            self._set_kv(kv_cache)
        p.q = qptr
        p.q_stride_row = qs[0]
        p.q_stride_head = qs[1]
        p.out = optr
        p.out_stride_row = os_[0]
        p.out_stride_head = os_[1]
        if self._fp8 and (k_scale != self._k_scale or v_scale != self._v_scale):
            self._k_scale, self._v_scale = k_scale, v_scale
            p.logits_scale = self._sm_scale * float(k_scale)
            p.v_scale = float(v_scale)
        rc = self._launch(self._params_ref, self._vparams_ref, self.grid[0], self.grid[1], _stream(self._dev_index))
        if rc:
            if rc == _CAPTURED:  # captured into a CUDA graph: pin what the graph reads (see plan())
                self._frozen = (self._bsr_ptrs, self._settings)
            else:
                self._launcher.module.check(rc, "fi_attention_run")
        return (out, lse) if lse is not None else out

    def _kv_maps(self) -> bool:
        """Whether run() with the KV cache it was last given gives the kernel KV TMA maps (the prefill
        kernel's producer then copies whole tiles of consecutive tokens by TMA; else every tile is gathered
        with cp.async). For tests; host only."""
        fn = self._launcher.module.function("fi_attention_kv_maps", [ctypes.c_void_p])
        return bool(fn(self._params_ref))

    def _lse_arg(self, lse, rows):
        if not self.variant.use_softmax:
            raise ValueError(f"variant {self.variant.name} does not use softmax: its LSE is undefined")
        if lse is None:
            lse = torch.empty((rows, self.num_qo_heads), dtype=torch.float32, device=self.device)
        elif (not isinstance(lse, torch.Tensor) or lse.shape != (rows, self.num_qo_heads) or lse.dtype != torch.float32
              or lse.device != self.device or lse.stride(1) != 1):
            raise ValueError(f"lse must be a float32 [{rows}, {self.num_qo_heads}] tensor on {self.device} with "
                             f"contiguous heads (got {getattr(lse, 'dtype', type(lse).__name__)} "
                             f"{tuple(getattr(lse, 'shape', ()))})")
        self._params.lse = lse.data_ptr()
        self._params.lse_stride_row = lse.stride(0)
        self._lse_on = True
        return lse

    def _set_kv(self, kv_cache) -> None:
        kp, vp, nb, strides = self._kv_views(kv_cache)
        p = self._params
        p.k, p.v = kp, vp
        p.kv_stride_block, p.kv_stride_token, p.kv_stride_head = strides
        p.num_kv_blocks = nb
        self._kv_obj = kv_cache
        self._kv_is_tensor = isinstance(kv_cache, torch.Tensor)
        if not self._kv_is_tensor:
            self._kv0, self._kv1 = kv_cache[0], kv_cache[1]
        self._kv_ptr = kp if self._kv_is_tensor else kv_cache[0].data_ptr()

    def _explain(self, q, out) -> None:
        """Raise the error that describes why q / out were rejected by run()'s fast path."""
        if not self._planned:
            raise RuntimeError("BatchAttention.run() called before plan()")
        for name, t in (("q", q), ("out", out)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the workspace on {self.device}")
            if t.dtype != self.q_dtype:
                raise TypeError(f"{name} has dtype {t.dtype}, the wrapper was built for {self.q_dtype}")
            shape = tuple(t.shape)
            if len(shape) != 3 or shape[1] != self.num_qo_heads or shape[2] != self.head_dim:
                raise ValueError(f"{name} must be [rows, {self.num_qo_heads}, {self.head_dim}] (got {shape})")
            if shape[0] != self._num_rows:
                raise ValueError(f"{name} has {shape[0]} rows but the plan was made for {self._num_rows} query rows "
                                 f"(qo_indptr[-1]); call plan() for this step")
            st = t.stride()
            if st[2] != 1 or st[0] % 8 or st[1] % 8 or t.data_ptr() % 16:
                raise ValueError(f"{name} must have a contiguous head_dim and 16-byte aligned rows and heads "
                                 f"(strides {st}, pointer % 16 = {t.data_ptr() % 16})")

    # -------------------------------------------------------------------------------- errors

    def check_errors(self, *, clear: bool = True) -> None:
        """Raise RuntimeError if a kernel met an out-of-range KV index since the last check (synchronises)."""
        flags = int(self._error_flags[0].item())
        if clear and flags:
            self._error_flags.zero_()
        if flags:
            reasons = [msg for bit, msg in _ERROR_BITS.items() if flags & bit]
            raise RuntimeError("BatchAttention: " + "; ".join(reasons) + " (check the BSR passed to plan(); "
                               "plan(..., debug=True) validates it on the host)")


@module_set("prefill", "prefill attention, default variant: head_dim 64/128/256 x bf16/fp16 x (same, fp8 e4m3) "
                       "KV x GQA group 1/4/8")
def _prefill_set():
    return [prefill_spec(DEFAULT, d, q, kv, g, member=m) for d in HEAD_DIMS for q in ("bf16", "fp16")
            for kv in (q, "fp8_e4m3") for g in (1, 4, 8) for m in range(prefill_family_size(d, kv))]


@module_set("decode", "decode attention, default variant: head_dim 64/128/256 x bf16/fp16 x (same, fp8 e4m3) KV "
                      "x GQA group 1/4/8")
def _decode_set():
    specs = []
    for head_dim in HEAD_DIMS:
        for q in ("bf16", "fp16"):
            for kv in (q, "fp8_e4m3"):
                for group in (1, 4, 8):
                    specs.append(decode_spec(DEFAULT, head_dim, q, kv, group))
    return specs
