"""The CuTe probe's warp-specialised CTA (csrc/attention/cute/attn_ws.cu: FlashAttention-3's CTA) without its
overlap, with the intra-warpgroup overlap, with the ping-pong too, with the overlap in L2 sections of one KV head, and
with three consumer warpgroups (the _wg3 modes, head size 64), against FlashInfer's FA3 template and our prefill
(member 0 and the FA3 member), causal (--full: no mask) bf16, head size 128 or --head-dim, the same ragged inputs in
the same process, alternating rounds (issue 30's design change, docs/prefill.md); and the CTA in --paged-modes on the
same K / V copied into pages in random order (--paged, page sizes).

    python -m perf.tools.cute_probe [--shapes 16x1024,4x4096,1x16384] [--heads 32/8,32/32] [--head-dim 128]

Needs FlashInfer staged (unless --no-flashinfer) and the nvidia-cutlass headers (fi_backend.kernels.cutlass). Writes
perf/results/<name>.json (default cute_probe)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from perf import prefill as P
from perf.common import diff_stats, log, stamp, time_rounds, write_result


L2_SECTION = 32 << 20  # KV bytes a section of work tiles spans (the better in 5 of 6 cells, docs/prefill.md)
# (overlap, ping-pong, L2 section bytes: 0 one KV head's KV, consumer warpgroups: 3 at head size 64 only, the lazy
# O rescale)
MODES = {"cute_plain": (False, False, L2_SECTION, 2, False), "cute_overlap": (True, False, L2_SECTION, 2, False),
         "cute_pingpong": (True, True, L2_SECTION, 2, False), "cute_overlap_kv1": (True, False, 0, 2, False),
         "cute_overlap_wg3": (True, False, L2_SECTION, 3, False),
         "cute_pingpong_wg3": (True, True, L2_SECTION, 3, False),
         "cute_overlap_lazy": (True, False, L2_SECTION, 2, True),
         "cute_pingpong_lazy": (True, True, L2_SECTION, 2, True),
         "cute_overlap_wg3_lazy": (True, False, L2_SECTION, 3, True),
         "cute_pingpong_wg3_lazy": (True, True, L2_SECTION, 3, True)}


def probe_spec(head_dim: int, mode: str, causal: bool):
    from fi_backend.kernels import cutlass
    overlap, pingpong, _, warpgroups, lazy = MODES[mode]
    return cutlass.attn_ws_spec(head_dim, causal, overlap=overlap, pingpong=pingpong, warpgroups=warpgroups, lazy=lazy)


def paged_spec(head_dim: int, page_size: int, causal: bool, mode: str = "cute_overlap", gather: bool = False,
               vbox: bool = True, split: bool = True):
    from fi_backend.kernels import cutlass
    overlap, pingpong, _, warpgroups, lazy = MODES[mode]
    return cutlass.attn_ws_spec(head_dim, causal, overlap=overlap, pingpong=pingpong, page_size=page_size,
                                warpgroups=warpgroups, gather=gather, vbox=vbox, split=split, lazy=lazy)


def probe_fn(case: P.Case, mode: str, causal: bool = True):
    from fi_backend import kernels
    from fi_backend.kernels import cutlass
    l2_section_bytes = MODES[mode][2]
    module = kernels.load(probe_spec(case.d, mode, causal))
    run = module.function("fi_cute_attn_ws", cutlass.ATTN_WS_ARGS)
    out = torch.empty_like(case.q)
    lse = torch.empty(case.rows, case.hq, device=case.q.device, dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    indptr = case.indptr_dev
    counter = torch.zeros(1, device=case.q.device, dtype=torch.int32)

    def fn():
        rc = run(case.q.data_ptr(), case.k.data_ptr(), case.v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                 indptr.data_ptr(), indptr.data_ptr(), counter.data_ptr(), case.batch, case.seq_len, case.hq,
                 case.hkv, case.rows, case.rows, l2_section_bytes, case.d ** -0.5, stream)
        if rc:
            raise RuntimeError(f"fi_cute_attn_ws failed: {rc}")
    return fn, out


def paged_fn(case: P.Case, page_size: int, mode: str = "cute_overlap", gather: bool = False, vbox: bool = True,
             split: bool = True, causal: bool = True):
    """The CTA in a mode (MODES) reading K / V from a pool of page_size pages in random order (perf.prefill.Paged), as
    TMA boxes or (gather) rows copied by the producer's threads."""
    from fi_backend import kernels
    from fi_backend.kernels import cutlass
    paged = P.Paged(case, page_size)
    l2_section_bytes = MODES[mode][2]
    module = kernels.load(paged_spec(case.d, page_size, causal, mode, gather, vbox, split))
    run = module.function("fi_cute_attn_bsr", cutlass.ATTN_BSR_ARGS)
    out = torch.empty_like(case.q)
    lse = torch.empty(case.rows, case.hq, device=case.q.device, dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    bsr = paged.bsr
    counter = torch.zeros(1, device=case.q.device, dtype=torch.int32)

    def fn():
        rc = run(case.q.data_ptr(), out.data_ptr(), lse.data_ptr(), paged.k.data_ptr(), paged.v.data_ptr(),
                 bsr.qo_indptr.data_ptr(), bsr.kv_lens.data_ptr(), bsr.kv_indices.data_ptr(),
                 bsr.kv_block_start.data_ptr(), counter.data_ptr(), None, bsr.kv_indices.numel(), case.q.stride(0),
                 case.q.stride(1), out.stride(0), out.stride(1), lse.stride(0), *paged.k.stride()[:3],
                 *paged.v.stride()[:3], paged.num_pages,
                 int(bsr.kv_block_start.dtype == torch.int64), case.batch, case.seq_len, case.hq, case.hkv, case.rows,
                 case.rows, l2_section_bytes, -1, case.d ** -0.5, 0.0, stream)
        if rc:
            raise RuntimeError(f"fi_cute_attn_bsr failed: {rc}")
    return fn, out


def member_fn(case: P.Case, pool: P.Paged, causal: bool, staged: bool):
    """The member on the pool's pages through BatchAttention: reading them (staged False: FI_BACKEND_PREFILL_STAGE=0
    for the wrapper) or staging every step into rows for its ragged CTA (STAGE_MIN_REUSE 0 for the plan)."""
    from fi_backend import cute_member, env
    saved_reuse, cute_member.STAGE_MIN_REUSE = cute_member.STAGE_MIN_REUSE, 0
    try:
        with env.setting(env.PREFILL_STAGE, "1" if staged else "0"):
            fn, out, info = P.ours_fn(case, paged=pool, causal=causal)
    finally:
        cute_member.STAGE_MIN_REUSE = saved_reuse
    if not info["cute_step"] or info["cute_staged"] != staged:
        if staged and info["cute_step"]:  # more rows than cute_member.STAGE_BYTES holds: not timed
            log(f"{case.shape()}: the member does not stage {pool.page_size}-token pages of this step (more rows "
                f"than cute_member.STAGE_BYTES holds)")
            return None, None
        raise RuntimeError(f"the member did not take the step as asked (staged {staged}): {info}")
    return fn, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.cute_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x1024,4x4096,1x16384", help="batch x length, comma-separated")
    ap.add_argument("--heads", default="32/8,32/32", help="query heads / KV heads, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--name", default="cute_probe")
    ap.add_argument("--modes", default=",".join(MODES), help=f"the CTA's ragged modes, of {', '.join(MODES)}")
    ap.add_argument("--paged", default="16", help="page sizes to time the overlapped CTA on (pages in random order), "
                                                    "comma-separated; empty: none")
    ap.add_argument("--gather", default="", help="page sizes to time the CTA gathering K / V rows on (any power of "
                                                  "two, 1 included), comma-separated; empty: none")
    ap.add_argument("--head-dim", type=int, default=P.D, help="head size (64, 96, 128 or 256)")
    ap.add_argument("--paged-modes", default="cute_overlap",
                    help="the CTA's modes on pages (and gathered), comma-separated, of the --modes names")
    ap.add_argument("--paged-vbox", default="1", help="V in one TMA box a page (1) or a box a page and dim block (0), "
                                                      "comma-separated: both timed side by side")
    ap.add_argument("--paged-split", default="1", help="a tile's boxes issued by the producer's four warps (1) or one "
                                                       "thread (0), comma-separated: both timed side by side")
    ap.add_argument("--staged", action="store_true",
                    help="also the member staging each --paged pool's pages into rows for its ragged CTA, copy "
                         "included (member_staged<P>; member_paged<P> reads the pages)")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="no FlashInfer FA3 anchor (its first build at a head size is minutes): ratios to ours")
    ap.add_argument("--vllm-fa3", action="store_true",
                    help="vLLM's FlashAttention-3 too, ragged (vllm_fa3) and on each --paged pool (vllm_fa3_paged<P>); "
                         "the anchor when there is no FlashInfer")
    ap.add_argument("--full", action="store_true", help="no causal mask (every kernel and anchor)")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if a.modes == ap.get_default("modes") and a.head_dim not in (64, 96):  # three warpgroups: head sizes 64, 96
        modes = [m for m in modes if MODES[m][3] == 2]
    paged_modes = [m for m in a.paged_modes.split(",") if m]
    if any(m not in MODES for m in modes + paged_modes):
        ap.error(f"--modes, --paged-modes: {modes}, {paged_modes}; accepted: {', '.join(MODES)}")
    from fi_backend.shapes import PREFILL_FA3_TUNINGS
    from perf.zoo import parse_shapes
    fi_fa3 = None if a.no_flashinfer else P.FlashInferRagged("fa3")
    vfunc = None
    if a.vllm_fa3:
        vfunc, why = P.vllm_fa3()
        if vfunc is None:
            ap.error(f"--vllm-fa3: {why}")
    causal = not a.full
    # every probe module at once, in parallel (one nvcc each): the timing loop below then only loads them
    pages = [int(x) for x in a.paged.split(",") if x]
    specs = [probe_spec(a.head_dim, m, causal) for m in modes]
    specs += [paged_spec(a.head_dim, page, causal, m, vbox=bool(int(vb)), split=bool(int(sp)))
              for page in pages for m in paged_modes for vb in a.paged_vbox.split(",")
              for sp in a.paged_split.split(",")]
    specs += [paged_spec(a.head_dim, int(page), causal, m, gather=True)
              for page in a.gather.split(",") if page for m in paged_modes]
    from fi_backend import kernels
    failed = [r for r in kernels.prepare(specs, jobs=os.cpu_count()) if isinstance(r, Exception)]
    if failed:
        raise failed[0]
    anchor = "flashinfer_fa3" if fi_fa3 is not None else "vllm_fa3" if vfunc is not None else "ours"
    rows = []
    for heads in a.heads.split(","):
        hq, hkv = (int(x) for x in heads.split("/"))
        for b, s in parse_shapes(a.shapes):
            case = P.Case(b, s, hq, hkv, head_dim=a.head_dim, seed=b + s)
            fns, outs = {}, {}
            for name in modes:
                fns[name], outs[name] = probe_fn(case, name, causal=causal)
            for page in pages:
                for m in paged_modes:
                    for vbox in (int(x) for x in a.paged_vbox.split(",")):
                        for split in (int(x) for x in a.paged_split.split(",")):
                            name = f"{m}_paged{page}" + ("" if vbox else "_vb0") + ("" if split else "_sp0")
                            fns[name], outs[name] = paged_fn(case, page, m, vbox=bool(vbox), split=bool(split),
                                                             causal=causal)
                # the same pages through BatchAttention: the prefill family's CuTe member (the launch engines run)
                name = f"member_paged{page}"
                pool = P.Paged(case, page)
                fns[name], outs[name] = member_fn(case, pool, causal, staged=False)
                if a.staged:
                    fn, out = member_fn(case, pool, causal, True)
                    if fn is not None:
                        fns[f"member_staged{page}"], outs[f"member_staged{page}"] = fn, out
                if vfunc is not None:
                    fns[f"vllm_fa3_paged{page}"], outs[f"vllm_fa3_paged{page}"] = P.vllm_paged_fn(vfunc, case, pool,
                                                                                                   causal=causal)
            for page in (int(x) for x in a.gather.split(",") if x):
                for m in paged_modes:
                    name = f"{m}_gather{page}"
                    fns[name], outs[name] = paged_fn(case, page, m, gather=True, causal=causal)
            if fi_fa3 is not None:
                fns["flashinfer_fa3"], outs["flashinfer_fa3"] = fi_fa3.fn(case, causal=causal)
            if vfunc is not None:
                fns["vllm_fa3"], outs["vllm_fa3"] = P.vllm_fn(vfunc, case, causal=causal)
            fns["ours"], outs["ours"], _ = P.ours_fn(case, causal=causal)
            if case.d in PREFILL_FA3_TUNINGS:
                fns["ours_fa3"], outs["ours_fa3"], _ = P.ours_fn(case, tuning=PREFILL_FA3_TUNINGS[case.d],
                                                                 causal=causal)
            times = time_rounds(fns, a.rounds, a.rep)
            us = {k: statistics.median(v) for k, v in times.items()}
            base = us[anchor]
            r = {**case.shape(), "us": us, "us_per_round": times,
                 f"{anchor}_time_over": {k: base / v for k, v in us.items() if k != anchor},
                 "checks": {k: P.check(f"{heads} {b}x{s} {k} vs {anchor}", diff_stats(o, outs[anchor]))
                            for k, o in outs.items() if k != anchor}}
            rows.append(r)
            log(f"{heads} {b}x{s}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items())
                + f" | {anchor} time / " + ", ".join(f"{k} {v:.3f}" for k, v in r[f"{anchor}_time_over"].items()))
            del fns, outs, case
            torch.cuda.empty_cache()
    write_result(a.name, {**stamp(), "causal": causal, "head_dim": a.head_dim, "rows": rows,
                          "anchor": "FlashInfer 0.6.14 BatchPrefillWithRaggedKVCacheWrapper(backend='fa3')"
                          if fi_fa3 is not None else "vLLM's FlashAttention-3 (flash_attn_varlen_func, ragged)"
                          if vfunc is not None else "ours: BatchAttention(kernel='prefill') on ragged K / V",
                          "ratios": f"{anchor}_time_over: {anchor}'s time / that kernel's (> 1: it is faster)"})
    return 1 if P.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
