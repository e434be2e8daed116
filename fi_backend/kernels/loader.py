"""Loading built modules with ctypes: one CDLL per module per process, cached function objects."""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

from .. import env
from .builder import ArchList, build, resolve_arch_list
from .spec import ModuleSpec


class KernelError(RuntimeError):
    """A launcher returned a nonzero cudaError_t."""


class Module:
    """A loaded JIT module (.so). Launchers are fetched once with function() and then called directly.

    The .so is never unloaded (ctypes keeps it for the process's life), so function objects stay valid.
    """

    def __init__(self, name: str, path: Path, spec: Optional[ModuleSpec] = None):
        self.name = name
        self.path = Path(path)
        self.spec = spec
        self._lib = ctypes.CDLL(str(self.path))
        self._functions: Dict[str, Tuple[tuple, object, ctypes._CFuncPtr]] = {}
        self._lock = threading.Lock()
        self._error_string = self._lib["fi_error_string"]
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p

    def function(self, name: str, argtypes: Sequence, restype=ctypes.c_int):
        """The exported C function `name` with argtypes/restype set, cached: call it with raw ints
        (tensor.data_ptr(), sizes, the stream handle). A second request for the same name must give
        the same signature."""
        signature = (tuple(argtypes), restype)
        with self._lock:
            cached = self._functions.get(name)
            if cached is not None:
                if cached[0] != signature:
                    raise ValueError(f"{self.name}: function {name} was already fetched with a different "
                                     f"signature {cached[0]}")
                return cached[1]
            try:
                fn = self._lib[name]
            except AttributeError:
                raise AttributeError(f"module {self.name} ({self.path}) exports no function {name!r}") from None
            fn.argtypes = list(argtypes)
            fn.restype = restype
            self._functions[name] = (signature, fn)
            return fn

    def error_string(self, code: int) -> str:
        """cudaGetErrorString of `code`, from the module's own runtime."""
        return self._error_string(int(code)).decode(errors="replace")

    def check(self, code: int, launcher: str) -> None:
        """Raise KernelError if a launcher's return code is nonzero (call only when `code` is truthy
        to keep the success path free of Python calls: `if rc: module.check(rc, "fi_x")`)."""
        if code:
            raise KernelError(f"{launcher} ({self.name}) failed: {self.error_string(code)} (cudaError {code})")

    def __repr__(self) -> str:
        return f"Module({self.name!r}, {str(self.path)!r})"


_modules: Dict[tuple, Module] = {}


def memo_key(spec: ModuleSpec) -> tuple:
    """A loaded module's key in a process: the spec and $FI_BACKEND_NVCC_FLAGS, which enter the module's identity
    (builder.module_flags), so an experiment can load the same spec built two ways side by side."""
    return spec.memo_key, env.get(env.NVCC_FLAGS) or ""
_modules_lock = threading.Lock()


def load(spec: ModuleSpec, *, archs: Union[None, str, Iterable[str]] = None,
         quiet: Optional[bool] = None) -> Module:
    """Build `spec` if needed (see build()) and load it; memoised per process."""
    resolved: ArchList = resolve_arch_list(archs)
    key = (memo_key(spec), resolved)
    module = _modules.get(key)
    if module is not None:
        return module
    with _modules_lock:  # one build + CDLL per module even when threads race
        module = _modules.get(key)
        if module is None:
            result = build(spec, archs=resolved, quiet=quiet)
            module = Module(result.name, result.path, spec)
            _modules[key] = module
        return module


def load_path(path: Union[str, Path]) -> Module:
    """Load a built .so directly (e.g. one copied out of a cache)."""
    path = Path(path)
    return Module(path.stem, path)
