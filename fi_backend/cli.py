"""`fi-backend` command line: ahead-of-time kernel builds and cache information.

    fi-backend build [--arch 90a] [--jobs N] [--list] [NAMES...]   build module sets (default: all)
    fi-backend info                                                 toolchain, archs, cache contents

A cache built on a machine without a GPU ships to one that has it:
    FI_BACKEND_CACHE_DIR=/tmp/fi-cache fi-backend build --arch 90a      # here
    FI_BACKEND_CACHE_DIR=/path/to/copied/fi-cache python serve.py       # on the GPU machine
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import List, Optional

from . import __version__, env
from . import kernels


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _archs_or_error(arch: Optional[str]):
    try:
        return kernels.resolve_arch_list(arch), None
    except (RuntimeError, ValueError) as e:
        return None, str(e)


def cmd_info(args) -> int:
    print(f"fi-backend {__version__}")
    nvcc = None
    try:
        nvcc = kernels.find_nvcc()
    except kernels.BuildError as e:
        print(f"nvcc:       error: {e}")
    if nvcc:
        version = kernels.nvcc_version(nvcc)
        release = version.split("compilation tools, ")[-1] if "compilation tools, " in version else version
        print(f"nvcc:       {nvcc} ({release})")
    elif nvcc is None:
        print("nvcc:       not found (only prebuilt modules can be loaded)")
    print(f"ninja:      {kernels.find_ninja() or 'not found (nvcc runs directly)'}")
    print(f"jit:        {'on' if env.flag(env.JIT, True) else 'off (' + env.JIT + '=0)'}")
    print(f"csrc:       {kernels.csrc_dir()}")
    archs, error = _archs_or_error(args.arch)
    if archs is None:
        print(f"archs:      none: {error}")
        if not env.get(env.CACHE_DIR):
            print(f"cache dir:  depends on the archs; set {env.CUDA_ARCH_LIST} or {env.CACHE_DIR}")
            return 0
        root = kernels.cache_dir(())
    else:
        source = "--arch" if args.arch else (env.CUDA_ARCH_LIST if env.get(env.CUDA_ARCH_LIST) else "current device")
        print(f"archs:      {' '.join('sm_' + a for a in archs)} (from {source})")
        root = kernels.cache_dir(archs)
    origin = env.CACHE_DIR if env.get(env.CACHE_DIR) else "default"
    print(f"cache dir:  {root} ({origin})")
    cached = kernels.list_cached(root)
    total = sum(size for _, _, size in cached)
    print(f"modules:    {len(cached)} cached, {_size(total)}")
    for d, meta, size in cached:
        archs_of = " ".join("sm_" + a for a in (meta or {}).get("archs", []))
        print(f"  {d.name:<56} {_size(size):>10}  {archs_of}")
    return 0


def cmd_build(args) -> int:
    sets = kernels.module_sets()
    if args.list:
        archs, _ = _archs_or_error(args.arch)
        for name, s in sets.items():
            print(f"{name}: {s.description}")
            for spec in s.specs():
                print(f"  {spec.family} {spec.readable_tag()}  ({spec.template})")
        if archs:
            print(f"(archs sm_{' sm_'.join(archs)}, cache {kernels.cache_dir(archs)})")
        return 0
    names = args.names or list(sets)
    try:
        specs = kernels.specs_of(names)
        archs = kernels.resolve_arch_list(args.arch)
    except (KeyError, RuntimeError, ValueError) as e:
        print(f"fi-backend build: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    jobs = args.jobs or os.cpu_count() or 1
    root = kernels.cache_dir(archs)
    total = len(specs)
    print(f"fi-backend: {total} modules ({', '.join(names)}) for sm_{' sm_'.join(archs)}, "
          f"{jobs} jobs, cache {root}", file=sys.stderr, flush=True)
    lock = threading.Lock()
    done = [0]
    start = time.perf_counter()

    def on_done(spec, result):
        with lock:
            done[0] += 1
            width = len(str(total))
            if isinstance(result, Exception):
                status = "FAILED"
                name = f"{spec.family} {spec.readable_tag()}"
            else:
                status = f"built {result.seconds:5.1f} s" if result.built else "cached"
                name = result.name
            print(f"[{done[0]:>{width}}/{total}] {name:<56} {status}", file=sys.stderr, flush=True)

    results = kernels.build_many(specs, archs=archs, jobs=jobs, quiet=True, on_done=on_done)
    failed = [(s, r) for s, r in zip(specs, results) if isinstance(r, Exception)]
    built = sum(1 for r in results if not isinstance(r, Exception) and r.built)
    cached = total - built - len(failed)
    compile_s = sum(r.seconds for r in results if not isinstance(r, Exception))
    for spec, error in failed:
        print(f"\n--- {spec.family} {spec.readable_tag()} ---\n{error}", file=sys.stderr)
    print(f"fi-backend: {built} built, {cached} cached, {len(failed)} failed in "
          f"{time.perf_counter() - start:.1f} s (compile time {compile_s:.1f} s); cache {root}",
          file=sys.stderr, flush=True)
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fi-backend", description="fi-backend kernel builds and cache")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build module sets ahead of time (default: all sets)")
    b.add_argument("names", nargs="*", metavar="NAMES", help="module sets to build (see --list)")
    b.add_argument("--arch", help=f"architectures, e.g. 90a or '90a 100a' (default: ${env.CUDA_ARCH_LIST}, "
                                  "else the current GPU)")
    b.add_argument("--jobs", "-j", type=int, default=None, help="modules built at once (default: CPU count)")
    b.add_argument("--list", action="store_true", help="list the module sets and their modules")
    b.set_defaults(func=cmd_build)

    i = sub.add_parser("info", help="version, nvcc, architectures in effect, cache directory and contents")
    i.add_argument("--arch", help="show the cache for these architectures")
    i.set_defaults(func=cmd_info)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
