"""Registers and spills of attention kernel shapes, without a GPU: builds each module with `-Xptxas -v`
into a scratch cache and reads ptxas's report. A shape that spills in its hot loop is slow; this is the
first check before spending GPU time on a shape (prefill.cuh's 2-fragment shapes were chosen this way).

    python -m perf.tools.ptxas --kernel prefill --tunings '[{}, {"warps": 8, "mfrags": 2, "tile": 64, "stages": 2}]'
    python -m perf.tools.ptxas --kernel prefill --variant alibi --kv-dtype fp8_e4m3 --head-dim 128 --group 4

Prints one line per shape: registers per thread, the spill stores / loads and stack frame ptxas reports (bytes), and
whether ptxas serialised the kernel's wgmmas (C7512, C7518, ...: every HGMMA waited for before the next
issues, the tensor cores' pipeline lost; it says why, e.g. "insufficient register resources").
The scratch cache (default: a temporary directory) keeps these builds apart from the real kernel cache:
the extra flag changes the modules' identity.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=("decode", "prefill"), default="prefill")
    ap.add_argument("--tunings", default="[{}]", help="JSON list of tuning dicts ({} or null: the default shape)")
    ap.add_argument("--member", type=int, default=0, help="prefill tile-family member (default 0, the largest)")
    ap.add_argument("--variant", default="default", help="a built-in variant name (fi_backend.variants)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--kv-dtype", default=None, help="bf16, fp16, fp8_e4m3 or fp8_e5m2 (default: the query's)")
    ap.add_argument("--group", type=int, default=1, help="GQA group (query heads per KV head)")
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--cache-dir", default=None, help="scratch kernel cache (default: a temporary directory)")
    a = ap.parse_args(argv)

    os.environ["FI_BACKEND_CUDA_ARCH_LIST"] = a.arch
    os.environ["FI_BACKEND_CACHE_DIR"] = a.cache_dir or tempfile.mkdtemp(prefix="fi_ptxas_")
    from fi_backend import kernels, variants, wrappers

    variant = variants.BUILTIN_VARIANTS[a.variant]
    kv = a.kv_dtype or a.q_dtype
    tunings = json.loads(a.tunings)
    for i, tuning in enumerate(tunings, 1):
        kw = {"member": a.member} if a.kernel == "prefill" and a.member else {}
        spec = wrappers._SPECS[a.kernel](variant, a.head_dim, a.q_dtype, kv, a.group, tuning=tuning or None, **kw)
        spec = dataclasses.replace(spec, nvcc_flags=tuple(spec.nvcc_flags) + ("-Xptxas=-v",))
        t0 = time.perf_counter()
        print(f"[{i}/{len(tunings)}] building {spec.readable_tag()} ...", file=sys.stderr, flush=True)
        built = kernels.builder.build(spec, quiet=True)
        log_path = built.path.parent / "build.log"
        log = log_path.read_text() if log_path.exists() else ""
        regs = re.findall(r"Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        # Stack frame beyond the spills: a local array (dynamically indexed, or a loop ptxas left rolled), as
        # row_max's tree at 128-token steps was (prefill.cuh): local-memory traffic the spill count misses.
        frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
        if not regs:
            print(f"{a.kernel} {json.dumps(tuning)}: no ptxas report (module was cached without -v?)", flush=True)
            continue
        st, ld = (max(int(s) for s, _ in spills), max(int(x) for _, x in spills)) if spills else (0, 0)
        serial = re.search(r"\((C75\d\d)\).*?wgmma.mma_async instructions are serialized due to ([^\n]*?) (?:for|in) the "
                           r"function", log)
        print(f"{a.kernel} {a.variant} {a.q_dtype}/{kv} d{a.head_dim} g{a.group} {json.dumps(tuning)}: "
              f"{max(int(r) for r in regs)} registers, spill stores {st} B, loads {ld} B, stack frame {max(frames, default=0)} B"
              + (f", WGMMA SERIALISED ({serial.group(1)}: {serial.group(2)})" if serial else "")
              + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
