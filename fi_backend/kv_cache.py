"""The paged KV-cache layouts every kernel accepts, parsed once into pointers and strides (no copies).

    * one tensor with K and V packed in the last dim (vLLM): [num_blocks, page, heads, 2 D] ("NHD") or
      [num_blocks, heads, page, 2 D] ("HND"); K is [..., :D], V is [..., D:];
    * a (k, v) pair of 4-D [num_blocks, page, heads, D] ("NHD") / [num_blocks, heads, page, D] ("HND")
      tensors with equal shapes and strides (e.g. kv[:, 0], kv[:, 1] of FlashInfer's 5-D layout); with
      v_strides_free their strides may differ (a step's own key / value, views of different tensors);
    * a (k, v) pair of 3-D [num_slots, heads, D] tensors (SGLang's k_buffer / v_buffer): page size 1.

Token `o` of block `b`, head `h`, element `d` lives at k_ptr (or v_ptr) + (b * stride_block +
o * stride_token + h * stride_head + d) elements; the page size comes from the cache's shape (3-D
caches report stride_token 0).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional, Tuple

import torch

__all__ = ["PagedKV", "parse_paged_kv_cache", "parse_cached", "KV_LAYOUTS"]

KV_LAYOUTS = ("NHD", "HND")


class PagedKV(NamedTuple):
    """A parsed KV cache. Strides are in elements of `dtype`."""

    k_ptr: int
    v_ptr: int
    num_blocks: int
    page_size: int
    strides: Tuple[int, int, int]  # (stride_block, stride_token, stride_head)
    dtype: torch.dtype
    num_heads: int
    head_dim: int
    device: torch.device
    v_strides: Tuple[int, int, int]  # V's, equal to strides unless parsed with v_strides_free


def _paged_dims(t: torch.Tensor, kv_layout: str, page_size: Optional[int]):
    """(num_blocks, page, heads, last dim, strides) of a 4-D paged tensor in kv_layout."""
    st = t.stride()
    if kv_layout == "NHD":
        nb, P, H, last = t.shape
        strides = (st[0], st[1], st[2])
    else:
        nb, H, P, last = t.shape
        strides = (st[0], st[2], st[1])
    if page_size is not None and P != page_size:
        raise ValueError(f"the KV cache's page dimension is {P} but page_size is {page_size} "
                         f"(kv_layout {kv_layout})")
    return nb, P, H, last, strides


def parse_paged_kv_cache(kv_cache, kv_layout: str = "NHD", *, head_dim: Optional[int] = None,
                         page_size: Optional[int] = None, v_strides_free: bool = False) -> PagedKV:
    """Parse `kv_cache` (any layout of the module docstring) into a PagedKV.

    head_dim / page_size, when given, are the values the caller expects (errors name both); otherwise
    they come from the shape (a packed tensor's last dim must then be even). Checks what every kernel
    needs: K and V alike (dtype, device, shape, and strides unless v_strides_free), a contiguous head_dim,
    and 16-byte aligned pointers and strides. Dtype, device and head count are returned for the caller to
    check."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND' (got {kv_layout!r})")
    if isinstance(kv_cache, torch.Tensor):
        kv = k = v = kv_cache
        if kv.dim() != 4 or (kv.shape[-1] != 2 * head_dim if head_dim is not None else kv.shape[-1] % 2):
            want = "2*head_dim" if head_dim is None else f"2*head_dim = {2 * head_dim}"
            raise ValueError(f"a single KV cache tensor must be packed [num_blocks, page, heads, {want}] (NHD) "
                             f"or [num_blocks, heads, page, {want}] (HND) with K then V in the last dim "
                             f"(got shape {tuple(kv.shape)})")
        nb, P, H, last, strides = _paged_dims(kv, kv_layout, page_size)
        D = last // 2
        k_ptr = kv.data_ptr()
        v_ptr = k_ptr + D * kv.element_size()
        v_strides = strides
    elif isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache as a sequence must be a (k, v) pair (got {len(kv_cache)} tensors)")
        k, v = kv_cache
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError(f"kv_cache (k, v) must be torch.Tensors (got {type(k).__name__}, {type(v).__name__})")
        if k.shape != v.shape or (k.stride() != v.stride() and not v_strides_free):
            raise ValueError(f"k and v caches must have the same shape and strides (got {tuple(k.shape)} "
                             f"{k.stride()} and {tuple(v.shape)} {v.stride()})")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"k and v caches must have the same dtype and device (got {k.dtype} on {k.device} "
                             f"and {v.dtype} on {v.device})")
        if k.dim() == 3:
            if page_size is not None and page_size != 1:
                raise ValueError(f"3-D [slots, heads, D] caches need page_size 1 (got page_size {page_size})")
            nb, H, D = k.shape
            P = 1
            strides = (k.stride(0), 0, k.stride(1))
            v_strides = (v.stride(0), 0, v.stride(1))
        elif k.dim() == 4:
            nb, P, H, D, strides = _paged_dims(k, kv_layout, page_size)
            v_strides = _paged_dims(v, kv_layout, page_size)[4]
        else:
            raise ValueError(f"k/v caches must be 4-D ({kv_layout}) or 3-D [slots, heads, D] (got {k.dim()}-D)")
        if head_dim is not None and D != head_dim:
            raise ValueError(f"the KV cache's head_dim is {D}, expected {head_dim}")
        k_ptr, v_ptr = k.data_ptr(), v.data_ptr()
    else:
        raise TypeError(f"kv_cache must be a tensor or a (k, v) pair (got {type(kv_cache).__name__})")
    if k.stride(-1) != 1:
        raise ValueError(f"the KV cache's head_dim must be contiguous (stride 1; got strides {k.stride()})")
    if v.stride(-1) != 1:
        raise ValueError(f"v's head_dim must be contiguous (stride 1; got strides {v.stride()})")
    esz = k.element_size()
    if any((s * esz) % 16 for s in strides + v_strides) or (k_ptr | v_ptr) % 16 or (D * esz) % 16:
        shown = strides if v_strides == strides else f"{strides} (k) and {v_strides} (v)"
        raise ValueError(f"the KV cache's rows must be 16-byte aligned: head_dim, strides {shown} (elements "
                         f"of {esz} bytes) and pointers (k {k_ptr % 16}, v {v_ptr % 16} mod 16) multiples of "
                         f"16 bytes (head_dim {D})")
    return PagedKV(k_ptr, v_ptr, nb, P, strides, k.dtype, H, D, k.device, v_strides)


# Parsed caches by identity: an engine appends to and attends over the same few cache tensors (one per
# layer) every step, and a parse costs more than the launch. An entry is used only while its tensors
# are alive (weak references) and still have the pointer, shape and strides it was parsed with.
_parsed: dict = {}
_PARSED_MAX = 1024


def parse_cached(kv_cache, kv_layout: str = "NHD", *, head_dim: Optional[int] = None,
                 page_size: Optional[int] = None, v_strides_free: bool = False) -> PagedKV:
    """parse_paged_kv_cache, remembered per cache object (a (k, v) pair by its two tensors)."""
    expect = (kv_layout, head_dim, page_size, v_strides_free)
    if isinstance(kv_cache, torch.Tensor):
        memo_key, first, second = (id(kv_cache), expect), kv_cache, None
    elif isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        first, second = kv_cache
        memo_key = (id(first), id(second), expect)
    else:
        return parse_paged_kv_cache(kv_cache, kv_layout, head_dim=head_dim, page_size=page_size,
                                    v_strides_free=v_strides_free)
    entry = _parsed.get(memo_key)
    if entry is not None:
        ref0, ref1, meta, kv = entry
        if (ref0() is first and (ref1 is None or ref1() is second)
                and meta == (first.data_ptr(), first.shape, first.stride(),
                             None if second is None else (second.data_ptr(), second.shape, second.stride()))):
            return kv
    kv = parse_paged_kv_cache(kv_cache, kv_layout, head_dim=head_dim, page_size=page_size,
                              v_strides_free=v_strides_free)
    if len(_parsed) >= _PARSED_MAX:
        _parsed.clear()
    try:
        refs = (weakref.ref(first), None if second is None else weakref.ref(second))
    except TypeError:
        return kv
    meta = (first.data_ptr(), first.shape, first.stride(),
            None if second is None else (second.data_ptr(), second.shape, second.stride()))
    _parsed[memo_key] = (*refs, meta, kv)
    return kv
