"""Prove that a change to csrc/ or the spec code leaves the default attention kernels' machine code as it was.

    python3 .ci/sass_compare.py dump DIR [--jobs N] [--only _fa3]   # build the modules below for sm_90a, write DIR/<name>.sass
    python3 .ci/sass_compare.py compare OLD NEW        # exit 1 unless every module's SASS is identical

Run `dump` before the change (e.g. in a worktree of the old commit) and after it, each with its own
FI_BACKEND_CACHE_DIR (the module hash covers csrc/, so the builds never share a module). The modules are the
default shapes (no tuning) of decode and every prefill family member over the code paths that specs choose
between: head sizes 64/80/96/128/256, bf16/fp16/fp8 KV, GQA groups 1..8, the built-in variants. A module is
named by its spec's tag, which the default shapes keep across a refactor; SASS is compared after the function
names (mangled template arguments) and the source file name (it carries the module hash) are masked.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("FI_BACKEND_CUDA_ARCH_LIST", "90a")  # Hopper's family: the wgmma prefill paths
from fi_backend import kernels, variants as V  # noqa: E402
from fi_backend.shapes import PREFILL_FA3_TUNINGS  # noqa: E402
from fi_backend.wrappers import decode_spec, prefill_family_size, prefill_spec  # noqa: E402

_DECODE = [  # (variant, head_dim, q, kv, group)
    ("default", 64, "bf16", "bf16", 1), ("default", 128, "bf16", "bf16", 4), ("default", 128, "fp16", "fp16", 8),
    ("default", 256, "bf16", "bf16", 2), ("default", 80, "bf16", "bf16", 4), ("default", 96, "fp16", "fp16", 1),
    ("default", 128, "fp16", "fp8_e4m3", 4), ("default", 64, "bf16", "fp8_e5m2", 8),
    ("default", 256, "bf16", "fp8_e4m3", 4), ("rope", 128, "bf16", "bf16", 4), ("soft_cap", 128, "bf16", "bf16", 4),
    ("window", 128, "bf16", "bf16", 1), ("alibi", 128, "bf16", "bf16", 8), ("sigmoid", 128, "bf16", "bf16", 4),
]
_PREFILL = [
    ("default", 128, "bf16", "bf16", 1), ("default", 128, "bf16", "bf16", 4), ("default", 128, "fp16", "fp16", 8),
    ("default", 64, "bf16", "bf16", 1), ("default", 256, "bf16", "bf16", 4), ("default", 80, "bf16", "bf16", 4),
    ("default", 96, "fp16", "fp16", 8), ("default", 128, "bf16", "fp8_e4m3", 4),
    ("default", 64, "fp16", "fp8_e5m2", 2), ("soft_cap", 128, "bf16", "bf16", 4), ("window", 128, "bf16", "bf16", 4),
    ("window", 128, "bf16", "bf16", 1), ("alibi", 128, "bf16", "bf16", 4), ("alibi", 128, "bf16", "bf16", 1),
    ("sigmoid", 128, "bf16", "bf16", 4), ("custom_mask", 128, "bf16", "bf16", 4), ("rope", 128, "bf16", "bf16", 4),
    ("rope_interleave", 128, "fp16", "fp16", 4), ("soft_cap_window", 128, "bf16", "bf16", 4),
    ("rope_window", 128, "bf16", "bf16", 4), ("alibi_window", 128, "bf16", "bf16", 4),
    ("window", 128, "bf16", "fp8_e4m3", 4),
]


# The FA3-style member (no family picks it: by tuning), with and without ping-pong: (head_dim, q, group, fa3)
_FA3 = [(128, "bf16", 4, 2), (128, "fp16", 1, 1), (64, "bf16", 1, 2)]


def specs(only: str = ""):
    out = [decode_spec(V.BUILTIN_VARIANTS[v], d, q, kv, g) for v, d, q, kv, g in _DECODE]
    for v, d, q, kv, g in _PREFILL:
        out += [prefill_spec(V.BUILTIN_VARIANTS[v], d, q, kv, g, member=m) for m in range(prefill_family_size(d, kv))]
    out += [prefill_spec(V.DEFAULT, d, q, q, g, tuning={**PREFILL_FA3_TUNINGS[d], "fa3": f}) for d, q, g, f in _FA3]
    return [s for s in out if only in _name(s)]


def _name(spec) -> str:
    return f"{spec.family}_{spec.tag}"


_FUNCTION = re.compile(r"(Function : |\.text\.)\S+")
_IDENTIFIER = re.compile(r"identifier = \S+")  # the rendered source's file name, which carries the module hash


def _normalise(text: str) -> str:
    return _IDENTIFIER.sub("identifier = <src>", _FUNCTION.sub(r"\1<fn>", text))


def _cuobjdump() -> str:
    """cuobjdump on PATH, beside nvcc, or from the wheels (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm:
    it runs nvdisasm, which it looks for beside itself through NVDISASM_PATH)."""
    found = shutil.which("cuobjdump")
    nvcc = kernels.find_nvcc()
    beside = Path(nvcc).resolve().parent / "cuobjdump" if nvcc else None
    try:
        import nvidia.cu13
        wheel = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump"
    except ImportError:
        wheel = None
    for path in (found, beside, wheel):
        if path and Path(path).is_file():
            os.environ.setdefault("NVDISASM_PATH", str(Path(path).parent))
            return str(path)
    raise SystemExit("cuobjdump not found: put it on PATH or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def _sass(so: Path) -> str:
    text = subprocess.run([_cuobjdump(), "-sass", str(so)], check=True, capture_output=True, text=True).stdout
    return _normalise(text)


def dump(out_dir: Path, jobs: int, only: str = "") -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = specs(only)
    results = kernels.build_many(todo, archs="90a", jobs=jobs, quiet=True)
    failed = 0
    for spec, res in zip(todo, results):
        if isinstance(res, Exception):
            print(f"{_name(spec)}: build failed: {res}", file=sys.stderr)
            failed += 1
            continue
        (out_dir / f"{_name(spec)}.sass").write_text(_sass(Path(res.path)))
    print(f"{len(todo) - failed} of {len(todo)} modules dumped to {out_dir}")
    return 1 if failed else 0


def compare(old: Path, new: Path) -> int:
    names = sorted(p.name for p in old.glob("*.sass"))
    missing = [n for n in names if not (new / n).is_file()]
    differ = [n for n in names
              if n not in missing and _normalise((old / n).read_text()) != _normalise((new / n).read_text())]
    for n in missing:
        print(f"missing in {new}: {n}")
    for n in differ:
        print(f"SASS differs: {n}")
    same = len(names) - len(missing) - len(differ)
    print(f"{len(names)} modules compared, {same} identical, {len(differ)} differ, {len(missing)} missing")
    return 0 if names and same == len(names) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("dir", type=Path)
    d.add_argument("--jobs", type=int, default=2)
    d.add_argument("--only", default="", help="only the modules whose name contains this (e.g. _fa3)")
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    a = ap.parse_args()
    sys.exit(dump(a.dir, a.jobs, a.only) if a.cmd == "dump" else compare(a.old, a.new))
