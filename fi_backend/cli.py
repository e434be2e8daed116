"""`fi-backend` command line: ahead-of-time kernel builds and cache information.

    fi-backend build [--arch 90a] [--jobs N] [--list] [NAMES...]   build module sets (default: all)
    fi-backend build --model NAME|config.json [--kv-dtype bf16,fp8_e4m3] [--tp N] [--deterministic]
                                                                    build one model's (or one TP rank's) modules
    fi-backend models [--markdown] [--tp N]                         the model zoo and what fi-backend runs
                                                                    (--tp: what each of N ranks runs)
    fi-backend info                                                 toolchain, archs, cache contents

A cache built on a machine without a GPU ships to one that has it:
    FI_BACKEND_CACHE_DIR=/tmp/fi-cache fi-backend build --arch 90a      # here
    FI_BACKEND_CACHE_DIR=/path/to/copied/fi-cache python serve.py       # on the GPU machine
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from . import __version__, env
from . import kernels
from . import models


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


def _model_arg(text: str):
    """A zoo model by name or HF id, or a HF config.json (or a directory holding one); (model, None) or (None, error)."""
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
            return models.from_hf_config(config, name=config.get("_name_or_path") or path.parent.name), None
        except (OSError, ValueError, TypeError) as e:
            return None, f"{path}: not a usable HF config.json: {e}"
    try:
        return models.find(text), None
    except KeyError:
        return None, f"{text!r} is neither a config.json nor a zoo model (`fi-backend models` lists them)"


def cmd_build(args) -> int:
    if args.model is not None:
        return _build_model(args)
    if args.kv_dtype is not None or args.q_dtype is not None or args.tp != 1 or args.deterministic:
        print("fi-backend build: --kv-dtype, --q-dtype, --deterministic and --tp go with --model", file=sys.stderr)
        return 2
    sets = kernels.module_sets()
    if args.list:
        archs, _ = _archs_or_error(args.arch)
        with _arch_list(archs) if archs else contextlib.nullcontext():
            for name, s in sets.items():
                specs = s.specs()
                print(f"{name} ({len(specs)} modules): {s.description}")
                for spec in specs:
                    print(f"  {spec.family} {spec.readable_tag()}  ({spec.template})")
        if archs:
            print(f"(archs sm_{' sm_'.join(archs)}, cache {kernels.cache_dir(archs)})")
        return 0
    names = args.names or list(sets)
    try:
        archs = kernels.resolve_arch_list(args.arch)
        with _arch_list(archs):
            specs = kernels.specs_of(names)
    except (KeyError, RuntimeError, ValueError) as e:
        print(f"fi-backend build: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    return _build_specs(specs, archs, args.jobs, ", ".join(names))


def _arch_list(archs):
    """The build's architectures in effect while specs are named: the prefill tile family follows them."""
    return env.setting(env.CUDA_ARCH_LIST, " ".join(archs))


def _build_model(args) -> int:
    """`fi-backend build --model`: the check's refusal (exit 2), or every module models.modules_of names."""
    if args.names or args.list:
        print("fi-backend build: --model builds one model's modules; it takes no set names or --list", file=sys.stderr)
        return 2
    model, error = _model_arg(args.model)
    if model is None:
        print(f"fi-backend build: {error}", file=sys.stderr)
        return 2
    try:
        model = models.tp_slice(model, args.tp)
    except ValueError as e:
        print(f"fi-backend build: --tp {args.tp}: {e}", file=sys.stderr)
        return 2
    ok, reason = models.check(model)
    if not ok:
        print(f"fi-backend build: {model.name}: refused: {reason}", file=sys.stderr)
        return 2
    try:
        archs = kernels.resolve_arch_list(args.arch)
    except (RuntimeError, ValueError) as e:
        print(f"fi-backend build: {e}", file=sys.stderr)
        return 2
    kv_dtypes = tuple(t.strip() for t in (args.kv_dtype or "bf16,fp8_e4m3").split(",") if t.strip())
    try:
        page_sizes = tuple(int(t) for t in (args.page_size or "16").split(",") if t.strip())
    except ValueError:
        print(f"fi-backend build: --page-size must be integers, comma-separated (got {args.page_size!r})",
              file=sys.stderr)
        return 2
    deterministic = args.deterministic or env.batch_invariant()
    try:
        with _arch_list(archs):
            specs = models.modules_of(model, kv_dtypes=kv_dtypes, q_dtype=args.q_dtype or "bf16",
                                      deterministic=deterministic, page_sizes=page_sizes)
    except (KeyError, ValueError) as e:
        print(f"fi-backend build: {model.name}: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    label = f"{model.name}, KV {', '.join(kv_dtypes)}" + (", deterministic decode too" if deterministic else "")
    return _build_specs(specs, archs, args.jobs, label)


def _build_specs(specs, archs, jobs: Optional[int], label: str) -> int:
    """Build `specs` in parallel with a progress line per module; 1 if any failed."""
    jobs = jobs or os.cpu_count() or 1
    root = kernels.cache_dir(archs)
    total = len(specs)
    print(f"fi-backend: {total} modules ({label}) for sm_{' sm_'.join(archs)}, "
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


_MODEL_COLUMNS = ("model", "heads q/kv", "group", "head_dim", "window", "soft-cap", "rope", "kind", "fi-backend")


def _model_row(model, name: str, tp: int = 1) -> tuple:
    """The zoo table's row of `model`, or with tp > 1 of one of its ranks (refused where the heads do not split)."""
    try:
        model = models.tp_slice(model, tp)
    except ValueError as e:
        ok, reason = False, str(e).split(": ", 1)[1]   # without the model's name: the row names it
    else:
        ok, reason = models.check(model)
    layers = "all layers" if model.window_layers == "all" else model.window_layers
    window = "-" if model.sliding_window is None else f"{model.sliding_window}, {layers}"
    softcap = "-" if model.attn_logit_softcapping is None else str(model.attn_logit_softcapping)
    return (name, f"{model.num_qo_heads}/{model.num_kv_heads}", str(model.group), str(model.head_dim), window,
            softcap, model.rope_scaling or "-", model.kind, "runs" if ok else f"refused: {reason}")


def cmd_models(args) -> int:
    if args.tp < 1:
        print(f"fi-backend models: --tp must be a number of GPUs >= 1, got {args.tp}", file=sys.stderr)
        return 2
    suffix = f" TP{args.tp}" if args.tp > 1 else ""
    if args.markdown:
        rows = [_model_row(m, f"[{m.name}](https://huggingface.co/{m.hf_id}){suffix}", args.tp) for m in models.ZOO]
        print("| " + " | ".join(_MODEL_COLUMNS) + " |")
        print("|" + "|".join("---" for _ in _MODEL_COLUMNS) + "|")
        for row in rows:
            print("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        return 0
    rows = [_model_row(m, m.name + suffix, args.tp) for m in models.ZOO]
    widths = [max(len(r[i]) for r in rows + [_MODEL_COLUMNS]) for i in range(len(_MODEL_COLUMNS) - 1)]
    for row in [_MODEL_COLUMNS] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    runs = sum(1 for r in rows if r[-1] == "runs")
    per_rank = f" (heads per rank at tensor parallelism {args.tp})" if args.tp > 1 else ""
    print(f"{len(rows)} models{per_rank}, {runs} run, {len(rows) - runs} refused "
          f"(`fi-backend build --model NAME{' --tp ' + str(args.tp) if args.tp > 1 else ''}` builds "
          f"{'a rank' if args.tp > 1 else 'a model'}'s kernel modules)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fi-backend", description="fi-backend kernel builds and cache")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build module sets ahead of time (default: all sets)")
    b.add_argument("names", nargs="*", metavar="NAMES", help="module sets to build (see --list)")
    b.add_argument("--arch", help=f"architectures, e.g. 90a or '90a 100a' (default: ${env.CUDA_ARCH_LIST}, "
                                  "else the current GPU)")
    b.add_argument("--jobs", "-j", type=int, default=None, help="modules built at once (default: CPU count)")
    b.add_argument("--list", action="store_true", help="list the module sets and their modules")
    b.add_argument("--model", help="build the modules of one model instead: a zoo name (see `fi-backend models`, "
                                   "case-insensitive) or a HF config.json (or its directory)")
    b.add_argument("--kv-dtype", help="with --model: KV-cache dtypes, comma-separated (default: bf16,fp8_e4m3)")
    b.add_argument("--q-dtype", choices=("bf16", "fp16"), help="with --model: the model's dtype (default: bf16)")
    b.add_argument("--page-size", help="with --model: the engine's KV block sizes, comma-separated, for the CuTe "
                                       "prefill member's modules (Hopper, CUTLASS headers installed; default 16, "
                                       "vLLM's default; SGLang's default 1 needs none)")
    b.add_argument("--tp", type=int, default=1, help="with --model: one rank's modules under tensor parallelism "
                                                     "over N GPUs (its heads split as vLLM and SGLang split them)")
    b.add_argument("--deterministic", action="store_true",
                   help="with --model: also the decode modules of deterministic mode (SGLang's "
                        f"--enable-deterministic-inference; on by default where {env.DETERMINISTIC} or "
                        f"{env.VLLM_BATCH_INVARIANT} is set)")
    b.set_defaults(func=cmd_build)

    m = sub.add_parser("models", help="the model zoo: attention configuration and whether fi-backend runs it")
    m.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    m.add_argument("--tp", type=int, default=1, help="what each rank runs under tensor parallelism over N GPUs "
                                                     "(heads per rank; refused where they do not split)")
    m.set_defaults(func=cmd_models)

    i = sub.add_parser("info", help="version, nvcc, architectures in effect, cache directory and contents")
    i.add_argument("--arch", help="show the cache for these architectures")
    i.set_defaults(func=cmd_info)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
