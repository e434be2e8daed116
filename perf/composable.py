"""python -m perf composable: decode with shared prefixes (composable formats, docs/composable.md) against
FlashInfer 0.6.14's MultiLevelCascadeAttentionWrapper in the same process, on the issue's three cells.

Llama-3.1-8B heads (32 query / 8 KV, head_dim 128, bf16, pages of 16 or --page); each cell is B requests sharing
an L-token prefix (the same pages) with S unique tokens each, one query row a request; a fourth number N (BxLxSxN)
makes B / N groups of N requests, each group its own prefix (parallel sampling: n = N). Timed, in alternating
rounds (perf.common.time_rounds, CUDA events): ours single-format (the decode kernel without groups: every
request reads the prefix), ours with the group on the decode kernel and on the prefill kernel (one launch each),
FlashInfer's two-level cascade (level 0: all queries against the prefix; level 1: each request's own pages) and
FlashInfer's single-format decode. Two KV pools alternate between calls. Outputs are checked against each other
before timing. Writes perf/results/composable.json (device, date, commit).

    python -m perf composable [--rounds 5] [--rep 50] [--cells 64x32768x256,16x8192x256,128x1024x256] [--page 16]
                              [--shared-gain 0]   # the planner's verdict forced: every group kept
                              [--unshared]        # both single-format decodes on distinct pages too (control)
                              [--ordered-pages]   # pages in pool order, not shuffled (contiguous KV runs)
                              [--workspace-requests 256]   # workspaces sized as an engine's (max_num_seqs): the
                                                  # groups' partial rows, so their prefix chunks, grow with it
                              [--prefill-tunings '[{"warps": 8, "mfrags": 2}]']   # the groups on forced prefill
                                                  # tile shapes too (tuning of fi_backend.specs.prefill_spec)
                              [--group-item-mins 0,128,512]   # the groups on the prefill kernel planned with
                                                  # these least item costs too (FI_BACKEND_PLAN_GROUP_ITEM_MIN)
                              [--build old='-DFI_MY_SWITCH=0']   # ... and on modules built with these
                                                  # extra nvcc flags (FI_BACKEND_NVCC_FLAGS), same process
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from fi_backend import env
from perf.common import add_build_argument, diff_stats, log, parse_builds, stamp, time_rounds, write_result

HQ, HKV, D, PAGE = 32, 8, 128, 16
WORKSPACE_REQUESTS = 0   # our workspaces' max_requests (0: the cell's batch); engines size theirs by their limit
DTYPE = torch.bfloat16
CELLS = ((64, 32768, 256), (16, 8192, 256), (128, 1024, 256))
SETS = 2
ORDERED = False   # --ordered-pages: pages in pool order (this pool interleaves K and V a page: still gathered)


class Cell:
    """B requests in groups of N (all B when N is 0): each group's prefix pages, then each request's own pages;
    SETS KV pools."""

    def __init__(self, B: int, L: int, S: int, N: int = 0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        N = N or B
        if B % N or L % PAGE:
            raise ValueError(f"cell {B}x{L}x{S}x{N}: B must be a multiple of N and L of the page size {PAGE}")
        self.B, self.L, self.S, self.N = B, L, S, N
        G, P, U = B // N, L // PAGE, -(-S // PAGE)
        self.num_pages = G * P + B * U
        perm = (torch.arange(self.num_pages) if ORDERED else torch.randperm(self.num_pages, generator=g)).to(torch.int32)
        prefix, own = perm[:G * P].view(G, P), perm[G * P:].view(B, U)
        self.table = torch.cat((prefix.repeat_interleave(N, dim=0), own), dim=1).contiguous().cuda()
        self.kv_lens = torch.full((B,), L + S, dtype=torch.int32)
        self.qo = torch.arange(B + 1, dtype=torch.int32)
        self.groups = torch.tensor([[i * N, (i + 1) * N, L] for i in range(G)], dtype=torch.int32)
        shape = (self.num_pages, 2, PAGE, HKV, D)   # FlashInfer's NHD pool; ours reads its k / v views
        self.pools = [torch.randn(shape, dtype=DTYPE, device="cuda") for _ in range(SETS)]
        self.q = torch.randn(B, HQ, D, dtype=DTYPE, device="cuda")
        # FlashInfer: level 0 (all queries, the prefix pages), level 1 (each request's own pages)
        last = S - (U - 1) * PAGE
        self.fi_levels = (
            (torch.arange(G + 1, dtype=torch.int32) * N, torch.arange(G + 1, dtype=torch.int32) * P,
             prefix.reshape(-1), torch.full((G,), PAGE, dtype=torch.int32)),
            (self.qo, torch.arange(B + 1, dtype=torch.int32) * U, own.reshape(-1),
             torch.full((B,), last, dtype=torch.int32)),
        )


def set_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """The cells' heads (Llama-3.1-8B's 32 / 8 / 128 by default)."""
    global HQ, HKV, D
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads or head_dim not in (64, 80, 96, 128, 256):
        raise ValueError(f"heads: query heads a multiple of KV heads >= 1, head_dim 64, 80, 96, 128 or 256; got "
                         f"{num_qo_heads} / {num_kv_heads} / {head_dim}")
    HQ, HKV, D = num_qo_heads, num_kv_heads, head_dim


def set_page(page: int) -> None:
    """The cells' page size (tokens a KV page)."""
    global PAGE
    if page < 1:
        raise ValueError(f"--page must be >= 1, got {page}")
    PAGE = page


def ours(cell: Cell, kernel: str, groups: bool, tuning=None, item_min=None, nvcc_flags=None):
    """(fn, out, plan info) of our wrapper on the cell; item_min: the least an item costs the plan of a group step
    (FI_BACKEND_PLAN_GROUP_ITEM_MIN while the wrapper is made; None: the wrapper's own); nvcc_flags: its modules
    built with these extra flags (FI_BACKEND_NVCC_FLAGS while it is made and planned)."""
    from fi_backend import formats
    from fi_backend.wrappers import BatchAttention
    n = max(cell.B, WORKSPACE_REQUESTS)
    with env.setting(env.PLAN_GROUP_ITEM_MIN, None if item_min is None else repr(float(item_min))), \
            env.setting(env.NVCC_FLAGS, nvcc_flags):
        ws = BatchAttention.workspace_for("cuda", HQ, HKV, D, max_requests=n, max_tokens=n, kernel=kernel,
                                          shared_prefix=True, tuning=tuning)
        attn = BatchAttention(ws, HQ, HKV, D, q_dtype=DTYPE, page_size=PAGE, kernel=kernel, tuning=tuning)
        bsr = formats.from_block_table(cell.table, cell.kv_lens.cuda(), cell.qo.cuda(), PAGE,
                                       num_kv_blocks=cell.num_pages)
        attn.plan(cell.qo, cell.kv_lens, bsr, causal=True, prefix_groups=cell.groups if groups else None)
    if groups and attn.plan_info.shared_groups != len(cell.groups):   # the planner found groups not worth it here
        log(f"  {cell.B}x{cell.L}+{cell.S} {kernel}: {len(cell.groups) - attn.plan_info.shared_groups} of "
            f"{len(cell.groups)} groups planned single-format ({attn.plan_info})")
    out = torch.empty_like(cell.q)
    kv = [(p[:, 0], p[:, 1]) for p in cell.pools]
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % SETS
        attn.run(cell.q, kv[state["i"]], out=out)
    fn.attn = attn   # perf/tools/timeline.py reads the launched module's stamps
    return fn, out, attn.plan_info


def flashinfer_cascade(cell: Cell):
    import flashinfer
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.MultiLevelCascadeAttentionWrapper(2, buf, "NHD")
    qo, indptr, indices, last = ([lv[i].cuda() for lv in cell.fi_levels] for i in range(4))
    w.plan(qo, indptr, indices, last, HQ, HKV, D, PAGE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)
    state = {"i": 0, "out": None}

    def fn():
        state["i"] = (state["i"] + 1) % SETS
        state["out"] = w.run(cell.q, cell.pools[state["i"]])
    return fn, state


def flashinfer_decode(cell: Cell):
    import flashinfer
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(buf, "NHD", use_tensor_cores=True)
    U = cell.table.shape[1]
    w.plan(torch.arange(cell.B + 1, dtype=torch.int32, device="cuda") * U, cell.table.reshape(-1),
           torch.full((cell.B,), cell.fi_levels[1][3][0].item(), dtype=torch.int32, device="cuda"), HQ, HKV, D, PAGE,
           q_data_type=DTYPE, kv_data_type=DTYPE)
    out = torch.empty_like(cell.q)
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % SETS
        w.run(cell.q, cell.pools[state["i"]], out=out)
    return fn, out


def run_cell(B: int, L: int, S: int, rounds: int, rep: int, N: int = 0, unshared: bool = False,
             tunings=(), item_mins=(), builds=()) -> dict:
    cell = Cell(B, L, S, N)
    single, single_out, _ = ours(cell, "decode", False)
    dec, dec_out, dec_info = ours(cell, "decode", True)
    pre, pre_out, pre_info = ours(cell, "prefill", True)
    forced = {f"ours_prefill_groups_t{i}": ours(cell, "prefill", True, t) for i, t in enumerate(tunings)}
    forced.update({f"ours_prefill_groups_c{c:g}": ours(cell, "prefill", True, item_min=c) for c in item_mins})
    forced.update({f"ours_prefill_groups_{name}": ours(cell, "prefill", True, nvcc_flags=flags) for name, flags in builds})
    fi, fi_state = flashinfer_cascade(cell)
    fid, fid_out = flashinfer_decode(cell)
    for f in (single, dec, pre, fi, fid, *(v[0] for v in forced.values())):   # one call each on the same pool
        f()
        f()
    torch.cuda.synchronize()
    checks = {k: diff_stats(o, single_out) for k, o in (("ours_decode_groups", dec_out), ("ours_prefill_groups", pre_out),
                                                         ("flashinfer_cascade", fi_state["out"]),
                                                         ("flashinfer_decode", fid_out),
                                                         *((k, v[1]) for k, v in forced.items()))}
    for k, c in checks.items():
        if not c["rel_diff"] < 2e-2:
            raise AssertionError(f"{B}x{L}+{S}: {k} differs from ours single-format: {c}")
    fns = {"ours_single": single, "ours_decode_groups": dec, "ours_prefill_groups": pre, "flashinfer_cascade": fi,
           "flashinfer_decode": fid, **{k: v[0] for k, v in forced.items()}}
    if unshared:   # the control: the same lengths on distinct pages (every request its own prefix pages)
        ctl = Cell(B, L, S, 1, seed=1)
        fns["ours_single_unshared"], ctl_out, _ = ours(ctl, "decode", False)
        fns["flashinfer_decode_unshared"], fid_ctl_out = flashinfer_decode(ctl)
        for f in (fns["ours_single_unshared"], fns["flashinfer_decode_unshared"]):
            f()
            f()
        torch.cuda.synchronize()
        checks["flashinfer_decode_unshared"] = c = diff_stats(fid_ctl_out, ctl_out)
        if not c["rel_diff"] < 2e-2:
            raise AssertionError(f"{B}x{L}+{S}: FlashInfer's decode on distinct pages differs from ours: {c}")
    times = time_rounds(fns, rounds, rep, on_round=lambda i, t: log(f"  {B}x{L}+{S} round {i + 1}/{rounds}"))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    best = min(med["ours_decode_groups"], med["ours_prefill_groups"])
    name = f"{B} x {L} shared + {S}" + (f", groups of {cell.N}" if cell.N != B else "")
    res = {"cell": name, "batch": B, "prefix": L, "suffix": S, "group_size": cell.N, "page": PAGE,
           "median_us": med, "rounds_us": times,
           "speedup_vs_single": med["ours_single"] / best, "vs_flashinfer_cascade": med["flashinfer_cascade"] / best,
           "checks": checks, "plan": {"decode": dec_info._asdict(), "prefill": pre_info._asdict(),
                                      **{k: v[2]._asdict() for k, v in forced.items()}}}
    if unshared:   # time on distinct pages over time on shared ones: how much each single-format decode gains from them
        res["shared_pages_speedup"] = {"ours": med["ours_single_unshared"] / med["ours_single"],
                                       "flashinfer": med["flashinfer_decode_unshared"] / med["flashinfer_decode"]}
    log(f"{res['cell']}: " + ", ".join(f"{k} {v:.1f} us" for k, v in med.items())
        + f"; {res['speedup_vs_single']:.2f}x single, {res['vs_flashinfer_cascade']:.2f}x FlashInfer cascade")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf composable", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--cells", default=",".join(f"{b}x{l}x{s}" for b, l, s in CELLS),
                    help="BxLxS or BxLxSxN (B requests in groups of N), comma-separated")
    ap.add_argument("--page", type=int, default=PAGE, help="tokens a KV page")
    ap.add_argument("--name", default="composable")
    ap.add_argument("--unshared", action="store_true",
                    help="also time both single-format decodes on the same lengths with distinct pages (the control)")
    ap.add_argument("--prefill-tunings", type=json.loads, default=[],
                    help="a JSON list of prefill kernel shapes (fi_backend.specs.prefill_spec tunings) to time the "
                         "groups on besides the family's pick: ours_prefill_groups_t0, _t1, ...")
    ap.add_argument("--group-item-mins", default="",
                    help="comma-separated least item costs (KV tokens) to plan the groups on the prefill kernel with "
                         "besides the wrapper's own: ours_prefill_groups_c<cost>")
    add_build_argument(ap, "the groups on the prefill kernel (ours_prefill_groups_<NAME>)")
    ap.add_argument("--ordered-pages", action="store_true",
                    help="pages in pool order (prefix, then each request's own) instead of a random permutation")
    ap.add_argument("--workspace-requests", type=int, default=0,
                    help="our workspaces' max_requests (default: each cell's batch), as an engine sizes them by its "
                         "request limit; groups get SHARED_ROWS_PER_REQUEST partial rows a request of it")
    ap.add_argument("--shared-gain", type=float, default=None,
                    help="the planner's shared-prefix verdict factor (FI_BACKEND_PLAN_SHARED_GAIN; 0: keep every group)")
    a = ap.parse_args(argv)
    if a.shared_gain is not None:
        os.environ["FI_BACKEND_PLAN_SHARED_GAIN"] = repr(a.shared_gain)
    cells = [tuple(int(x) for x in c.split("x")) for c in a.cells.split(",")]
    if any(len(c) not in (3, 4) for c in cells):
        ap.error(f"--cells: each cell is BxLxS or BxLxSxN; got {a.cells}")
    set_page(a.page)
    global ORDERED
    ORDERED = a.ordered_pages
    global WORKSPACE_REQUESTS
    WORKSPACE_REQUESTS = a.workspace_requests
    import flashinfer
    item_mins = [float(x) for x in a.group_item_mins.split(",") if x.strip()]
    builds = parse_builds(ap, a.build)
    results = [run_cell(*c[:3], a.rounds, a.rep, *c[3:], unshared=a.unshared, tunings=a.prefill_tunings,
                        item_mins=item_mins, builds=builds) for c in cells]
    write_result(a.name, {**stamp(), "flashinfer": flashinfer.__version__,
                                "heads": {"qo": HQ, "kv": HKV, "head_dim": D, "page": PAGE, "dtype": "bf16"},
                                "shared_gain": a.shared_gain, "prefill_tunings": a.prefill_tunings,
                                "workspace_requests": a.workspace_requests, "group_item_mins": item_mins,
                                "builds": dict(builds),
                                "ordered_pages": ORDERED,
                                "cells": results})
    return 0
