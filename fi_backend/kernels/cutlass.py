"""The CUTLASS / CuTe headers the sm90 CuTe kernels build with (issue 30's design change, docs/prefill.md): those of
the nvidia-cutlass wheel (package `cutlass_library`), pinned to the version below, or a checkout named by
FI_BACKEND_CUTLASS_DIR (its include/ directory)."""
from __future__ import annotations

import os
from pathlib import Path

from .spec import ModuleSpec

VERSION = "4.2.0.0"
ENV = "FI_BACKEND_CUTLASS_DIR"


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


def qk_tile_spec(head_dim: int) -> ModuleSpec:
    """The CuTe probe: S = Q K^T of 64 x 128 tiles (csrc/attention/cute/qk_tile.cu), head size 64 or 128."""
    if head_dim not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 (got {head_dim})")
    return ModuleSpec(family="cute_qk_tile", template="attention/cute/qk_tile.cu", params={"HEAD_DIM": str(head_dim)},
                      include_dirs=(include_dir(),), key_extra=f"cutlass {version()}", tag=f"cute_qk_tile_d{head_dim}")
