"""The CUTLASS / CuTe headers the sm90 CuTe kernels build with (issue 30's design change, docs/prefill.md): those of
the nvidia-cutlass wheel (package `cutlass_library`), pinned to the version below, or a checkout named by
FI_BACKEND_CUTLASS_DIR (its include/ directory)."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .spec import ModuleSpec

VERSION = "4.2.0.0"
ENV = "FI_BACKEND_CUTLASS_DIR"


# The CTA's entries' ctypes arguments (csrc/attention/cute/attn_ws.cu; tests/test_entry_signatures.py checks them
# against the C declarations): fi_cute_attn_ws, ragged K / V by indptr ...
ATTN_WS_ARGS = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_void_p]
# ... and fi_cute_attn_bsr, K / V through a BSR (pages or ragged rows), V by its own strides
ATTN_BSR_ARGS = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 22 + [ctypes.c_float] * 2 + [ctypes.c_void_p]
# ... and fi_cute_attn_bsr's ragged modules' fi_cute_stage_pages, a paged step's KV copied into rows
STAGE_PAGES_ARGS = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 13 + [ctypes.c_void_p]


class CutlassNotFound(RuntimeError):
    pass


def include_dir() -> str:
    """The directory holding cute/ and cutlass/; a clear error naming what to install when there is none."""
    root = os.environ.get(ENV)
    if root:
        d = Path(root) / "include"
        if not (d / "cute" / "tensor.hpp").is_file():
            raise CutlassNotFound(f"{ENV}={root!r} has no include/cute/tensor.hpp (a CUTLASS checkout's root)")
        return str(d)
    try:
        import cutlass_library
    except ImportError:
        raise CutlassNotFound(f"the CuTe kernels need CUTLASS's headers: pip install nvidia-cutlass=={VERSION} "
                              f"(or set {ENV} to a CUTLASS checkout)") from None
    d = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (d / "cute" / "tensor.hpp").is_file():
        raise CutlassNotFound(f"nvidia-cutlass is installed but {d} has no cute/tensor.hpp: pip install "
                              f"--force-reinstall nvidia-cutlass=={VERSION}")
    return str(d)


def version() -> str:
    """CUTLASS's version as its headers state it (part of a CuTe module's identity: the path is not)."""
    text = (Path(include_dir()) / "cutlass" / "version.h").read_text()
    parts = []
    for name in ("CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"):
        for line in text.splitlines():
            if line.startswith(f"#define {name} "):
                parts.append(line.split()[2])
                break
    return ".".join(parts) or "unknown"


def _probe_spec(name: str, head_dim: int, **params: int) -> ModuleSpec:
    if head_dim not in (64, 96, 128, 256):
        raise ValueError(f"head_dim must be 64, 96, 128 or 256 (got {head_dim})")
    tag = f"d{head_dim}" + "".join(f"_{k[:2]}{v}" for k, v in sorted(params.items()))
    return ModuleSpec(family=f"cute_{name}", template=f"attention/cute/{name}.cu",
                      params={"HEAD_DIM": str(head_dim), **{k.upper(): str(v) for k, v in params.items()}},
                      include_dirs=(include_dir(),), key_extra=f"cutlass {version()}", tag=tag)


def attn_ws_spec(head_dim: int, causal: bool, stages: int = 2, overlap: bool = True, pingpong: bool = True,
                 page_size: int = 0, dtype: str = "bf16", softcap: bool = False, warpgroups: int = 2,
                 gather: bool = False, vbox: bool = True, split: bool = True, lazy: bool = False) -> ModuleSpec:
    """The CuTe probe: FlashAttention-3's CTA (a TMA producer warp, K and V pipelines, two consumer warpgroups of a
    128-token tile of one query head; csrc/attention/cute/attn_ws.cu), head size 64, 96, 128 or 256, causal or not; its
    intra-warpgroup overlap and its ping-pong each on or off (ping-pong needs the overlap); K / V ragged
    (page_size 0: entry fi_cute_attn_ws) or a BSR over pages of page_size tokens (a power of two, 16 or more: entry
    fi_cute_attn_bsr, with a sliding window); Q, K, V and O of dtype "bf16" or "fp16"; softcap: logits soft-capped
    (Gemma-2's); warpgroups: consumer warpgroups of 64 query rows, 2 (128-row tiles) or 3 (192 rows: head size 64,
    where S, P and O fit the 160 registers a consumer thread then gets; or 96, with 96-token KV tiles); gather (paged):
    K / V rows copied by the producer warpgroup's threads (cp.async), not TMA boxes, pages of any power of two (1
    included); vbox (pages below a KV tile, TMA): V in one box a page (False: a box a page and dim block, as K);
    split (the same pages): the producer's four warps issue a tile's boxes, every fourth page each (False: one thread);
    lazy: a row keeps its softmax maximum until a tile's exceeds it by more than 2^8, and a warp skips O's rescale
    where none of its rows moved (False: rescaled every KV tile)."""
    if stages not in (2, 3):
        raise ValueError(f"stages must be 2 or 3 (got {stages})")
    if pingpong and not overlap:
        raise ValueError("pingpong needs overlap (the overlapped loop's two warpgroups take turns)")
    if gather and not page_size:
        raise ValueError("gather needs pages (page_size > 0): ragged K / V load by TMA")
    if page_size and (page_size & (page_size - 1) or (page_size < 16 and not gather)):
        raise ValueError(f"page_size must be 0 (ragged) or a power of two, 16 or more (any with gather; got "
                         f"{page_size})")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype must be 'bf16' or 'fp16' (got {dtype!r})")
    if warpgroups not in (2, 3) or (warpgroups == 3 and head_dim not in (64, 96)):
        raise ValueError(f"warpgroups must be 2, or 3 at head sizes 64 and 96 (got {warpgroups} at head size "
                         f"{head_dim})")
    if warpgroups == 3 and head_dim == 96 and page_size not in (0, 16, 32) and not gather:
        raise ValueError(f"three warpgroups at head size 96 take 96-token KV tiles: TMA pages of 16 or 32 tokens "
                         f"(got {page_size}; gather=True takes any)")
    return _probe_spec("attn_ws", head_dim, stages=stages, causal=int(bool(causal)), overlap=int(bool(overlap)),
                       pingpong=int(bool(pingpong)), page=int(page_size), bf16=int(dtype == "bf16"),
                       softcap=int(bool(softcap)), warpgroups=int(warpgroups), gather=int(bool(gather)),
                       vbox=int(bool(vbox)), split=int(bool(split)), lazy=int(bool(lazy)))


PAGED_PROBE_PAGES = (16, 64, 256)  # below, in and above a 128-token KV tile
GATHER_PROBE_PAGES = (1, 16, 64)   # gathered: SGLang's pages of one token, and pages below a KV tile


def probe_specs() -> list:
    """Every CuTe probe module tests/test_cute_gpu.py loads (built in parallel before its first test)."""
    return [attn_ws_spec(d, causal, overlap=overlap, pingpong=pingpong) for d in (64, 128) for causal in (False, True)
            for overlap, pingpong in ((False, False), (True, False), (True, True))] + \
        [attn_ws_spec(d, causal, overlap=True, pingpong=False) for d in (96, 256) for causal in (False, True)] + \
        [attn_ws_spec(d, causal, overlap=True, pingpong=pingpong, warpgroups=3) for d in (64, 96)
         for causal in (False, True) for pingpong in (False, True)] + \
        [attn_ws_spec(96, causal, overlap=True, pingpong=False, page_size=16, warpgroups=3)
         for causal in (False, True)] + \
        [attn_ws_spec(d, causal, overlap=True, pingpong=False, page_size=page, warpgroups=wgs)
         for d, wgs in ((64, 2), (64, 3), (96, 2), (128, 2), (256, 2))
         for causal in (False, True) for page in PAGED_PROBE_PAGES if d != 256 or page != 64] + \
        [attn_ws_spec(d, causal, overlap=True, pingpong=False, page_size=page, warpgroups=wgs, gather=True)
         for d, wgs in ((64, 2), (64, 3), (96, 2), (96, 3), (128, 2), (256, 2))
         for causal in (False, True) for page in GATHER_PROBE_PAGES] + \
        [attn_ws_spec(d, causal, overlap=True, pingpong=pingpong, warpgroups=wgs, lazy=True)
         for d, wgs, pingpong in ((64, 2, False), (64, 2, True), (64, 3, False), (96, 2, False), (96, 3, False),
                                  (128, 2, False), (128, 2, True), (256, 2, False))
         for causal in (False, True)]
