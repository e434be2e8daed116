"""JIT/AOT kernel modules: render a template under csrc/, build it with nvcc + ninja, cache, load.

This package is the only Python code that knows nvcc. A kernel author needs four things:

1. A template under csrc/ (framework-free CUDA C++) with `{{NAME}}` placeholders, including
   "common.h" and exporting launchers in the C ABI:

       #include "common.h"
       using DType = {{DTYPE}};
       __global__ void my_kernel(const DType* x, DType* y, int64_t n) { ... }
       FI_EXPORT int fi_my_op(const void* x, void* y, int64_t n, void* stream) {
         FI_REQUIRE(n >= 0);                                   // bad argument -> cudaErrorInvalidValue
         FI_LAUNCH(my_kernel, grid, block, 0, stream, (const DType*)x, (DType*)y, n);  // returns the code
       }

   Launchers return a cudaError_t value (0 = success) and take the stream last as `void*`. common.h
   also gives every module `const char* fi_error_string(int)`. One template renders to one
   translation unit and one .so; only FI_EXPORT symbols are visible outside it.

2. A ModuleSpec naming the template and its parameters (every placeholder needs a value, every
   value a placeholder, else RenderError):

       spec = ModuleSpec(family="my_op", template="my_op.cu", params={"DTYPE": DTYPE_C["bf16"]}, tag="bf16")

3. load(spec) -> Module (builds on first use, then cached on disk and memoised in the process), and
   the launcher fetched ONCE with its ctypes signature; per call pass raw ints only:

       mod = load(spec)
       fn = mod.function("fi_my_op", [c_void_p, c_void_p, c_int64, c_void_p])   # restype c_int
       rc = fn(x.data_ptr(), y.data_ptr(), n, torch.cuda.current_stream().cuda_stream)
       if rc: mod.check(rc, "fi_my_op")        # raises KernelError (a RuntimeError) with the CUDA string

   Keep the Module/function objects in a module-level dict keyed by what selects the spec (dtype,
   head_dim, variant): a launch is then one ctypes call (see fi_backend/ops.py for the pattern).

4. For ahead-of-time builds, a named set in sets.py (@module_set("name", "description")), so that
   `fi-backend build name` compiles it.

Identity and cache. A module's key hashes the rendered source, every header under csrc/, the nvcc
flags, the architectures, the nvcc version and the fi_backend version (and spec.key_extra); its
directory is <family>_<tag>_<hash16> under the cache root ($FI_BACKEND_CACHE_DIR, else
~/.cache/fi_backend/<version>/<archs>, e.g. ~/.cache/fi_backend/0.1.0/90a); builder.py's docstring has
the layout. Builds are safe across processes: an flock per module, a temporary directory published by
atomic rename, a re-check after taking the lock; a killed builder leaves no lock behind.

Architectures: $FI_BACKEND_CUDA_ARCH_LIST ("90a", "9.0a", "sm_90a"; separated by spaces, ';' or ','),
else the current GPU (9.0 -> 90a, 10.0 -> 100a, others plain, e.g. 8.0 -> 80).

Shipping a cache to a machine without nvcc (or with another nvcc):

    here:   FI_BACKEND_CUDA_ARCH_LIST=90a FI_BACKEND_CACHE_DIR=/tmp/fi-cache fi-backend build
    there:  copy /tmp/fi-cache, then FI_BACKEND_CACHE_DIR=<copy> (and FI_BACKEND_JIT=0 if it has an
            nvcc of another version that should not rebuild). Without nvcc, or with FI_BACKEND_JIT=0,
            a module is found by everything in its key except the nvcc version.

Environment variables: fi_backend/env.py.
"""
from .builder import (BuildError, BuildResult, build, build_many, prepare, cache_dir, find_nvcc, find_ninja,
                      list_cached,
                    module_identity, nvcc_version, parse_arch_list, resolve_arch_list)
from .loader import KernelError, Module, load, load_path
from .sets import DTYPE_C, MODULE_SETS, merge_spec, module_set, module_sets, specs_of
from .spec import ModuleSpec, RenderError, csrc_dir, render, render_text

__all__ = [
    "ModuleSpec", "RenderError", "render", "render_text", "csrc_dir",
    "build", "build_many", "prepare", "BuildResult", "BuildError", "cache_dir", "list_cached", "module_identity",
    "find_nvcc", "find_ninja", "nvcc_version", "parse_arch_list", "resolve_arch_list",
    "load", "load_path", "Module", "KernelError",
    "DTYPE_C", "MODULE_SETS", "module_set", "module_sets", "specs_of", "merge_spec",
]
