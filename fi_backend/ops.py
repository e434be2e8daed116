"""Standalone GPU operations: merging attention states (O, LSE), and appending tokens to a paged KV cache.

merge_state(v_a, s_a, v_b, s_b)   two states -> one:   v_* [seq, heads, D], s_* [seq, heads] float32
merge_states(v, s)                 S states -> one:     v [seq, S, heads, D], s [seq, S, heads] float32

O = sum_i e^{s_i - LSE} O_i, LSE = log sum_i e^{s_i} (FlashInfer paper, section 2.2). A state with
LSE = -inf is empty: it contributes nothing and its O is not read; all empty -> O = 0, LSE = -inf.
O may be bf16, fp16 or fp32 (math in fp32), head_dim a multiple of 8 up to 512. Rows (dim 0) may be
strided views; each row must be contiguous and O 16-byte aligned. Outputs must not overlap inputs.

append_paged_kv_cache(key, value, kv_cache, slot_mapping, *, kv_layout="NHD", k_scale=None, v_scale=None)
    The engines' KV write path (vLLM's reshape_and_cache_flash, SGLang's set_kv_buffer): token t < n of
    key / value [num_tokens, num_kv_heads, head_dim] (bf16 or fp16; rows and heads may be strided views,
    e.g. slices of a fused QKV output, with a contiguous head_dim and 16-byte aligned rows) goes to slot
    s = slot_mapping[t] (int32 or int64 [n], n <= num_tokens): block s // page, offset s % page. s < 0
    is padding (skipped); s >= num_blocks * page is skipped and recorded per device for
    check_append_errors(), which synchronises, raises naming the count and the largest slot, and clears.
    kv_cache: any layout of fi_backend.kv_cache (packed [blocks, page, heads, 2 D] NHD / [blocks, heads,
    page, 2 D] HND, a (k, v) pair of 4-D NHD / HND or of 3-D [slots, heads, D]); the page size comes from
    its shape. Its dtype is key's (a copy) or torch.float8_e4m3fn / float8_e5m2: stored =
    saturate(x / scale) rounded to nearest even, k_scale for K and v_scale for V (None = 1.0, a float,
    or a 1-element float32 tensor read by the kernel; ignored for copies). Slots should be distinct.

Kernels run on the current CUDA stream without allocating or synchronising (CUDA-graph capturable;
a graph replays with whatever the captured tensors hold, slots and tensor scales included) and are
built on first use per dtype (prebuild: `fi-backend build merge append`).
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch

from . import kernels
from .kernels.sets import append_spec
from .kv_cache import parse_cached

_P, _I = ctypes.c_void_p, ctypes.c_int64
_MERGE_STATE_ARGS = [_P] * 6 + [_I] * 9 + [_P]
_MERGE_STATES_ARGS = [_P] * 4 + [_I] * 8 + [_P]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ACCEPTED = "torch.bfloat16, torch.float16, torch.float32"
_MAX_HEAD_DIM = 512

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _stream(device_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


# dtype -> (module, fi_merge_state, fi_merge_states), filled on first use of each dtype.
_launchers: dict = {}


def _merge_launchers(dtype: torch.dtype):
    entry = _launchers.get(dtype)
    if entry is None:
        module = kernels.load(kernels.merge_spec(_DTYPES[dtype]))
        entry = (module, module.function("fi_merge_state", _MERGE_STATE_ARGS),
                 module.function("fi_merge_states", _MERGE_STATES_ARGS))
        _launchers[dtype] = entry
    return entry


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Every dim but the first is laid out contiguously (dims of size 1 may have any stride)."""
    expected = 1
    for d in range(t.dim() - 1, 0, -1):
        size = t.size(d)
        if size != 1 and t.stride(d) != expected:
            return False
        expected *= size
    return True


# The per-call checks are one expression per tensor (a few attribute reads); only when one fails do
# the _explain_* functions work out which rule broke, for the error message.

def _v_ok(t, shape, dtype, device_index: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype is dtype and t.shape == shape
            and t.get_device() == device_index and (t.is_contiguous() or _rows_contiguous(t))
            and not t.data_ptr() & 15 and (shape[0] <= 1 or not (t.stride(0) * t.element_size()) & 15))


def _s_ok(t, shape, device_index: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.shape == shape
            and t.get_device() == device_index and (t.is_contiguous() or _rows_contiguous(t)))


def _outputs(out, out_lse, shape, lse_shape, dtype, device, index):
    """The caller's out / out_lse after checking them, or new tensors where None was given."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    elif not _v_ok(out, shape, dtype, index):
        _explain("out", out, shape, device, dtype, False)
    if out_lse is None:
        out_lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
    elif not _s_ok(out_lse, lse_shape, index):
        _explain("out_lse", out_lse, lse_shape, device, dtype, True)
    return out, out_lse


def _explain(name: str, t, shape, device: torch.device, dtype, lse: bool) -> None:
    """Raise the error saying why `t` was refused (called only after a fast check failed)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs (got {t.device})")
    if lse and t.dtype != torch.float32:
        raise TypeError(f"{name} (LSE) must have dtype torch.float32 (got {t.dtype})")
    if not lse and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} like the other states (got {t.dtype})")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)} (got {list(t.shape)})")
    if not _rows_contiguous(t):
        raise ValueError(f"{name} must be contiguous within each row (dim 0 may be strided; "
                         f"got strides {t.stride()} for shape {list(t.shape)})")
    raise ValueError(f"{name} must be 16-byte aligned: data pointer and row stride in bytes a "
                     f"multiple of 16 (got pointer % 16 = {t.data_ptr() % 16}, row stride "
                     f"{t.stride(0)} elements of {t.element_size()} bytes)")


def _check_first(name: str, t, ndim: int, dims: str) -> None:
    """The tensor that fixes device, dtype and shape for the others."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor (got device {t.device})")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must have dtype {_ACCEPTED} (got {t.dtype})")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {dims} (got shape {list(t.shape)})")
    head_dim = t.size(-1)
    if head_dim % 8 or not 0 < head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim (last dim) must be a multiple of 8 in [8, {_MAX_HEAD_DIM}] "
                         f"(got {head_dim})")


def _launch(module, fn, name: str, device_index: int, args) -> None:
    if device_index != _current_device():
        # Launchers use the thread's current CUDA context: make it the tensors' device.
        with torch.cuda.device(device_index):
            rc = fn(*args, _stream(device_index))
    else:
        rc = fn(*args, _stream(device_index))
    if rc:
        module.check(rc, name)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, *,
                out: Optional[torch.Tensor] = None,
                out_lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states: v_a, v_b [seq, heads, D] (bf16/fp16/fp32), s_a, s_b [seq, heads]
    float32 LSEs (natural log). Returns (v [seq, heads, D] of v_a's dtype, s [seq, heads] float32),
    written into `out` / `out_lse` when given."""
    _check_first("v_a", v_a, 3, "[seq, heads, head_dim]")
    shape, dtype, index = v_a.shape, v_a.dtype, v_a.get_device()
    seq, heads, head_dim = shape
    lse_shape = shape[:2]
    if not (_v_ok(v_a, shape, dtype, index) and _v_ok(v_b, shape, dtype, index)
            and _s_ok(s_a, lse_shape, index) and _s_ok(s_b, lse_shape, index)):
        for name, t, lse in (("v_a", v_a, False), ("v_b", v_b, False), ("s_a", s_a, True), ("s_b", s_b, True)):
            if not (_s_ok(t, lse_shape, index) if lse else _v_ok(t, shape, dtype, index)):
                _explain(name, t, lse_shape if lse else shape, v_a.device, dtype, lse)
    out, out_lse = _outputs(out, out_lse, shape, lse_shape, dtype, v_a.device, index)
    if seq == 0 or heads == 0:
        return out, out_lse
    module, fn, _ = _merge_launchers(dtype)
    _launch(module, fn, "fi_merge_state", index, (
        v_a.data_ptr(), s_a.data_ptr(), v_b.data_ptr(), s_b.data_ptr(), out.data_ptr(), out_lse.data_ptr(),
        seq, heads, head_dim, v_a.stride(0), s_a.stride(0), v_b.stride(0), s_b.stride(0),
        out.stride(0), out_lse.stride(0)))
    return out, out_lse


def merge_states(v: torch.Tensor, s: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                 out_lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge S attention states per row: v [seq, S, heads, D] (bf16/fp16/fp32), s [seq, S, heads]
    float32 LSEs (natural log), S >= 1. Returns (v [seq, heads, D] of v's dtype, s [seq, heads]
    float32), written into `out` / `out_lse` when given."""
    _check_first("v", v, 4, "[seq, num_states, heads, head_dim]")
    shape, dtype, index = v.shape, v.dtype, v.get_device()
    seq, num_states, heads, head_dim = shape
    if num_states < 1:
        raise ValueError(f"v: num_states (dim 1) must be at least 1 (got shape {list(shape)})")
    if not _v_ok(v, shape, dtype, index):
        _explain("v", v, shape, v.device, dtype, False)
    if not _s_ok(s, shape[:3], index):
        _explain("s", s, shape[:3], v.device, dtype, True)
    out_shape, lse_shape = torch.Size((seq, heads, head_dim)), torch.Size((seq, heads))
    out, out_lse = _outputs(out, out_lse, out_shape, lse_shape, dtype, v.device, index)
    if seq == 0 or heads == 0:
        return out, out_lse
    module, _, fn = _merge_launchers(dtype)
    _launch(module, fn, "fi_merge_states", index, (
        v.data_ptr(), s.data_ptr(), out.data_ptr(), out_lse.data_ptr(), seq, num_states, heads, head_dim,
        v.stride(0), s.stride(0), out.stride(0), out_lse.stride(0)))
    return out, out_lse


# ----------------------------------------------------------------------------- append_paged_kv_cache

_KEY_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP8_DTYPES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_C_INT, _C_FLOAT = ctypes.c_int, ctypes.c_float
_APPEND_ARGS = ([_P, _P] + [_I] * 4 + [_P, _P] + [_I] * 5 + [_P, _I, _C_INT] + [_I] * 3 + [_P, _P]
                + [_C_FLOAT, _C_FLOAT, _P])
_ERRORS_ARGS = [ctypes.POINTER(ctypes.c_uint64), _C_INT]

# (key dtype, cache dtype) -> (module, fi_append_paged_kv_cache), filled on first use.
_append_launchers: dict = {}
# device index -> {module name: module} launched there: whose error words check_append_errors reads.
_append_used: dict = {}


def _append_launcher(key_dtype: torch.dtype, cache_dtype: torch.dtype):
    entry = _append_launchers.get((key_dtype, cache_dtype))
    if entry is None:
        k = _KEY_DTYPES[key_dtype]
        module = kernels.load(append_spec(k, _FP8_DTYPES.get(cache_dtype, k)))
        entry = (module, module.function("fi_append_paged_kv_cache", _APPEND_ARGS))
        _append_launchers[(key_dtype, cache_dtype)] = entry
    return entry


def _rows(name: str, t, shape, dtype, dev: int):
    """(token stride, head stride) of key / value [num_tokens, heads, D] after checking it. Strides of
    dims of size 1 are passed as 0 (never multiplied by a nonzero index)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype is not dtype:
        raise TypeError(f"{name} must have key's dtype {dtype} (got {t.dtype})")
    if t.shape != shape:
        raise ValueError(f"key and value must have the same shape [num_tokens, heads, head_dim] (got "
                         f"{list(shape)} and {list(t.shape)} for {name})")
    if t.get_device() != dev:
        raise ValueError(f"{name} must be on the same device as the KV cache (got {t.device})")
    st = t.stride()
    ts = 0 if shape[0] == 1 else st[0]
    hs = 0 if shape[1] == 1 else st[1]
    if st[2] != 1 or (ts | hs) & 7 or t.data_ptr() & 15:
        raise ValueError(f"{name} must have a contiguous head_dim and 16-byte aligned rows and heads (strides "
                         f"{st} in elements of 2 bytes, data pointer % 16 = {t.data_ptr() % 16}); slices of a "
                         f"fused QKV output qualify when head_dim is a multiple of 8")
    return ts, hs


def _scale(name: str, s, dev: int):
    """(device pointer or 0, value) of an fp8 scale: None = 1.0, a Python number, or a 1-element
    float32 tensor on the cache's device (read by the kernel, so it can change between graph replays)."""
    if s is None:
        return 0, 1.0
    if isinstance(s, torch.Tensor):
        if s.dtype is not torch.float32 or s.numel() != 1 or s.get_device() != dev:
            raise ValueError(f"{name} as a tensor must be a 1-element torch.float32 tensor on the KV cache's "
                             f"device cuda:{dev} (got {s.dtype} {list(s.shape)} on {s.device})")
        return s.data_ptr(), 1.0
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return 0, float(s)
    raise TypeError(f"{name} must be None, a float or a 1-element float32 tensor (got {type(s).__name__})")


def _append_arguments(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale, *, require_cuda=True):
    """Check the arguments of append_paged_kv_cache; returns (key dtype, cache dtype, device index, n,
    launcher arguments without the stream). require_cuda=False lets CPU tests exercise the checks."""
    if not isinstance(key, torch.Tensor):
        raise TypeError(f"key must be a torch.Tensor (got {type(key).__name__})")
    dtype = key.dtype
    if dtype not in _KEY_DTYPES:
        raise TypeError(f"key must have dtype torch.bfloat16 or torch.float16 (got {dtype})")
    if key.dim() != 3:
        raise ValueError(f"key must be 3-D [num_tokens, num_kv_heads, head_dim] (got shape {list(key.shape)})")
    kv = parse_cached(kv_cache, kv_layout)
    dev = key.get_device()
    if require_cuda and dev < 0:
        raise ValueError(f"key, value, kv_cache and slot_mapping must be CUDA tensors (got key on {key.device})")
    if kv.device != key.device:
        raise ValueError(f"kv_cache must be on key's device {key.device} (got {kv.device})")
    if kv.dtype is not dtype and kv.dtype not in _FP8_DTYPES:
        raise TypeError(f"a {dtype} key is stored in a cache of dtype {dtype}, torch.float8_e4m3fn or "
                        f"torch.float8_e5m2 (got a {kv.dtype} cache)")
    shape = key.shape
    num_tokens, heads, head_dim = shape
    if heads != kv.num_heads or head_dim != kv.head_dim:
        raise ValueError(f"key/value rows are [heads, head_dim] = [{heads}, {head_dim}] but the KV cache holds "
                         f"[{kv.num_heads}, {kv.head_dim}] per token")
    if head_dim % 8 or not 0 < head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, {_MAX_HEAD_DIM}] (got {head_dim})")
    k_ts, k_hs = _rows("key", key, shape, dtype, dev)
    v_ts, v_hs = _rows("value", value, shape, dtype, dev)
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor (got {type(slot_mapping).__name__})")
    sdt = slot_mapping.dtype
    if sdt is not torch.int64 and sdt is not torch.int32:
        raise TypeError(f"slot_mapping must have dtype torch.int32 or torch.int64 (got {sdt})")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [n] (got shape {list(slot_mapping.shape)})")
    n = slot_mapping.shape[0]
    if n > num_tokens:
        raise ValueError(f"slot_mapping has {n} entries but key/value only {num_tokens} tokens (n <= num_tokens)")
    if slot_mapping.get_device() != dev:
        raise ValueError(f"slot_mapping must be on key's device {key.device} (got {slot_mapping.device})")
    if kv.dtype in _FP8_DTYPES:
        ks_ptr, ks = _scale("k_scale", k_scale, dev)
        vs_ptr, vs = _scale("v_scale", v_scale, dev)
    else:  # a copy: scales do not apply
        ks_ptr = vs_ptr = 0
        ks = vs = 1.0
    sb, st, sh = kv.strides
    args = (key.data_ptr(), value.data_ptr(), k_ts, k_hs, v_ts, v_hs, kv.k_ptr, kv.v_ptr, sb, st, sh,
            kv.num_blocks, kv.page_size, slot_mapping.data_ptr(), slot_mapping.stride(0),
            int(sdt is torch.int64), n, heads, head_dim, ks_ptr, vs_ptr, ks, vs)
    return dtype, kv.dtype, dev, n, args


def append_paged_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache, slot_mapping: torch.Tensor, *,
                          kv_layout: str = "NHD", k_scale=None, v_scale=None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into a paged KV cache: token t < n goes to
    slot s = slot_mapping[t] (n = len(slot_mapping) <= num_tokens), block s // page, offset s % page.
    Slots < 0 are padding and skipped; slots past the cache are skipped and reported by
    check_append_errors(). The cache (any layout of fi_backend.kv_cache) has key's dtype (a copy) or an
    fp8 dtype: stored = saturate(x / scale), k_scale for K and v_scale for V (None = 1.0, a float, or a
    1-element float32 tensor read on the device). In place, on the current stream, capturable."""
    dtype, cache_dtype, dev, n, args = _append_arguments(key, value, kv_cache, slot_mapping, kv_layout,
                                                         k_scale, v_scale)
    if n == 0:
        return
    module, fn = _append_launcher(dtype, cache_dtype)
    used = _append_used.get(dev)
    if used is None:
        used = _append_used[dev] = {}
    used[module.name] = module
    _launch(module, fn, "fi_append_paged_kv_cache", dev, args)


def check_append_errors(device=None) -> None:
    """Raise RuntimeError if an append_paged_kv_cache since the last check met a slot past the end of
    its cache (those tokens were not written), then clear the record. Synchronises `device` (default:
    every device appended on); not callable during CUDA-graph capture."""
    if device is None:
        devices = sorted(_append_used)
    else:
        device = torch.device(device)
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    skipped, largest, capacity = 0, -1, 0
    for dev in devices:
        modules = list(_append_used.get(dev, {}).values())
        if not modules:
            continue
        with torch.cuda.device(dev):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("check_append_errors() synchronises: call it outside CUDA-graph capture")
            torch.cuda.synchronize()
            for module in modules:
                word = (ctypes.c_uint64 * 4)()
                rc = module.function("fi_append_errors", _ERRORS_ARGS)(word, 1)
                if rc:
                    module.check(rc, "fi_append_errors")
                if word[0]:
                    skipped += word[1]
                    largest = max(largest, word[2])
                    capacity = word[3]
    if skipped:
        raise RuntimeError(f"append_paged_kv_cache: {skipped} token(s) had a slot_mapping entry past the end of "
                           f"the KV cache (largest {largest}; the cache holds {capacity} slots = num_blocks * "
                           f"page_size); those tokens were not written")
