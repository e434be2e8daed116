"""Pack vLLM's FlashAttention-3 binary alone for the GPU machine: the `vllm/vllm_flash_attn` package of the staged
vLLM wheel (its `_vllm_fa3_C` extension and `flash_attn_interface`, without the FA4 `cute/` sources) and a
`vllm.platforms` of a few lines that answers the interface's compute-capability questions from torch. About 11 MB
xz-compressed against four 46 MB staging jobs for the whole engine, so a kernel benchmark against vLLM's FA3 (`python
-m perf zoo --sections prefill`, perf.prefill.vllm_fa3) fits one call beside the working tree. Engine runs (`perf
e2e`, integration tests) still need the whole staged vLLM.

    python -m perf.tools.stage_vllm_fa3 .stage/vllm-1 .stage/vllm-2 ... -o .carry/vllm_fa3.tar.xz
    # on the GPU machine:
    mkdir -p /tmp/vllm-fa3 && tar -xJf .carry/vllm_fa3.tar.xz -C /tmp/vllm-fa3 && export PYTHONPATH=/tmp/vllm-fa3:$PYTHONPATH
"""
from __future__ import annotations

import argparse
import glob
import io
import os
import sys
import tarfile
import time
import zipfile

PLATFORMS = '''# Kernel benchmarks only (perf/tools/stage_vllm_fa3.py): vLLM's FA3 binary without the engine. The interface asks
# vllm.platforms for the device's compute capability; this answers from torch.
import torch


class _Cuda:
    def get_device_capability(self):
        return torch.cuda.get_device_capability()

    def has_device_capability(self, cap):
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= cap

    def is_device_capability_family(self, cap):
        return torch.cuda.get_device_capability()[0] == cap // 10


current_platform = _Cuda()
'''


def _wheel(sources):
    """The vLLM wheel's bytes: a .whl, or the .whl.partNNN pieces in the staging folders."""
    whls = [p for s in sources for p in glob.glob(os.path.join(s, "vllm-*.whl"))] + \
           [s for s in sources if s.endswith(".whl")]
    if whls:
        return open(whls[0], "rb").read()
    parts = sorted(p for s in sources for p in glob.glob(os.path.join(s, "vllm-*.whl.part*")))
    if not parts:
        sys.exit(f"stage_vllm_fa3: no vllm-*.whl or vllm-*.whl.partNNN under {sources}")
    return b"".join(open(p, "rb").read() for p in parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", help="staging folders holding the vLLM wheel or its parts, or the wheel")
    ap.add_argument("-o", "--out", default=".carry/vllm_fa3.tar.xz")
    a = ap.parse_args(argv)
    t0 = time.time()
    z = zipfile.ZipFile(io.BytesIO(_wheel(a.sources)))
    keep = [n for n in z.namelist() if n.startswith("vllm/vllm_flash_attn/") and not n.endswith("/")
            and "/cute/" not in n and "/layers/" not in n and "/ops/" not in n]
    if not any(n.endswith("_vllm_fa3_C.abi3.so") for n in keep):
        sys.exit("stage_vllm_fa3: the wheel has no vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with tarfile.open(a.out, "w:xz", preset=6) as tar:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(t0)
            tar.addfile(info, io.BytesIO(data))
        add("vllm/__init__.py", b"")
        add("vllm/platforms/__init__.py", PLATFORMS.encode())
        for n in keep:
            print(f"  {n} ({z.getinfo(n).file_size / 2**20:.1f} MiB)", flush=True)
            add(n, z.read(n))
    print(f"wrote {a.out}: {os.path.getsize(a.out) / 2**20:.1f} MiB in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
