"""Where ptxas put the CuTe CTA's warpgroup waits, without a GPU: builds csrc/attention/cute/attn_ws.cu for sm_90a
(or reads a given .so), disassembles it (cuobjdump: $CUOBJDUMP, PATH, or pip's nvidia-cuda-cuobjdump wheel) and, for
each wait on S (WARPGROUP.DEPBAR.LE gsb0, 0x1), counts the softmax's instructions before the wait on the P.V
(DEPBAR.LE gsb0, 0x0) and after it. FlashAttention-3's overlap needs the exponentials (MUFU) before the P.V's wait;
ncu on the H200 found ours waiting 20% of its samples on these two waits, vLLM's FA3 2.5% (docs/prefill.md).

    python -m perf.tools.wgmma_waits [--causal] [--pingpong] [--head-dim 128] [--page-size P] [--warpgroups 3]
        [--softcap] [--lazy] [--so PATH]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

SHOWN = ("FMNMX", "MUFU", "FFMA", "FMUL", "FADD", "F2FP", "BRA", "SYNCS")


def cuobjdump() -> str:
    for path in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")):
        if path:
            return path
    try:
        import nvidia.cu13
        path = os.path.join(list(nvidia.cu13.__path__)[0], "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    raise SystemExit("no cuobjdump: set $CUOBJDUMP, or pip install nvidia-cuda-cuobjdump")


def instructions(sass: str) -> list:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text: str) -> str:
    t = text.split()
    return (t[1] if t[0].startswith("@") else t[0]).split(".")[0]


def waits(ins: list) -> list:
    """(address of the S wait, address of the P.V wait, opcodes between, opcodes after until the next MMA)."""
    rows, i = [], 0
    while i < len(ins):
        if "DEPBAR.LE gsb0, 0x1" in ins[i][1]:
            before, j = Counter(), i + 1
            while j < len(ins) and "DEPBAR.LE gsb0, 0x0" not in ins[j][1] and opcode(ins[j][1]) != "HGMMA":
                before[opcode(ins[j][1])] += 1
                j += 1
            after, k = Counter(), j + 1
            while k < len(ins) and opcode(ins[k][1]) not in ("HGMMA", "EXIT") and "DEPBAR" not in ins[k][1]:
                after[opcode(ins[k][1])] += 1
                k += 1
            rows.append((ins[i][0], ins[j][0] if j < len(ins) else -1, before, after))
            i = j
        i += 1
    return rows


def build(head_dim=128, causal=False, pingpong=False, page_size=0, warpgroups=2, softcap=False, lazy=False) -> str:
    """Builds the CuTe CTA's member for sm_90a (no GPU needed) and returns its .so's path."""
    os.environ.setdefault("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    from fi_backend.kernels import builder, cutlass
    spec = cutlass.attn_ws_spec(head_dim, causal, overlap=True, pingpong=pingpong, page_size=page_size,
                                warpgroups=warpgroups, softcap=softcap, lazy=lazy)
    print(f"building {spec.family} (minutes on two cores) ...", flush=True)
    return str(builder.build(spec).path)


def report(so: str) -> dict:
    """The module's SASS read: instruction, HGMMA, warpgroup-wait and local load / store counts, and waits()."""
    sass = subprocess.run([cuobjdump(), "-sass", so], capture_output=True, text=True, check=True).stdout
    ins = instructions(sass)
    return dict(instructions=len(ins),
                mmas=sum(1 for _, t in ins if opcode(t) == "HGMMA"),
                deps=sum(1 for _, t in ins if "WARPGROUP.DEPBAR" in t),
                spills=sum(1 for _, t in ins if opcode(t) in ("STL", "LDL")),
                waits=waits(ins))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.wgmma_waits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pingpong", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=0)
    ap.add_argument("--warpgroups", type=int, default=2, help="consumer warpgroups (3: head sizes 64 and 96)")
    ap.add_argument("--softcap", action="store_true")
    ap.add_argument("--lazy", action="store_true", help="the lazy O rescale (attn_ws.cu LAZY)")
    ap.add_argument("--so", help="a built module's .so instead of building one")
    a = ap.parse_args(argv)
    so = a.so or build(a.head_dim, a.causal, a.pingpong, a.page_size, a.warpgroups, a.softcap, a.lazy)
    r = report(so)
    print(f"{so}\n{r['instructions']} instructions, {r['mmas']} HGMMA, {r['deps']} warpgroup waits, "
          f"{r['spills']} local loads / stores")
    for s_wait, pv_wait, before, after in r["waits"]:
        show = lambda c: " ".join(f"{o} {c[o]}" for o in SHOWN if c[o])  # noqa: E731
        print(f"  S wait {s_wait:05x} -> P.V wait {pv_wait:05x}: before it [{show(before)}], after [{show(after)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
