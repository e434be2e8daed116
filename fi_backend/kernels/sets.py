"""Named sets of modules for ahead-of-time builds (`fi-backend build NAME...`), and the specs of the
kernels that live here. To add a set: define a function returning ModuleSpecs, decorate it with
@module_set("name", "what it holds"), and make sure this file imports the module that defines it
(add it to _PROVIDERS)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List

from .spec import ModuleSpec

# Storage dtypes by short name -> C type in csrc/.
DTYPE_C: Dict[str, str] = {
    "fp32": "float",
    "fp16": "__half",
    "bf16": "__nv_bfloat16",
    "fp8_e4m3": "__nv_fp8_e4m3",
    "fp8_e5m2": "__nv_fp8_e5m2",
}


@dataclass(frozen=True)
class ModuleSet:
    name: str
    description: str
    specs: Callable[[], List[ModuleSpec]]


MODULE_SETS: Dict[str, ModuleSet] = {}
# Modules (besides this one) that register sets; imported on first use of the registry.
_PROVIDERS: List[str] = ["fi_backend.module_sets"]  # modules that register sets on import
_providers_loaded = False


def module_set(name: str, description: str):
    """Decorator registering a function () -> [ModuleSpec] as the module set `name`."""
    def register(fn):
        if name in MODULE_SETS:
            raise ValueError(f"module set {name!r} is registered twice")
        MODULE_SETS[name] = ModuleSet(name, description, fn)
        return fn
    return register


def module_sets() -> Dict[str, ModuleSet]:
    global _providers_loaded
    if not _providers_loaded:
        for provider in _PROVIDERS:
            importlib.import_module(provider)
        _providers_loaded = True
    return MODULE_SETS


def specs_of(names: Iterable[str]) -> List[ModuleSpec]:
    """The specs of the named sets, in order, without duplicates."""
    sets = module_sets()
    specs, seen = [], set()
    for name in names:
        if name not in sets:
            raise KeyError(f"unknown module set {name!r}; known sets: {', '.join(sorted(sets))}")
        for spec in sets[name].specs():
            if spec.memo_key not in seen:
                seen.add(spec.memo_key)
                specs.append(spec)
    return specs


# ----------------------------------------------------------------------------- merge

MERGE_DTYPES = ("bf16", "fp16", "fp32")


def merge_spec(dtype: str) -> ModuleSpec:
    """The attention-state merge module (fi_merge_state, fi_merge_states) for O stored as `dtype`."""
    if dtype not in MERGE_DTYPES:
        raise ValueError(f"merge kernels support dtype {', '.join(MERGE_DTYPES)} (got {dtype!r})")
    return ModuleSpec(family="merge_state", template="state_merge.cu", params={"DTYPE": DTYPE_C[dtype]},
                      tag=dtype)


@module_set("merge", "attention-state merge (merge_state, merge_states) for bf16, fp16, fp32")
def _merge_set() -> List[ModuleSpec]:
    return [merge_spec(d) for d in MERGE_DTYPES]


# ----------------------------------------------------------------------------- append (KV write)

APPEND_KEY_DTYPES = ("bf16", "fp16")
APPEND_CACHE_DTYPES = ("same", "fp8_e4m3", "fp8_e5m2")


def append_spec(key_dtype: str, cache_dtype: str) -> ModuleSpec:
    """The paged KV-cache append module (fi_append_paged_kv_cache, fi_append_errors) for keys/values
    stored as `key_dtype` written into a cache of `cache_dtype` (== key_dtype, or an fp8 format)."""
    if key_dtype not in APPEND_KEY_DTYPES:
        raise ValueError(f"append kernels support key dtype {', '.join(APPEND_KEY_DTYPES)} (got {key_dtype!r})")
    if cache_dtype not in (key_dtype, "fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"append kernels write a {key_dtype} key into a cache of {key_dtype}, fp8_e4m3 or "
                         f"fp8_e5m2 (got {cache_dtype!r})")
    return ModuleSpec(family="append_kv", template="append_kv.cu",
                      params={"KEY_DTYPE": DTYPE_C[key_dtype], "CACHE_DTYPE": DTYPE_C[cache_dtype]},
                      tag=f"{key_dtype}_{cache_dtype}")


@module_set("append", "paged KV-cache append (KV write path): bf16/fp16 keys into same-dtype, fp8 e4m3 or "
                      "fp8 e5m2 caches")
def _append_set() -> List[ModuleSpec]:
    return [append_spec(k, k if c == "same" else c) for k in APPEND_KEY_DTYPES for c in APPEND_CACHE_DTYPES]
