"""The choice of kernel shape and tile family per (variant, head size, dtypes, GQA group, architecture).

Decode (csrc/attention/decode.cuh) runs one shape per module: query rows per tile, heads per chunk, warps,
16-token KV blocks per warp per tile, stages; a family of two modules where decode_family_size says so. Prefill (csrc/attention/prefill.cuh) runs a family of shapes
per module set, largest query tile first; BatchAttention.plan picks a member per step. Hopper (modules built
for sm_90a only) runs warpgroup MMAs and, where the variant and KV type allow, a warp-specialised member 0.
Why each shape, and what was measured against it: docs/decode.md, docs/prefill.md.
"""
from __future__ import annotations

from typing import Optional

from . import kernels
from .variants import Variant

HEAD_DIMS = (64, 80, 96, 128, 256)
SMEM_PER_SM = 228 * 1024   # Hopper; 227 KiB per CTA at most
SMEM_PER_CTA = 227 * 1024
# The most shared memory a CTA may opt into, by architecture (CUDA's per-block limit). sm_86, sm_89 (RTX 30xx / 40xx,
# A10, L40S) and sm_120 have 99 KiB, sm_80 and sm_87 (A100, Orin) 163 KiB; others not listed get the least.
SMEM_PER_CTA_BY_ARCH = {"80": 163 * 1024, "86": 99 * 1024, "87": 163 * 1024, "89": 99 * 1024, "90": 227 * 1024,
                        "90a": 227 * 1024, "100": 227 * 1024, "100a": 227 * 1024, "120": 99 * 1024}
SMEM_PER_CTA_LEAST = 99 * 1024


def smem_per_cta(archs=None) -> int:
    """The shared memory a CTA may use on every GPU that modules built for `archs` (default: the arch list in effect,
    $FI_BACKEND_CUDA_ARCH_LIST or the device) can run on: the least of their limits. PTX ("80+ptx") may be JIT-compiled
    for any later GPU, so it counts as the least there is. With no device and no arch list, Hopper's."""
    try:
        archs = kernels.resolve_arch_list(archs)
    except RuntimeError:  # nothing is built here
        return SMEM_PER_CTA
    return min(SMEM_PER_CTA_LEAST if a.endswith("+ptx") else SMEM_PER_CTA_BY_ARCH.get(a, SMEM_PER_CTA_LEAST)
               for a in archs)


# ------------------------------------------------------------------------------------ decode

# (warps per CTA, 16-token blocks per warp per tile, pipeline stages) by (head_dim, KV bytes per element):
# 16-bit KV runs small CTAs of short tiles, several an SM: short requests (ShareGPT-like steps) fill their tiles,
# and long ones stream as fast. 4-warp CTAs of 64-token tiles in 2 stages at head size 64 and 128 (4 and 3 an SM);
# at 256, 2-warp CTAs of 32-token tiles in 2 stages (3 an SM: 0.97-1.00 of FlashInfer where 4 x 1 x 2, one an SM,
# ran 0.91-1.00). fp8 keeps 128-token tiles. Variants with a KeyTransform (RoPE) do more work per tile and run two
# 4-warp CTAs per SM. Measured: docs/decode.md.
_SHAPES = {
    (64, 2): (4, 1, 2), (64, 1): (4, 4, 3),
    (128, 2): (4, 1, 2), (128, 1): (4, 2, 3),
    (256, 2): (2, 1, 2), (256, 1): (4, 1, 3),
}
# 16-row tiles (groups above 8) hold twice the accumulators: at 128, two 4-warp CTAs an SM of 64-token tiles in 3
# stages (4 x 1 x 2 lost); at 64 not tried beyond 4 x 2 x 3 (no zoo model).
_SHAPES_ROWS16 = {(64, 2): (4, 2, 3), (128, 2): (4, 1, 3)}
_SHAPES_KEY_TRANSFORM = {(128, 2): (4, 1, 3)}
# The decode family's second member by (packed rows per tile, head_dim, KV bytes), no KeyTransform: one 8-warp CTA
# an SM of 128-token tiles in 3 stages, for steps with fewer (request, unit) pairs than the first member has CTAs.
# Every pair is then split, and a CTA's bytes in flight, not its tiles' fill, set the time (28/4 heads, 1 x 8192:
# 1.05 of FlashInfer against 0.81 on 64-token tiles; 128/8, 7 x 1000: 1.08 against 1.04).
# BatchAttention._decode_member picks per step.
_SHAPES_FEW_PAIRS = {(8, 128, 2): (8, 1, 3), (16, 128, 2): (8, 1, 3)}


def _kv_bytes(kv_dtype: str) -> int:
    """Bytes of a KV element of dtype kv_dtype ("bf16", "fp16", "fp8_e4m3", ...)."""
    return 1 if kv_dtype.startswith("fp8") else 2


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


def _decode_rows_hpc(head_dim: int, group: int) -> tuple:
    """(packed rows per tile, query heads per chunk): the largest divisor of the group that fits a 16-row tile
    (8 rows for head_dim 256, where 16 rows exceed the register file); 8-row tiles when the chunk fits (half the
    P.V work)."""
    max_rows = 8 if _row_dim(head_dim) == 256 else 16
    hpc = max(d for d in range(1, min(group, max_rows) + 1) if group % d == 0)
    return (8 if hpc <= 8 else 16), hpc


def decode_family_size(head_dim: int, kv_bytes: int, group: int, key_transform: bool = False) -> int:
    """Decode modules a wrapper loads: 2 where _SHAPES_FEW_PAIRS has a member for the shape and the two members
    still differ once fitted to the arch list's shared memory (on 99 KiB GPUs both shrink to one shape), else 1."""
    rows, _ = _decode_rows_hpc(head_dim, group)
    if key_transform or (rows, _row_dim(head_dim), kv_bytes) not in _SHAPES_FEW_PAIRS:
        return 1
    return 2 if _table_shape(head_dim, kv_bytes, group, False, 0) != _table_shape(head_dim, kv_bytes, group, False, 1) else 1


def _kernel_shape(head_dim: int, kv_bytes: int, group: int, key_transform: bool = False, member: int = 0) -> dict:
    """Kernel shape for a head_dim, KV element size and GQA group: rows (packed rows per tile),
    hpc (query heads per chunk), warps, sub (16-token blocks per warp per tile), stages."""
    size = decode_family_size(head_dim, kv_bytes, group, key_transform)
    if not 0 <= member < size:
        raise ValueError(f"decode member must be in [0, {size}) for head_dim {head_dim}, group {group} (got {member})")
    return _table_shape(head_dim, kv_bytes, group, key_transform, member)


def _table_shape(head_dim: int, kv_bytes: int, group: int, key_transform: bool, member: int) -> dict:
    """Rows and heads per chunk from _decode_rows_hpc; warps / tile / stages from _SHAPES (16-row tiles, key
    transforms and the family's member 1 from their own tables), fitted to the arch list's shared memory."""
    rows, hpc = _decode_rows_hpc(head_dim, group)
    key = (_row_dim(head_dim), kv_bytes)
    if member == 1:
        warps, sub, stages = _SHAPES_FEW_PAIRS[(rows, *key)]
    elif key_transform and key in _SHAPES_KEY_TRANSFORM:
        warps, sub, stages = _SHAPES_KEY_TRANSFORM[key]
    elif rows == 16 and key in _SHAPES_ROWS16:
        warps, sub, stages = _SHAPES_ROWS16[key]
    else:
        warps, sub, stages = _SHAPES[key]
    return _fit_decode(head_dim, kv_bytes, {"rows": rows, "hpc": hpc, "warps": warps, "sub": sub, "stages": stages})


def _fit_decode(head_dim: int, kv_bytes: int, shape: dict) -> dict:
    """The shape within the arch list's shared memory (_fit): fewer stages, then fewer warps (down to 2; a warp fewer
    is a tile of fewer tokens). On Hopper every table shape fits as it is; where none of these fits, decode_spec says
    so."""
    return _fit(shape, lambda s: _smem_bytes(head_dim, kv_bytes, s),
                lambda s: {**s, "warps": s["warps"] // 2} if s["warps"] > 2 else None)


def _fit(shape: dict, smem, smaller) -> dict:
    """Shrink a kernel shape until smem(shape) is within smem_per_cta(): stages down to 2 first, then smaller(shape)
    (None: no smaller shape; the spec then refuses it by name)."""
    limit = smem_per_cta()
    while smem(shape) > limit:
        nxt = {**shape, "stages": shape["stages"] - 1} if shape["stages"] > 2 else smaller(shape)
        if nxt is None:
            break
        shape = nxt
    return shape


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


# ------------------------------------------------------------------------------------ prefill

# (warps, m fragments of 16 packed query rows per warp, KV tokens per stage, stages, KV tokens per compute
# step) by (head_dim, KV bytes per element), largest query tile first. mma.sync (every GPU but Hopper): two
# fragments per warp halve the shared-memory reads per MMA (each K/V fragment feeds both).
_PREFILL_SHAPES_SYNC = {
    (64, 2): [(8, 1, 64, 3, 64)], (64, 1): [(8, 1, 64, 3, 64)],
    (128, 2): [(8, 2, 64, 2, 64), (8, 1, 64, 3, 64)], (128, 1): [(8, 2, 64, 2, 64), (8, 1, 64, 3, 64)],
    (256, 2): [(4, 1, 32, 2, 32)], (256, 1): [(4, 1, 32, 2, 32)],
}
# Hopper's warpgroup MMAs (prefill_uses_wgmma): a fragment is one m64 MMA of a warpgroup (64 rows), compute
# steps of 32 tokens at least (the MMA's n). Sixteen warps hide the latency of each warpgroup's MMA ->
# softmax -> MMA chain; they leave 128 registers a thread.
_PREFILL_SHAPES_WGMMA = {
    (64, 2): [(16, 1, 64, 2, 64)], (64, 1): [(16, 1, 64, 2, 64)],
    (128, 2): [(16, 1, 64, 2, 64), (8, 1, 64, 3, 64)], (128, 1): [(16, 1, 64, 2, 64), (8, 1, 64, 3, 64)],
    (256, 2): [(8, 1, 64, 2, 64)], (256, 1): [(8, 1, 64, 2, 64)],
}
# A sliding window (mask_is_kv_range) without a producer runs its largest member at 12 warps (168 registers
# a thread: no spills) with the query copy.
_PREFILL_SHAPES_WGMMA_WINDOW = {
    (128, 2): [(12, 1, 64, 2, 64), (8, 1, 64, 3, 64)], (128, 1): [(12, 1, 64, 2, 64), (8, 1, 64, 3, 64)],
}
# plan() picks the largest member that gives every CTA FAMILY_TILES_PER_CTA query tiles, or whole waves of
# tiles (at most FAMILY_WAVE_SLACK more tile slots than tiles), else the smallest.
FAMILY_TILES_PER_CTA = 3
FAMILY_WAVE_SLACK = 1.1
PREFILL_MAX_HEADS_PER_CHUNK = 16

# Warp-specialised member 0 (producer=1, prefill::Config::kProducer: a producer warpgroup issues the tiles,
# the compute warpgroups consume them through mbarriers at their own pace, registers moved to them) for the
# variants that can run it (16-bit KV, no QueryTransform / KeyTransform): "plain" without per-element logits
# hooks (ALiBi by MMA is none), "hooks" with them (12 warps: no spills), "window" for a window mask without a
# logits transform (a fourth stage lets the producer run into the next query tile's short KV range).
# "aligned" is the plain one for heads per chunk that cut 8 x 2's 256 packed rows mid-token but 12 x 1's 192
# rows into whole tokens (3, 6, 12: 64, 32, 16 tokens a tile, so causal tiles line up with 64-token KV tiles).
_PREFILL_WS_MEMBER0 = {
    128: {"plain": (8, 2, 64, 3, 64), "aligned": (12, 1, 64, 3, 64), "hooks": (12, 1, 64, 3, 64),
          "window": (12, 1, 64, 4, 64)},
}
# Forced warp-specialised shapes (tests): member 0's 12 x 1 and 8 x 2 compute warps, the rest of the shape
# from member 0.
PREFILL_WS_TUNINGS = {"w12": {"warps": 12, "mfrags": 1, "producer": 1},
                      "w8m2": {"warps": 8, "mfrags": 2, "stages": 3, "producer": 1}}
# Query buffers of a warp-specialised kernel: the sub-item running and the next one, whose query tile the
# producer copies ahead; each released through a barrier when its sub-item ends, so the stages are free
# to be more (8 x 2: three 32 KB stages beside two 64 KB query buffers).
PREFILL_PRODUCER_Q_BUFFERS = 2
# Split sub-items whose arrivals wait (prefill::Config::kDefer): one fence for several
PREFILL_DEFER = 8


def _producer_blockers(variant: Optional[Variant], head_dim: int, kv_bytes: int, shape: dict,
                       q_buffers: Optional[int] = None) -> list:
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
    q_buffers = q_buffers or PREFILL_PRODUCER_Q_BUFFERS
    smem = _prefill_smem_bytes(head_dim, kv_bytes, {**shape, "producer": 1}, q_buffers)
    if smem > SMEM_PER_CTA:
        why.append(f"{q_buffers} query buffers within {SMEM_PER_CTA} bytes of shared memory "
                   f"(this shape: {smem})")
    return why


# FlashAttention-3's consumer loop (tuning fa3=1, prefill::Config::kOverlap; fa3=2 adds its two consumer
# warpgroups' ping-pong, kPingPong, as FlashAttention-3 runs head sizes up to 128; off by default: no family
# picks it): two consumer warpgroups of 64 rows and a producer, 128-token tiles and steps, three stages (the
# deferred P.V holds a tile's V through the next tile). docs/prefill.md, "The FA3-style member".
PREFILL_FA3_TUNINGS = {
    d: {"warps": 8, "mfrags": 1, "tile": 128, "stages": 3, "step": 128, "wgmma": 1, "producer": 1, "fa3": 2}
    for d in (64, 80, 96, 128)
}


def _fa3_blockers(variant: Optional[Variant], head_dim: int, kv_bytes: int, shape: dict, fa3: int = 1) -> list:
    """Why a shape cannot run FlashAttention-3's consumer loop (empty: it can): beyond the producer's needs,
    one fragment a warp, a step per tile, three stages, a head size of whole 64-column blocks, a variant with
    softmax and without per-element hooks (ALiBi, LogitsTransform, LogitsMask); with ping-pong (fa3 2) two
    consumer warpgroups."""
    why = []
    if fa3 == 2 and shape["warps"] != 8:
        why.append("warps=8 (ping-pong: two consumer warpgroups)")
    if not shape.get("producer"):
        why.append("producer=1")
    if shape["mfrags"] != 1:
        why.append("mfrags=1")
    if shape["step"] != shape["tile"]:
        why.append("step equal to the tile")
    if shape["stages"] < 3:
        why.append("stages >= 3 (a tile's V is held through the next tile)")
    if head_dim > 128:
        why.append("head_dim 64, 80, 96 or 128")
    if variant is not None and (not variant.use_softmax or variant.alibi_slope or variant.logits_transform
                                or variant.logits_mask or variant.mask_is_kv_range):
        why.append("a variant with softmax and without logits hooks, ALiBi or masks")
    return why


def _fa3_q_buffers(head_dim: int, kv_bytes: int, shape: dict) -> int:
    """Query buffers of the fa3 consumer loop, which the producer fills: two where they fit beside the stages,
    else one, released by each compute warp after its last QK^T of a sub-item (prefill::Kernel::consume_overlap),
    so the next query tile still lands while the sub-item's last softmax, P.V and epilogue run."""
    smem = _prefill_smem_bytes(head_dim, kv_bytes, {**shape, "producer": 1}, PREFILL_PRODUCER_Q_BUFFERS)
    return PREFILL_PRODUCER_Q_BUFFERS if smem <= SMEM_PER_CTA else 1


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
    prefill::Config::kRowSumMma: fewer instructions in the softmax) and ALiBi by MMA where it can run (bias)."""
    if wgmma is None:
        wgmma = prefill_uses_wgmma()
    head_dim = _row_dim(head_dim)
    table = _PREFILL_SHAPES_WGMMA if wgmma else _PREFILL_SHAPES_SYNC
    if wgmma and variant is not None and variant.mask_is_kv_range:
        table = {**table, **_PREFILL_SHAPES_WGMMA_WINDOW}
    keys = ("warps", "mfrags", "tile", "stages", "step")
    family = []
    for s in table[(head_dim, kv_bytes)]:
        shape = {**dict(zip(keys, s)), "wgmma": int(wgmma), "producer": 0, "rowsum": int(wgmma)}
        if not wgmma:
            shape = _fit_prefill_sync(head_dim, kv_bytes, shape)
        family.append({**shape, "bias": int(_bias_mma_possible(variant, shape, hpc))})
    ws = _PREFILL_WS_MEMBER0.get(head_dim) if wgmma else None
    if ws:
        # ALiBi by MMA is no per-element hook: without other hooks it runs the plain shape
        bias = int(_bias_mma_possible(variant, {"wgmma": 1, "warps": ws["plain"][0]}, hpc))
        hooked = variant is not None and _logits_hooks(variant, bias)
        if not hooked and not bias:
            # the smaller members warp-specialised too: a producer warpgroup copies the next item's query tile
            # and KV while the compute warps finish one, which pays most on steps of many short items
            # (docs/prefill.md, "The family and how a member is chosen")
            for m in range(1, len(family)):
                shape = {**family[m], "producer": 1}
                if not _producer_blockers(variant, head_dim, kv_bytes, {**shape, "hpc": hpc}):
                    family[m] = shape
        names = ["aligned" if _rows(ws["plain"]) % hpc and not _rows(ws["aligned"]) % hpc else "plain"]
        if hooked:  # a window mask without a transform: 4 stages where they fit (not beside the bias MMA's operands)
            window = variant.mask_is_kv_range and not variant.logits_transform and "window" in ws
            names = ["window", "hooks"] if window else ["hooks"]
        for name in names:
            shape = {**dict(zip(keys, ws[name])), "wgmma": 1, "producer": 1, "rowsum": 1, "bias": bias}
            if not _producer_blockers(variant, head_dim, kv_bytes, {**shape, "hpc": hpc}):
                family[0] = shape
                break
    return family


def _fit_prefill_sync(head_dim: int, kv_bytes: int, shape: dict) -> dict:
    """An mma.sync shape within the arch list's shared memory (_fit; these modules take one query buffer): fewer
    stages, then KV tiles of half the tokens (down to 32, the step with them). Where none of these fits, prefill_spec
    says so."""
    def smaller(s):
        return {**s, "tile": s["tile"] // 2, "step": min(s["step"], s["tile"] // 2)} if s["tile"] > 32 else None
    return _fit(shape, lambda s: _prefill_smem_bytes(head_dim, kv_bytes, s), smaller)


def _rows(shape: tuple) -> int:
    """Packed query rows of a (warps, mfrags, ...) shape tuple."""
    return 16 * shape[0] * shape[1]


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
    sliding-window variant's own where it has one (_PREFILL_SHAPES_WGMMA_WINDOW). Without rowsum and bias,
    which prefill_spec derives from the shape."""
    family = _prefill_family(head_dim, _kv_bytes(kv_dtype), wgmma, variant)
    return [{k: v for k, v in shape.items() if k not in ("rowsum", "bias")} for shape in family]


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
    # a bit a row of each split sub-item waiting for its arrival, and its record (one beside the bias MMA)
    defer = 1 if shape.get("bias") else PREFILL_DEFER
    flags = (defer * tile_rows // 8 + 15) // 16 * 16 + 16 * defer
    # the bias MMA's A blocks (128 bytes a warpgroup), zeros and columns (16 bytes a token of a step); the
    # row-sum MMA's ones
    bias = 128 * (shape["warps"] // 4) + 128 + 16 * shape["step"] if shape.get("bias") else 0
    ones = 256 if shape.get("rowsum") or shape.get("bias") else 0
    return (shape["stages"] * (stage + record) + q_buffers * tile_rows * head_dim * 2 + convert + bias + ones + flags
            + row_offsets + barriers)


def _prefill_q_buffers(variant: Variant, head_dim: int, kv_bytes: int, shape: dict) -> int:
    """Query buffers of a prefill module: one per stage (the loader copies each sub-item's query tile with
    its first KV tile, so no warp waits on Q at a sub-item's start) on Hopper where they fit, for variants
    without a QueryTransform (Q is rotated in registers); else 1 (the warps load Q). Not for variants with
    logits hooks at 16 warps: there the copy's registers and the L1 it takes cost more than it saves (they
    spill at 128 registers a thread; see docs/prefill.md)."""
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
