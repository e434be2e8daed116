"""Standalone GPU operations on attention states (O, LSE), LSE in natural log.

merge_state(v_a, s_a, v_b, s_b)   two states -> one:   v_* [seq, heads, D], s_* [seq, heads] float32
merge_states(v, s)                 S states -> one:     v [seq, S, heads, D], s [seq, S, heads] float32

O = sum_i e^{s_i - LSE} O_i, LSE = log sum_i e^{s_i} (FlashInfer paper, section 2.2). A state with
LSE = -inf is empty: it contributes nothing and its O is not read; all empty -> O = 0, LSE = -inf.
O may be bf16, fp16 or fp32 (math in fp32), head_dim a multiple of 8 up to 512. Rows (dim 0) may be
strided views; each row must be contiguous and O 16-byte aligned. Outputs must not overlap inputs.
Kernels run on the current CUDA stream (CUDA-graph capturable) and are built on first use per dtype.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch

from . import kernels

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
