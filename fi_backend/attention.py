"""BatchAttention, the public attention API (the FlashInfer paper's plan/run shape): plan() once per generation step,
run() per layer.

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
import warnings
from typing import Optional, Sequence

import torch

from . import cute_member, env, kernels
from .formats import BSR, check_prefix_groups
from .kv_cache import parse_cached
from .scheduler import DEFAULT_MIN_KV_CHUNK, DETERMINISTIC_MIN_CHUNK, DETERMINISTIC_PIECES, decode_min_kv_chunk
from .shapes import FAMILY_TILES_PER_CTA, FAMILY_WAVE_SLACK, HEAD_DIMS
from .specs import _SPECS, KERNELS, attention_specs
from .variants import DEFAULT, PARAM_TYPES, Variant, VariantError
from .workspace import Workspace

Q_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
KV_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8_e4m3",
                    torch.float8_e5m2: "fp8_e5m2"}
MAX_PAGE_SIZE = 256

# Error bits of the kernel's error word (csrc/attention/decode.cuh, ErrorBits).
_ERROR_BITS = {
    1: "a KV block index (kv_indices entry) outside [0, num_kv_blocks) was met; those tokens were read as zeros",
    2: "kv_block_start + block offset pointed past the end of kv_indices; those tokens were read as zeros",
}

# Prefill steps of two requests or more with this many KV tokens or more plan request by request (see
# BatchAttention._use_member).
PLAN_GROUPED_MIN_KV = 4096

# Partial rows a request a workspace holds for shared-prefix groups (workspace_for(shared_prefix=True)):
# a grouped row takes its prefix's chunks plus its own state; groups that do not fit stay single-format.
SHARED_ROWS_PER_REQUEST = 9

# LogitsCtx fields a hook may read that are the same for every member of a shared-prefix group (the KV
# token's own, the heads); any other (positions, lengths, rows) makes the variant's shared items wrong.
_SHARED_SAFE_CTX = {"kv_idx", "kv_pos", "qo_head", "kv_head"}


def shared_prefix_supported(variant: Variant) -> bool:
    """Whether a variant can run shared-prefix items (composable formats): its hooks must not depend on the
    query's position or request, since a shared item's rows belong to several requests and run with one
    KV range (docs/composable.md). Query transforms, masks, KV ranges and ALiBi do; a logits transform that
    reads only the KV token's context and the heads (soft-cap, sigmoid) does not. Other variants plan
    their steps single-format, correct and unshared."""
    import re
    if variant.query_transform or variant.logits_mask or variant.kv_range or variant.alibi_slope:
        return False
    body = "".join(variant.logits_transform) if not isinstance(variant.logits_transform, str) else variant.logits_transform
    return set(re.findall(r"ctx\.(\w+)", body or "")) <= _SHARED_SAFE_CTX


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
        ("deterministic", ctypes.c_int32),
    ]


_LAYOUT_FIELDS = ("q", "out", "lse", "k", "num_kv_blocks", "page_div", "kv_block_start_int64", "kv_indices",
                  "kv_pos_start", "plan", "items_offset", "partial_o", "error_flags", "num_qo_heads",
                  "logits_scale", "causal", "deterministic")


def _fastdiv(d: int) -> _FastDiv:
    s = 0
    while (1 << s) < d:
        s += 1
    m = ((1 << 32) * ((1 << s) - d)) // d + 1
    return _FastDiv(d, m & 0xFFFFFFFF, s)


# The attention module's entries' ctypes arguments (csrc/attention/attention_module.cu; tests/test_entry_signatures.py
# checks them against the C declarations)
_RUN_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
_LAYOUT_ARGS = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
_OCCUPANCY_ARGS = [ctypes.POINTER(ctypes.c_int)]
_KV_MAPS_ARGS = [ctypes.c_void_p]


class _Launcher:
    """A loaded attention module: its launcher, its ctypes VariantParams type and its kernel shape."""

    def __init__(self, spec: kernels.ModuleSpec, variant: Variant):
        self.module = kernels.load(spec)
        self.run = self.module.function("fi_attention_run", _RUN_ARGS)
        layout_fn = self.module.function("fi_attention_layout", _LAYOUT_ARGS)
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
                               f"fi_backend.attention's ctypes mirror {expected}; the two must change together")
        self._occupancy = self.module.function("fi_attention_occupancy", _OCCUPANCY_ARGS)

    def blocks_per_sm(self) -> int:
        out = ctypes.c_int(0)
        rc = self._occupancy(ctypes.byref(out))
        if rc:
            self.module.check(rc, "fi_attention_occupancy")
        return max(1, out.value)


_launchers: dict = {}


def _launcher(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int,
              tuning: Optional[dict] = None, kernel: str = "decode", member: int = 0,
              deterministic: bool = False) -> _Launcher:
    kw = {"member": member} if member else {}
    if kernel == "decode" and deterministic:  # its own module (specs.decode_spec)
        kw["deterministic"] = True
    return _launcher_of(_SPECS[kernel](variant, head_dim, q_dtype, kv_dtype, group, tuning=tuning, **kw), variant)


def _launcher_of(spec: kernels.ModuleSpec, variant: Variant) -> _Launcher:
    key = (kernels.loader.memo_key(spec), kernels.resolve_arch_list())   # a spec's module differs by arch list
    entry = _launchers.get(key)
    if entry is None:
        entry = _Launcher(spec, variant)
        _launchers[key] = entry
    return entry


def _family(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int, tuning: Optional[dict],
            kernel: str, deterministic: bool = False) -> list:
    """The kernel's launchers: the prefill tile family (largest query tile first), else the one module (of
    deterministic mode for deterministic decode wrappers)."""
    return [_launcher_of(spec, variant) for spec in attention_specs(variant, head_dim, q_dtype, kv_dtype, group,
                                                                     tuning, kernel, deterministic)]


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


def _decode_ctas(sms: int, per_sm: int, units: int) -> int:
    """A decode grid: per_sm CTAs on every SM, down to a multiple of the units where that leaves any (the kernel
    is memory-bound, so the last few SMs add little bandwidth, while a grid that divides by the units splits a
    uniform batch evenly and plans as unit blocks: csrc/scheduler/planner.h)."""
    total = max(1, sms * per_sm)
    return total - total % units if total >= units else total


def _deterministic(deterministic: Optional[bool]) -> bool:
    return env.flag(env.DETERMINISTIC, False) if deterministic is None else bool(deterministic)


def _workspace_pieces(kernel: str, deterministic: bool) -> int:
    """The Workspace's deterministic_pieces a wrapper needs: decode may cut every request into up to
    DETERMINISTIC_PIECES pieces whatever the batch; prefill cuts nothing in this mode."""
    return DETERMINISTIC_PIECES if deterministic and kernel == "decode" else 0


def plan_cost_q(kernel: str, kv_tile: int, rows_per_tile: int) -> float:
    """The planner's cost of a query row, in KV tokens: decode items cost a tile of KV per row tile (or
    FI_BACKEND_PLAN_DECODE_COST_Q, for experiments); a prefill item's fixed work (its Q tile, its epilogue) is
    about two KV tiles for a whole 128-row tile."""
    if kernel != "decode":
        return 2.0 * kv_tile / rows_per_tile
    cost = env.number(env.PLAN_DECODE_COST_Q)
    if cost is None:
        return float(kv_tile)
    if not cost > 0:
        raise ValueError(f"{env.PLAN_DECODE_COST_Q} must be a number > 0, got {cost}")
    return cost


# The least a prefill item costs the planner in steps with shared-prefix groups, in KV tiles: a small item's time is
# the latency of its start (query, first KV tile) and end (partial state, fence, ticket, merge), not its work. Such
# steps run one-row items of a member's own few tokens; costed by their work, 29 went to one CTA of 16 x 8k + 16,
# which then took five times as long as with the floor. A floor, not an added cost (which slowed plans of 4-tile
# items); 2 tiles came within 4% of the best of 0, 4 and 8 in each of ten measured cells (docs/composable.md, "The
# least an item costs").
PREFILL_GROUP_ITEM_MIN_TILES = 2.0


def prefill_group_item_min(kv_tile: int) -> float:
    """The least an item costs the planner (KV tokens) in a prefill step with shared-prefix groups:
    FI_BACKEND_PLAN_GROUP_ITEM_MIN, else PREFILL_GROUP_ITEM_MIN_TILES KV tiles."""
    cost = env.number(env.PLAN_GROUP_ITEM_MIN)
    if cost is None:
        return PREFILL_GROUP_ITEM_MIN_TILES * kv_tile
    if not cost >= 0:
        raise ValueError(f"{env.PLAN_GROUP_ITEM_MIN} must be a number >= 0, got {cost}")
    return float(cost)


class BatchAttention:
    """Batch attention over the BSR KV format with a plan/run split (see the module docstring).

    workspace      a fi_backend.workspace.Workspace on the GPU (num_ctas: see recommended_num_ctas;
                   max_tile_q: see query_tile_rows; num_qo_heads, num_kv_heads and head_dim as here)
    num_qo_heads, num_kv_heads, head_dim   head_dim in HEAD_DIMS, num_qo_heads % num_kv_heads == 0
    q_dtype        torch.bfloat16 or torch.float16 (the output has the same dtype)
    kv_dtype       q_dtype, or torch.float8_e4m3fn / torch.float8_e5m2 (per-tensor k_scale/v_scale in run)
    page_size      KV block width Bc, 1..256 (1 for token-level tables such as SGLang's)
    ragged         K / V are ragged tensors [total, num_kv_heads, D], run() given (k.unsqueeze(1), v.unsqueeze(1)),
                   and every BSR is formats.from_ragged's (contiguous; page_size 1): prefill wrappers then load
                   the CuTe member's ragged modules, which read a KV tile's rows as one TMA box (an engine's
                   step of new prompts, over the step's own K / V rather than its cache pages)
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
                 tuning: Optional[dict] = None, deterministic: Optional[bool] = None, ragged: bool = False):
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
        if ragged and page_size != 1:
            raise ValueError(f"ragged=True reads K / V rows: page_size must be 1 (got {page_size})")
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
        self.ragged = bool(ragged)
        self._fp8 = kv_dtype not in Q_DTYPES

        self.kernel = kernel
        self.deterministic = _deterministic(deterministic)
        # The tile family (prefill: query tiles of several sizes, largest first; plan() picks one per step).
        # Deterministic decode wrappers load the decode module of that mode (specs.decode_spec).
        self._family = _family(variant, head_dim, Q_DTYPES[q_dtype], KV_DTYPES[kv_dtype], self.group, tuning, kernel,
                               self.deterministic)
        tile_q = max(int(f.rows_per_tile) for f in self._family)
        if tile_q > workspace.max_tile_q:
            raise ValueError(f"the workspace's max_tile_q={workspace.max_tile_q} is below the kernel's query tile "
                             f"({tile_q} rows); construct the Workspace with max_tile_q >= {tile_q} "
                             f"(BatchAttention.query_tile_rows gives it)")
        if kernel == "prefill" and len({f.blocks_per_sm() for f in self._family}) > 1:  # one grid serves them all
            raise RuntimeError(f"prefill tile family of head_dim {head_dim}: members differ in CTAs per SM")
        # The CuTe member (fi_backend.cute_member): FlashAttention-3's CTA for the prefill steps it takes (plan());
        # its page size 0 names ragged K / V
        member_page = 0 if self.ragged else page_size
        self.cute_unsupported = ("decode kernel" if kernel != "prefill" else cute_member.unsupported(
            variant, head_dim, q_dtype, kv_dtype, member_page, self.device, deterministic=self.deterministic,
            tuning=tuning))
        self._cute = None
        if self.cute_unsupported is None:
            try:
                self._cute = cute_member.CuteMember(head_dim, q_dtype, member_page, num_qo_heads, num_kv_heads,
                                                    self.device, variant)
            except kernels.BuildError as e:  # e.g. other CUTLASS headers (FI_BACKEND_CUTLASS_DIR): the family runs
                lines = str(e).splitlines() or [type(e).__name__]
                first = next((l for l in lines if "error" in l.lower()), lines[0])
                self.cute_unsupported = f"its modules failed to build: {first.strip()[:300]}"
                warnings.warn(f"fi-backend: the CuTe prefill member is off for this wrapper, {self.cute_unsupported}")
        self._cute_kv_ok = False  # the KV cache's pointers and strides suit its TMA maps (16-byte multiples)
        self._v_strides = (0, 0, 0)  # V's (block, token, head) strides: K's, or (ragged) a view's of its own
        self._tile_kv_ok = True  # the tile family reads V by K's strides: not where V's differ
        self._rows_buf = None  # ragged K / V of different strides, copied for the tile family (_equal_strides)
        self.num_head_chunks = self.group // int(self._family[0].heads_per_chunk)
        # Units: the query-head groups a work item runs for (KV head unit // num_head_chunks). The plan
        # spreads (item, unit) pairs over the whole grid, so no SM idles for want of a head's queue.
        self.num_units = num_kv_heads * self.num_head_chunks
        # Each member's grid: the workspace's for member 0 (and every prefill member); the decode family's
        # member 1 (one CTA an SM) plans over and launches the CTAs it keeps resident (_decode_ctas).
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._grids = [workspace.num_ctas if m == 0 or kernel == "prefill" else
                       min(workspace.num_ctas, _decode_ctas(sms, f.blocks_per_sm(), self.num_units))
                       for m, f in enumerate(self._family)]
        self._captured = {}  # decode: request count -> the member a CUDA graph was captured with
        self._requests = 0
        # An engine that replays a decode graph only with the request count it was captured with (vLLM, SGLang:
        # padding included) sets this: other counts are then eager steps, free to take either member.
        self.graphs_keep_request_count = False
        self._use_member(0)
        # Deterministic mode: decode splits each request at its own chunk (scheduler.DETERMINISTIC_*); prefill
        # splits nothing and keeps tile member 0, since the member would otherwise follow the batch.
        # plan_into's arguments in this mode, made once (deterministic_pieces 1: prefill cuts nothing)
        self._det_plan_args = ({"deterministic_pieces": DETERMINISTIC_PIECES if kernel == "decode" else 1,
                                "min_kv_chunk": DETERMINISTIC_MIN_CHUNK} if self.deterministic else {})
        needed = _workspace_pieces(kernel, self.deterministic)
        if workspace.deterministic_pieces < needed:
            raise ValueError(f"deterministic=True with the decode kernel needs a Workspace made with "
                             f"deterministic_pieces >= {needed} (got {workspace.deterministic_pieces}; "
                             f"BatchAttention.workspace_for sizes it): every request may be split, whatever the batch")
        # shared-prefix groups run where the variant's hooks allow them and plans are not deterministic
        self._shared_ok = shared_prefix_supported(variant) and not self.deterministic
        self.plan_info = None     # the last plan's scheduler.PlanInfo

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
        p.deterministic = int(self.deterministic)  # aligned tiles, the fold and its merge (docs/deterministic.md)
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
        """The kernel modules this wrapper loaded (its tile family, then the CuTe member's), by cache name."""
        return [f.module.name for f in self._family] + (self._cute.module_names if self._cute is not None else [])

    @property
    def cute_step(self) -> bool:
        """Whether the planned step is the CuTe member's (fi_backend.cute_member): run() launches it, unless the
        KV cache's pointers or strides are not 16-byte multiples or run() is captured in a CUDA graph (the tile
        family then runs it)."""
        return self._cute is not None and self._cute.planned

    @property
    def cute_staged(self) -> bool:
        """Whether the planned step is the CuTe member's with its pages staged into rows (cute_member.STAGE_*)."""
        return self._cute is not None and self._cute.staged

    def cute_takes(self, q_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool = True, **variant_params) -> bool:
        """Whether plan() would give a step of these query / KV lengths (CPU int32 [B]) to the CuTe member (False
        without one): an engine may split a mixed step so that its prefill part goes there (adapters/vllm.py).
        variant_params: the variant's plan() parameters, as plan() gets them (the member reads window_left)."""
        return (self._cute is not None and self._frozen is None
                and self._cute.takes_step(q_lens.to(torch.int32), kv_lens.to(torch.int32), causal,
                                          int(variant_params.get("window_left", -1))))

    def _use_member(self, member: int) -> None:
        """Make family member `member` the kernel that plan() plans for and run() launches."""
        self._member = member
        self._launcher = self._family[member]
        self.grid = (self._grids[member], 1)
        self._launch = self._launcher.run
        self.rows_per_tile = int(self._launcher.rows_per_tile)  # query rows per tile (the planner's tile_q)
        self.kv_tile = int(self._launcher.tile)                  # KV tokens per pipeline stage (chunk alignment)
        self._cost_q = plan_cost_q(self.kernel, self.kv_tile, self.rows_per_tile)
        # Prefill plans go request by request (scheduler.plan_into's group_requests) for steps of two requests
        # or more with one of PLAN_GROUPED_MIN_KV KV tokens or more, so CTAs running at the same time read the
        # same request and head's KV; not for a mask that is the KV range, where it did not pay
        # (docs/planner.md). FI_BACKEND_PLAN_GROUPED=0 turns it off.
        # A sliding window's tiles cost their window, not their prefix (scheduler.plan_into's kv_window), so
        # LPT balances their real cost. FI_BACKEND_PLAN_WINDOW=0: the prefix.
        self._window_cost = (self.kernel == "prefill" and self.variant.mask_is_kv_range
                             and "window_left" in self.variant.params and env.flag(env.PLAN_WINDOW, True))
        self._group_requests = (self.kernel == "prefill" and not self.variant.mask_is_kv_range
                                and env.flag(env.PLAN_GROUPED, True))
        self._partition = env.flag(env.PLAN_PARTITION, True)  # read once, not per plan (docs/planner.md)
        # the least an item costs plans of prefill steps with shared-prefix groups (0: other plans)
        self._group_item_min = prefill_group_item_min(self.kv_tile) if self.kernel != "decode" else 0.0

    def _decode_member(self, requests: int) -> int:
        """The decode family's member for a step of `requests` requests: 1 (deeper per-CTA pipelines) when the
        step has fewer (request, unit) pairs than member 0 has CTAs, so every pair is split; else 0.

        CUDA graphs hold the kernel they were captured with. A count a graph was captured with plans for that
        graph's member. Any other count after a capture plans for a member whose plans every captured kernel
        runs correctly: member 1's run on member 0's kernel (the same query tile; chunks on its tiles' bounds;
        its CTAs a prefix of member 0's grid), not the other way round; unless graphs_keep_request_count (an
        engine that replays a decode graph only with the request count, padding included, it was captured
        with: such a step is eager)."""
        if requests in self._captured:
            return self._captured[requests]
        pick = 1 if requests * self.num_units < self._grids[0] else 0
        return 1 if 1 in self._captured.values() and not self.graphs_keep_request_count else pick

    def _pick_member(self, q_lens: torch.Tensor, grouped: bool = False) -> int:
        """The largest query tile that gives each CTA FAMILY_TILES_PER_CTA tiles on this step, or that fills
        whole waves of CTAs (tiles / CTAs at least 1 and within FAMILY_WAVE_SLACK of a whole number from
        below): fewer, larger tiles otherwise leave CTAs idle on short prefills. Else the smallest. The smallest
        also where a request's tile is mostly empty and a smaller one wastes fewer MMAs: a step with shared-prefix
        groups (grouped: each member's own KV is an item of its few rows; docs/composable.md, "Which kernel"), and
        one whose every request fits in half the largest tile (decode-like rows, short extends; H100, 32 / 8
        heads: 200 x 1 and 64 x 17 1.23-1.32x faster, docs/prefill.md). q_lens: CPU int32 [B]."""
        last = len(self._family) - 1
        if last > 0 and (grouped or (q_lens.numel()
                                     and 2 * int(q_lens.max()) <= int(self._family[0].rows_per_tile))):
            return last
        for m, launcher in enumerate(self._family[:-1]):
            rows = int(launcher.rows_per_tile)
            tiles = int(torch.div(q_lens + (rows - 1), rows, rounding_mode="floor").sum()) * self.num_units
            waves = tiles / self.grid[0]
            if waves >= FAMILY_TILES_PER_CTA or (waves >= 1 and math.ceil(waves) <= FAMILY_WAVE_SLACK * waves):
                return m
        return last

    # -------------------------------------------------------------------------------- sizing

    @staticmethod
    def module_specs(num_qo_heads: int, num_kv_heads: int, head_dim: int, *, q_dtype: torch.dtype = torch.bfloat16,
                     kv_dtype: Optional[torch.dtype] = None, page_size: int = 16, variant: Variant = DEFAULT,
                     kernel: str = "decode", deterministic: Optional[bool] = None, device=None,
                     ragged: bool = False) -> list:
        """The kernel modules (kernels.ModuleSpec) a wrapper of these arguments loads: its tile family and, for
        prefill, the CuTe member's where it would load it on `device`. Builds nothing: an engine's start builds
        them all in parallel (prepare) before making its wrappers, which then load them."""
        q, kv = Q_DTYPES[q_dtype], KV_DTYPES[q_dtype if kv_dtype is None else kv_dtype]
        det = _deterministic(deterministic)
        specs = attention_specs(variant, head_dim, q, kv, num_qo_heads // num_kv_heads, None, kernel, det)
        if kernel == "prefill":
            specs += cute_member.specs_for(variant, head_dim, q, kv, 0 if ragged else page_size, deterministic=det,
                                           device=None if device is None else torch.device(device))
        return specs

    @staticmethod
    def prepare(num_qo_heads: int, num_kv_heads: int, head_dim: int, *, kinds: Sequence[str] = KERNELS,
                also_ragged: bool = False, **shape) -> list:
        """Build in parallel (kernels.prepare) the modules of a wrapper of each kernel in `kinds` with these
        arguments (module_specs' keywords), and with also_ragged those of a ragged prefill wrapper (page_size 1,
        ragged=True) too: an engine's start, before it makes its wrappers. Raises nothing for a failed build (the
        wrapper that loads the module does)."""
        specs = [spec for kernel in kinds for spec in BatchAttention.module_specs(
            num_qo_heads, num_kv_heads, head_dim, kernel=kernel, **shape)]
        if also_ragged:
            specs += BatchAttention.module_specs(num_qo_heads, num_kv_heads, head_dim, kernel="prefill",
                                                 **{**shape, "page_size": 1, "ragged": True})
        return kernels.prepare(specs)

    @staticmethod
    def recommended_num_ctas(device, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
                             q_dtype: torch.dtype = torch.bfloat16, kv_dtype: Optional[torch.dtype] = None,
                             variant: Variant = DEFAULT, kernel: str = "decode", tuning: Optional[dict] = None,
                             deterministic: Optional[bool] = None) -> int:
        """CTAs that fill the GPU once (SMs x resident CTAs per SM): the num_ctas to construct the Workspace
        with. Builds (or loads) the kernel module to read its occupancy (deterministic: the module of that mode,
        as the constructor's argument).

        The decode kernel takes the largest multiple of its units (query-head groups) within that (_decode_ctas;
        the family's first member). Prefill is compute-bound and takes every SM (docs/decode.md,
        docs/prefill.md)."""
        device = torch.device(device)
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        group = num_qo_heads // num_kv_heads
        launcher = _launcher(variant, head_dim, Q_DTYPES[q_dtype], KV_DTYPES[kv_dtype], group, tuning, kernel,
                             deterministic=_deterministic(deterministic))
        with torch.cuda.device(device):
            per_sm = launcher.blocks_per_sm()
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        if kernel != "decode":
            return max(1, sms * per_sm)
        return _decode_ctas(sms, per_sm, num_kv_heads * (group // int(launcher.heads_per_chunk)))

    @staticmethod
    def workspace_for(device, num_qo_heads: int, num_kv_heads: int, head_dim: int, *, max_requests: int,
                      max_tokens: int, q_dtype: torch.dtype = torch.bfloat16, kv_dtype: Optional[torch.dtype] = None,
                      variant: Variant = DEFAULT, kernel: str = "decode", tuning: Optional[dict] = None,
                      deterministic: Optional[bool] = None, shared_prefix: bool = False,
                      shared_prefix_requests: Optional[int] = None) -> Workspace:
        """A Workspace sized for one wrapper of these arguments: the kernel's grid (recommended_num_ctas), its
        query tile (query_tile_rows) and, in deterministic mode, the pieces its plans may cut requests into;
        shared_prefix: partial rows for shared-prefix groups, SHARED_ROWS_PER_REQUEST a request for
        shared_prefix_requests requests (None: max_requests; groups beyond them plan single-format)."""
        shape = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, variant=variant, kernel=kernel, tuning=tuning,
                     deterministic=deterministic)
        return Workspace(device, max_requests=max_requests, max_tokens=max_tokens,
                         num_ctas=BatchAttention.recommended_num_ctas(device, num_qo_heads, num_kv_heads, head_dim,
                                                                      **shape),
                         max_tile_q=BatchAttention.query_tile_rows(num_qo_heads, num_kv_heads, head_dim, **shape),
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         deterministic_pieces=_workspace_pieces(kernel, _deterministic(deterministic)),
                         shared_prefix_rows=SHARED_ROWS_PER_REQUEST * (
                             max_requests if shared_prefix_requests is None else min(shared_prefix_requests, max_requests))
                         if shared_prefix else 0)

    @staticmethod
    def query_tile_rows(num_qo_heads: int, num_kv_heads: int, head_dim: int, *, q_dtype: torch.dtype = torch.bfloat16,
                        kv_dtype: Optional[torch.dtype] = None, variant: Variant = DEFAULT, kernel: str = "decode",
                        tuning: Optional[dict] = None, deterministic: Optional[bool] = None) -> int:
        """Query rows of the kernel's tile (the planner's tile_q): the max_tile_q to construct the
        Workspace with. Builds (or loads) the kernel module (deterministic: of that mode) to read its layout."""
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        return max(int(f.rows_per_tile) for f in _family(variant, head_dim, Q_DTYPES[q_dtype], KV_DTYPES[kv_dtype],
                                                          num_qo_heads // num_kv_heads, tuning, kernel,
                                                          _deterministic(deterministic)))

    # -------------------------------------------------------------------------------- plan

    def plan(self, qo_indptr, kv_lens, bsr: BSR, *, causal: bool = False, sm_scale: Optional[float] = None,
             debug: bool = False, prefix_groups=None, idle: bool = False, **variant_params):
        """Plan a step: qo_indptr int32 [B + 1] and kv_lens int32 [B] on the CPU (this step's query rows
        and KV lengths per request), bsr the step's KV as a device BSR with the same rows and lengths
        (block_width == page_size). Variant parameters by name (see fi_backend.variants). debug=True
        also checks the BSR on the host (indices in range, lengths agree) and synchronises.

        prefix_groups (composable formats, docs/composable.md): None, or int [G, 3] on the CPU, rows (first
        request, end request, prefix tokens): requests [first, end), consecutive, share the KV blocks of
        their first prefix tokens (<= each one's KV before its query). The kernel then reads that prefix
        once per query tile of the group and merges it with each member's own KV [prefix, kv_len), in the
        same launch. Groups that do not pay off stay single-format (plan_info.shared_groups counts the kept
        ones); deterministic wrappers and variants whose hooks see query positions
        (shared_prefix_supported) plan every group single-format. debug=True checks the groups against the
        BSR (check_prefix_groups: naming the group and the request).

        idle=True: the same rows, settings and BSR, but no work items (plan_info.kind "idle"): run() then launches
        the kernel, whose CTAs find their queues empty and write nothing. For two wrappers captured in one CUDA
        graph over one output, where each step gives its work to one of them and an idle plan to the other."""
        ws = self.workspace
        if not isinstance(bsr, BSR):
            raise TypeError(f"bsr must be a fi_backend.formats.BSR (got {type(bsr).__name__})")
        if bsr.block_width != self.page_size:
            raise ValueError(f"bsr.block_width ({bsr.block_width}) must equal the wrapper's page_size ({self.page_size})")
        if self.ragged and not bsr.contiguous:
            raise ValueError("a ragged wrapper (ragged=True) takes BSRs over ragged K / V rows (bsr.contiguous, as "
                             "formats.from_ragged makes them); for a token table make the wrapper with ragged=False")
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
            if prefix_groups is not None:
                check_prefix_groups(bsr, prefix_groups, qo_cpu, kv_cpu)
        groups = None
        if prefix_groups is not None and self._shared_ok:
            groups = prefix_groups.numpy() if isinstance(prefix_groups, torch.Tensor) else prefix_groups
            if len(groups) == 0:
                groups = None

        bsr_ptrs = (bsr.qo_indptr.data_ptr(), bsr.kv_lens.data_ptr(), bsr.kv_indices.data_ptr(),
                    bsr.kv_block_start.data_ptr(), 0 if bsr.kv_pos_start is None else bsr.kv_pos_start.data_ptr())
        settings = (bool(causal), scale, self._scalar_values(values))
        if self._frozen is not None and (self._frozen[0] != bsr_ptrs or self._frozen[1] != settings):
            raise ValueError(
                "run() was captured in a CUDA graph with other BSR tensors or settings; the graph keeps reading the "
                "BSR arrays it was captured with and its scalar settings (causal, sm_scale, variant scalars). Write "
                "the new step's indices and lengths into the same BSR tensors and keep the settings, or capture again "
                "after calling release_graph()")

        if idle:   # no items; the member stays (a capture freezes the one it finds)
            self.plan_info = ws.plan_idle(int(qo_cpu[-1]) if qo_cpu.numel() else 0, B, tile_q=self.rows_per_tile,
                                          num_units=self.num_units)
        else:
            qo32 = qo_cpu.to(torch.int32)
            q_lens = qo32[1:] - qo32[:-1]
            member = self._member
            if len(self._family) > 1 and self.kernel == "decode":
                member = self._decode_member(B)
            elif len(self._family) > 1 and self._frozen is None and not self.deterministic:  # a captured graph keeps its kernel
                member = self._pick_member(q_lens, grouped=groups is not None)
            if member != self._member:
                self._use_member(member)
            kv32 = kv_cpu.to(torch.int32)
            max_kv = int(kv32.numpy().max()) if B else 0
            group = self._group_requests and B > 1 and max_kv >= PLAN_GROUPED_MIN_KV
            # A causal sliding window (a KV-range mask with a window_left): a row sees window_left + 1 positions.
            window = values.get("window_left") if self._window_cost and causal else None
            kv_window = int(window) + 1 if window is not None and int(window) >= 0 else 0
            # decode: a floor that keeps the merge's depth near DECODE_MAX_CHUNKS on steps of very few pairs
            min_chunk = (decode_min_kv_chunk(B * self.num_units, self.grid[0], max_kv)
                         if self.kernel == "decode" else DEFAULT_MIN_KV_CHUNK)
            self.plan_info = ws.plan(qo32, kv32, tile_q=self.rows_per_tile, num_units=self.num_units,
                                     causal=bool(causal), kv_chunk_align=self.kv_tile, cost_q=self._cost_q,
                                     group_requests=group, kv_window=kv_window, partition=self._partition,
                                     groups=groups, num_ctas=self.grid[0],
                                     cost_item_min=self._group_item_min if groups is not None else 0.0,
                                     **(self._det_plan_args or {"min_kv_chunk": min_chunk}))
            if self._cute is not None:  # not for steps a graph replays, shared-prefix groups or positions of their own
                allowed = (self._frozen is None and groups is None and bsr.kv_pos_start is None
                           and bsr.kv_indices.numel() < 2 ** 31)
                self._cute.plan(q_lens, kv32, bool(causal), allowed, window_left=int(values.get("window_left", -1)),
                                logits_soft_cap=float(values.get("logits_soft_cap", 0.0)))
        if idle and self._cute is not None:
            self._cute.plan(None, None, bool(causal), allowed=False)
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
        self._requests = B
        self._planned = True

    def for_prefix_groups(self) -> "BatchAttention":
        """Make this prefill wrapper one that runs decode steps with shared-prefix groups (an adapter's
        graph_prefill): it takes the family's smallest query tile now, the member its group steps plan for, so a
        CUDA graph captured on one of its idle plans holds that kernel (plan() keeps a captured graph's member).
        Returns self."""
        if self.kernel != "prefill":
            raise ValueError(f"for_prefix_groups() is for prefill wrappers; this one's kernel is {self.kernel!r}")
        if self._frozen is not None:
            raise ValueError("for_prefix_groups() after a CUDA-graph capture: call it before capturing")
        self._use_member(self._pick_member(torch.zeros(0, dtype=torch.int32), grouped=True))
        return self

    def release_graph(self) -> None:
        """Forget the captured graphs' BSR tensors, settings and decode members (after the graphs are destroyed)."""
        self._frozen = None
        self._captured = {}

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
        """(k_ptr, v_ptr, num_blocks, (stride_block, stride_token, stride_head), V's strides) of the accepted
        layouts."""
        # remembered per cache object: an engine's layers call run() with their own caches in turn
        # ragged: an engine's key and value of a step may be views of different tensors (vLLM's key after the
        # rotary embedding, value in the fused QKV projection's output)
        kv = parse_cached(kv_cache, self.kv_layout, head_dim=self.head_dim, page_size=self.page_size,
                          v_strides_free=self.ragged)
        if kv.num_heads != self.num_kv_heads:
            raise ValueError(f"the KV cache has {kv.num_heads} KV heads, expected {self.num_kv_heads}")
        if kv.dtype != self.kv_dtype:
            raise TypeError(f"the KV cache has dtype {kv.dtype}, the wrapper was built for {self.kv_dtype}")
        if kv.device != self.device:
            raise ValueError(f"the KV cache is on {kv.device}, the workspace on {self.device}")
        if kv.num_blocks >= 2 ** 31:
            raise ValueError(f"the KV cache has {kv.num_blocks} blocks; at most 2^31 - 1 are addressable")
        return kv.k_ptr, kv.v_ptr, kv.num_blocks, kv.strides, kv.v_strides

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
        if self._cute is not None and self._cute.planned and self._cute_kv_ok:
            rc = self._cute.launch(p, self._v_strides, _stream(self._dev_index))
            if rc == 0:
                return (out, lse) if lse is not None else out
            if rc != cute_member.CAPTURE_REFUSED:
                self._cute.check(rc)
            # capturing: the tile family's kernel, whose plan plan() made too, goes into the graph
        if not self._tile_kv_ok:   # the tile family reads V by K's strides: these rows through one kept buffer
            self._set_kv(self._equal_strides(kv_cache))
        rc = self._launch(self._params_ref, self._vparams_ref, self.grid[0], self.grid[1], _stream(self._dev_index))
        if rc:
            if rc == _CAPTURED:  # captured into a CUDA graph: pin what the graph reads (see plan())
                self._frozen = (self._bsr_ptrs, self._settings)
                if self._cute is not None:  # the member takes no step again
                    self._cute.release_staging()
                if self.kernel == "decode":
                    self._captured[self._requests] = self._member
            else:
                self._launcher.module.check(rc, "fi_attention_run")
        return (out, lse) if lse is not None else out

    def _kv_maps(self) -> bool:
        """Whether run() with the KV cache it was last given gives the kernel KV TMA maps (the prefill
        kernel's producer then copies whole tiles of consecutive tokens by TMA; else every tile is gathered
        with cp.async). For tests; host only."""
        fn = self._launcher.module.function("fi_attention_kv_maps", _KV_MAPS_ARGS)
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

    def _equal_strides(self, kv_cache):
        """A ragged (k, v) pair [rows, 1, heads, D] of different strides copied into this wrapper's buffer, so both
        have its strides: for the tile family, which reads V by K's (the CuTe member reads each by its own). The
        buffer is made at the first such step and grown only for a longer one."""
        k, v = kv_cache
        rows = k.shape[0]
        if self._rows_buf is None or self._rows_buf.shape[1] < rows:
            self._rows_buf = torch.empty((2, (rows + 1023) // 1024 * 1024, *k.shape[1:]), dtype=k.dtype,
                                         device=k.device)
        kb, vb = self._rows_buf[0, :rows], self._rows_buf[1, :rows]
        kb.copy_(k)
        vb.copy_(v)
        return kb, vb

    def _set_kv(self, kv_cache) -> None:
        kp, vp, nb, strides, v_strides = self._kv_views(kv_cache)
        p = self._params
        p.k, p.v = kp, vp
        p.kv_stride_block, p.kv_stride_token, p.kv_stride_head = strides
        p.num_kv_blocks = nb
        self._v_strides = v_strides
        self._tile_kv_ok = v_strides == strides
        # TMA: 16-byte multiples
        self._cute_kv_ok = (kp | vp) % 16 == 0 and all(st % 8 == 0 for st in strides + v_strides)
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
