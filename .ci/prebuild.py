"""Build, on a machine with nvcc and no GPU, the modules the GPU machine loads, into $FI_BACKEND_CACHE_DIR (then
pack it for the GPU machine: see .ci/gpu). The sets are the package's (fi_backend/module_sets.py; `fi-backend
build --list` shows them): by default tests, bench and zoo. Usage:
    FI_BACKEND_CACHE_DIR=$PWD/.fi_cache FI_BACKEND_CUDA_ARCH_LIST=90a python3 .ci/prebuild.py [--jobs N] [SET ...]
    python3 .ci/prebuild.py --list [SET ...] > /tmp/modules   # their directory names: pack only these (see .ci/gpu)
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("FI_BACKEND_CUDA_ARCH_LIST", "90a")  # the GPU machine's H100; names the modules for --list too
from fi_backend import cli, kernels  # noqa: E402
from fi_backend.kernels import builder  # noqa: E402

DEFAULT_SETS = ("tests", "bench", "zoo")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sets", nargs="*", metavar="SET", help=f"module sets (default: {' '.join(DEFAULT_SETS)})")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true",
                    help="print the modules' cache directory names (what to pack) instead of building")
    a = ap.parse_args()
    names = a.sets or list(DEFAULT_SETS)
    if not a.list:
        sys.exit(cli.main(["build", *names, "--arch", "90a", "--jobs", str(a.jobs)]))
    try:
        todo = kernels.specs_of(names)
    except KeyError as e:
        sys.exit(f"prebuild: {e.args[0]}")
    nvcc = builder.find_nvcc()
    version = builder.nvcc_version(nvcc) if nvcc else None
    for s in todo:
        print(builder.module_identity(s, builder.resolve_arch_list("90a"), version, csrc=builder.csrc_dir()).name)
