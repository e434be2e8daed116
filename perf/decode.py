"""Decode attention: fi-backend against FlashInfer 0.6.14 on identical inputs, in one process.

    python -m perf.decode [--quick] [--sections grid,page,uneven] [--name decode_h100]

Anchor: FlashInfer's BatchDecodeWithPagedKVCacheWrapper with use_tensor_cores=True and False, on the same
q and the same paged KV (FlashInfer's NHD layout [pages, 2, page, Hkv, D]; ours reads its k and v views
by strides). The bandwidth ceiling is a plain device-to-device copy measured in the same run.
KV sets are rotated so that the 50 MB L2 flatters no side: each timed call reads another set.
Bytes counted: every KV byte once, plus q and o. Times are device times per call (perf.common.time_us keeps
the host ahead of the device), as under the CUDA-graph replay engines use for decode: before 2026-11-22 the
small shapes (batch 1-16 at 1k, under ~40 us) timed each side's Python launch path too, and moved by 2x
between runs.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from perf.common import copy_rate_gbps, device_info, time_us, write_result

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
L2_ROTATE_BYTES = 256 << 20      # rotate sets until this many bytes separate two reads of one set
MAX_SET_BYTES = 40 << 30         # skip shapes whose KV does not fit next to everything else


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Case:
    """One batch: lengths, a paged KV pool with `sets` independent KV caches, q, and block tables. Heads and
    head_dim default to HQ / HKV / D (perf/zoo.py passes the model zoo's)."""

    def __init__(self, kv_lens, page_size, sets=None, seed=0, kv_dtype=DTYPE, split_kv=False, *, hq=None, hkv=None,
                 d=None, device="cuda"):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.hq, self.hkv, self.d = hq or HQ, hkv or HKV, d or D
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32)
        self.B = len(kv_lens)
        self.page = page_size
        blocks = (self.kv_lens + page_size - 1) // page_size
        self.max_blocks = int(blocks.max())
        self.num_pages = int(blocks.sum())
        self.kv_dtype = kv_dtype
        kv_bytes = int(self.kv_lens.sum()) * self.hkv * self.d * 2 * torch.tensor([], dtype=kv_dtype).element_size()
        self.kv_bytes = kv_bytes
        self.sets = sets or max(1, min(64, math.ceil(L2_ROTATE_BYTES / max(kv_bytes, 1))))
        # pages of a request are a random permutation of the pool, as in a serving engine's cache
        perm = torch.randperm(self.num_pages, generator=g).to(torch.int32)
        table = torch.zeros(self.B, self.max_blocks, dtype=torch.int32)
        starts = torch.cumsum(blocks, 0) - blocks
        col = torch.arange(self.max_blocks)
        used = col[None, :] < blocks[:, None]
        table[used] = perm[(starts[:, None] + col[None, :])[used]]
        self.block_table = table.to(device)
        self.indptr = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(blocks, 0).to(torch.int32)]).to(device)
        self.indices = perm[(starts[:, None] + col[None, :])[used]].to(device)  # compact CSR for FlashInfer, same order
        self.last_page_len = (self.kv_lens - (blocks - 1) * page_size).to(torch.int32).to(device)
        # FlashInfer's NHD layout [pages, 2, page, Hkv, D], or split (k, v) caches [pages, page, Hkv, D]
        head = (self.hkv, self.d)
        shape = (self.num_pages, page_size, *head) if split_kv else (self.num_pages, 2, page_size, *head)
        make = lambda: torch.randn(shape, dtype=DTYPE, device=device).to(kv_dtype)
        self.caches = [(make(), make()) if split_kv else make() for _ in range(self.sets)]
        # the same caches as ours reads them: a (k, v) pair of [pages, page, Hkv, D] views
        self.kv_pairs = [c if split_kv else (c[:, 0], c[:, 1]) for c in self.caches]
        self.q = torch.randn(self.B, self.hq, self.d, dtype=DTYPE, device=device)
        self.out = torch.empty_like(self.q)
        self.qo_indptr = torch.arange(self.B + 1, dtype=torch.int32)
        self.bytes = kv_bytes + 2 * self.q.numel() * self.q.element_size()


TUNING = None   # kernel-shape override for tuning runs (--tuning), see fi_backend.wrappers.decode_spec


def ours(case: Case, *, split=True, variant=None, plan_kw=None, num_ctas=None):
    """(fn, setup, workspace): our decode kernel on the case; num_ctas: CTAs of the grid (default:
    the recommended count)."""
    from fi_backend import formats
    from fi_backend.workspace import Workspace
    from fi_backend.wrappers import BatchAttention

    from fi_backend import variants
    variant = variant or variants.DEFAULT
    if num_ctas is None:
        num_ctas = BatchAttention.recommended_num_ctas("cuda", case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=case.kv_dtype,
                                                       variant=variant, tuning=TUNING)
    ws = Workspace("cuda", max_requests=case.B, max_tokens=case.B, num_ctas=num_ctas, max_tile_q=16,
                   num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d)
    attn = BatchAttention(ws, case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=case.kv_dtype, page_size=case.page,
                          variant=variant, tuning=TUNING)
    bsr = formats.from_block_table(case.block_table, case.kv_lens.cuda(), case.qo_indptr.cuda(), case.page,
                                   num_kv_blocks=case.num_pages)
    attn.plan(case.qo_indptr, case.kv_lens, bsr, **(plan_kw or {}))
    if not split:  # the same kernel with one work item per request: the plan without KV splitting
        ws.plan(case.qo_indptr, case.kv_lens, tile_q=attn.rows_per_tile, num_units=attn.num_units, min_kv_chunk=1 << 30,
                kv_chunk_align=int(attn.kv_tile), cost_q=float(attn.kv_tile))
    kv = case.kv_pairs
    state = {"i": 0}

    def setup(i):
        state["i"] = i % case.sets

    def fn():
        attn.run(case.q, kv[state["i"]], out=case.out)
    return fn, setup, ws


def flashinfer_fn(case: Case, tensor_cores: bool):
    import flashinfer
    buf = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(buf, "NHD", use_tensor_cores=tensor_cores)
    w.plan(case.indptr, case.indices, case.last_page_len, case.hq, case.hkv, case.d, case.page,
           q_data_type=DTYPE, kv_data_type=case.kv_dtype)
    out = torch.empty_like(case.q)
    state = {"i": 0}

    def setup(i):
        state["i"] = i % case.sets

    def fn():
        w.run(case.q, case.caches[state["i"]], out=out)
    return fn, setup, out


def check_close(case: Case, ours_out, fi_out):
    err = ((ours_out.float() - fi_out.float()).norm() / fi_out.float().norm()).item()
    if not err < 2e-2:
        raise AssertionError(f"ours and FlashInfer disagree: relative difference {err:.3e}")
    return err


def flashinfer_best_us(case: Case, rep: int = 50) -> float:
    """The anchor's median time on the case: FlashInfer's faster decode path (tensor cores on or off)."""
    return min(time_us(f, setup=s, rep=rep)["median_us"] for f, s, _ in (flashinfer_fn(case, tc) for tc in (True, False)))


def measure(case: Case, rep, copy_gbps, *, with_fi=True, split_baseline=False):
    fn, setup, _ = ours(case)
    r = {"batch": case.B, "kv_bytes": case.kv_bytes, "bytes": case.bytes, "sets": case.sets, "page_size": case.page}
    res = time_us(fn, setup=setup, rep=rep)
    r["ours_us"] = res["median_us"]
    r["ours_p90_us"] = res["p90_us"]
    # correctness against FlashInfer on set 0 of this very case
    setup(0)
    fn()
    ours_out = case.out.clone()
    if split_baseline:
        fn_ns, setup_ns, _ = ours(case, split=False)
        r["ours_nosplit_us"] = time_us(fn_ns, setup=setup_ns, rep=rep)["median_us"]
        r["lb_speedup"] = r["ours_nosplit_us"] / r["ours_us"]
    if with_fi:
        for tc in (True, False):
            key = "fi_tc" if tc else "fi_cuda"
            f, s, out = flashinfer_fn(case, tc)
            r[f"{key}_us"] = time_us(f, setup=s, rep=rep)["median_us"]
            s(0)
            f()
            r[f"{key}_rel_diff"] = check_close(case, ours_out, out)
        r["fi_best_us"] = min(r["fi_tc_us"], r["fi_cuda_us"])
        r["ratio_fi_best_over_ours"] = r["fi_best_us"] / r["ours_us"]
    r["ours_gbps"] = r["bytes"] / (r["ours_us"] * 1e-6) / 1e9
    r["ours_pct_copy"] = 100 * r["ours_gbps"] / copy_gbps
    return r


def uniform_rows(label, shapes, rep, copy_gbps, with_fi, **case_kw):
    """measure() over batches of equal lengths, (batch, kv_len) each, logging one line per shape."""
    rows = []
    for b, L in shapes:
        if b * L * HKV * D * 4 > MAX_SET_BYTES:
            continue
        case = Case([L] * b, 16, **case_kw)
        r = measure(case, rep, copy_gbps, with_fi=with_fi)
        r["kv_len"] = L
        rows.append(r)
        msg = f"{label} b={b:4d} kv={L:6d}: ours {r['ours_us']:8.1f} us ({r['ours_pct_copy']:5.1f}% copy)"
        if with_fi:
            msg += f"  fi tc {r['fi_tc_us']:8.1f}  fi cuda {r['fi_cuda_us']:8.1f}  ratio {r['ratio_fi_best_over_ours']:.3f}"
        log(msg)
        del case
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--sections", default="grid,page,uneven,rope,fp8")
    ap.add_argument("--name", default="decode_h100")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--report", metavar="JSON", help="only write the markdown table of a results JSON")
    ap.add_argument("--tuning", help='kernel-shape override as JSON, e.g. \'{"warps": 4, "sub": 1, "stages": 3}\'')
    ap.add_argument("--grid", help="grid shapes as batch:kv,... (default: the full grid)")
    a = ap.parse_args(argv)
    global TUNING
    if a.tuning:
        import json
        TUNING = json.loads(a.tuning)
    if a.report:
        write_report(a.report)
        return
    sections = a.sections.split(",")
    with_fi = not a.no_flashinfer
    copy = copy_rate_gbps()
    log(f"copy rate {copy:.0f} GB/s (read + write)")
    results = {"device": device_info(), "copy_rate_gbps": copy, "tuning": TUNING,
               "shape": {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "dtype": "bf16"}}
    if with_fi:
        import flashinfer
        results["anchor"] = f"flashinfer {flashinfer.__version__} BatchDecodeWithPagedKVCacheWrapper (tensor cores on/off)"

    if "grid" in sections:
        batches = (1, 16, 64) if a.quick else (1, 16, 64, 256)
        lens = (1024, 4096) if a.quick else (1024, 4096, 16384, 32768)
        shapes = [(b, L) for b in batches for L in lens]
        if a.grid:
            shapes = [tuple(int(x) for x in item.split(":")) for item in a.grid.split(",")]
        results["grid"] = uniform_rows("grid", shapes, a.rep, copy, with_fi)
    if "page" in sections:
        rows = []
        for b, L in ((64, 4096), (16, 16384)) if not a.quick else ((64, 4096),):
            r16 = measure(Case([L] * b, 16), a.rep, copy, with_fi=False)
            r1 = measure(Case([L] * b, 1), a.rep, copy, with_fi=False)
            rows.append({"batch": b, "kv_len": L, "page16_us": r16["ours_us"], "page1_us": r1["ours_us"],
                         "page1_over_page16": r1["ours_us"] / r16["ours_us"]})
            log(f"page b={b} kv={L}: page16 {r16['ours_us']:.1f} us, page1 {r1['ours_us']:.1f} us "
                f"({rows[-1]['page1_over_page16']:.3f}x)")
        results["page_size"] = rows
    if "uneven" in sections:
        from perf.sharegpt import load_trace
        rows = []
        skew = [32768] + [512] * 63
        g = torch.Generator().manual_seed(0)
        pairs = load_trace(64)
        # a decode step of ShareGPT requests: each has its prompt plus a random part of its output cached
        share = [p + 1 + int(torch.randint(0, o, (1,), generator=g)) for p, o in pairs]
        for name, lens in (("skewed_32k_plus_63x512", skew), ("sharegpt_64", share)):
            r = measure(Case(lens, 16), a.rep, copy, with_fi=with_fi, split_baseline=True)
            r["case"] = name
            rows.append(r)
            msg = f"uneven {name}: ours {r['ours_us']:.1f} us, no-split {r['ours_nosplit_us']:.1f} us " \
                  f"(load balance {r['lb_speedup']:.2f}x)"
            if with_fi:
                msg += f"  fi best {r['fi_best_us']:.1f} ratio {r['ratio_fi_best_over_ours']:.3f}"
            log(msg)
        results["uneven"] = rows
    if "rope" in sections:
        results["rope"] = rope_section(a.rep)
    if "fp8" in sections:  # % copy counts fp8 bytes
        results["fp8"] = uniform_rows("fp8", ((64, 2048), (64, 4096), (64, 16384)), a.rep, copy, with_fi,
                                      kv_dtype=torch.float8_e4m3fn)
    write_report(write_result(a.name, results))


def write_report(json_path):
    """perf/results/<name>.md: the tables a reader wants from the JSON (same figures, nothing recomputed
    but percentages and ratios)."""
    import json
    from pathlib import Path
    r = json.loads(Path(json_path).read_text())
    fi = "anchor" in r
    lines = [f"# Decode attention, {r['device']['name']}, {r['date'][:10]}, commit {r['commit'][:12]}", "",
             f"32 query / 8 KV heads, head_dim 128, bf16, page 16 unless noted; median of CUDA-event timings, "
             f"KV sets rotated past L2. Copy rate {r['copy_rate_gbps']:.0f} GB/s (read + write). "
             f"Anchor: {r.get('anchor', 'none')}. ratio = FlashInfer's best path / ours (> 1: ours faster).", ""]
    if "grid" in r:
        lines += ["| batch | KV | ours us | % copy | FI tensor-core us | FI CUDA-core us | ratio |", "|---|---|---|---|---|---|---|"]
        for x in r["grid"]:
            lines.append(f"| {x['batch']} | {x['kv_len']} | {x['ours_us']:.1f} | {x['ours_pct_copy']:.1f} | "
                         + (f"{x['fi_tc_us']:.1f} | {x['fi_cuda_us']:.1f} | {x['ratio_fi_best_over_ours']:.3f} |" if fi else "| | |"))
        lines.append("")
    if "uneven" in r:
        lines += ["| uneven batch | ours us | one item per request us | load-balance speedup | FI best us | ratio |",
                  "|---|---|---|---|---|---|"]
        for x in r["uneven"]:
            lines.append(f"| {x['case']} | {x['ours_us']:.1f} | {x['ours_nosplit_us']:.1f} | {x['lb_speedup']:.2f} | "
                         + (f"{x['fi_best_us']:.1f} | {x['ratio_fi_best_over_ours']:.3f} |" if fi else "| |"))
        lines.append("")
    if "page_size" in r:
        lines += ["| batch | KV | page 16 us | page 1 us | page 1 / page 16 |", "|---|---|---|---|---|"]
        lines += [f"| {x['batch']} | {x['kv_len']} | {x['page16_us']:.1f} | {x['page1_us']:.1f} | {x['page1_over_page16']:.3f} |"
                  for x in r["page_size"]] + [""]
    if "rope" in r:
        lines += ["| batch | KV | fused RoPE us | plain attention us | rotary pass + attention us | fused speedup |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {x['batch']} | {x['kv_len']} | {x['fused_us']:.1f} | {x['plain_attention_us']:.1f} | "
                  f"{x['separate_rotary_plus_attention_us']:.1f} | {x['speedup_fused_over_separate']:.2f} |" for x in r["rope"]] + [""]
    if "fp8" in r:
        lines += ["| fp8 e4m3 KV: batch | KV | ours us | % copy (fp8 bytes) | FI best us | ratio |", "|---|---|---|---|---|---|"]
        lines += [f"| {x['batch']} | {x['kv_len']} | {x['ours_us']:.1f} | {x['ours_pct_copy']:.1f} | "
                  + (f"{x['fi_best_us']:.1f} | {x['ratio_fi_best_over_ours']:.3f} |" if fi else "| |") for x in r["fp8"]] + [""]
    out = Path(json_path).with_suffix(".md")
    out.write_text("\n".join(lines))
    log(f"wrote {out}")


def rope_section(rep):
    """Fused RoPE (keys rotated in registers as they are loaded) against a separate rotary pass over every
    cached key (FlashInfer's apply_llama31_rope_pos_ids_inplace) followed by plain attention, both on the
    same split (k, v) caches [pages, page, Hkv, D] (FlashInfer's rotary needs a flat [tokens, H, D] k).
    That API rotates a query with as many rows as keys: a 1-head dummy query rides along (1/8 of the
    K traffic at 8 KV heads), which the JSON notes."""
    import flashinfer
    from fi_backend import reference, variants
    cfg = reference.RopeConfig(theta=500000.0, llama31=reference.Llama31Scaling())
    rows = []
    for b, L in ((64, 4096), (16, 16384)):
        case = Case([L] * b, 16, split_kv=True)
        fused, fsetup, _ = ours(case, variant=variants.ROPE, plan_kw={"rope": cfg})
        plain, psetup, _ = ours(case)
        # the position of the token in every cache slot (page, offset) of the pool
        blocks = (case.kv_lens.cuda() + case.page - 1) // case.page
        req = torch.repeat_interleave(torch.arange(case.B, device="cuda"), blocks)
        first = torch.cumsum(blocks, 0) - blocks
        blk = torch.arange(case.num_pages, device="cuda") - first[req]
        page_pos = torch.empty(case.num_pages, dtype=torch.int64, device="cuda")
        page_pos[case.indices.long()] = blk * case.page
        pos = (page_pos[:, None] + torch.arange(case.page, device="cuda")[None, :]).reshape(-1).to(torch.int32)
        dummy_q = torch.randn(pos.numel(), 1, D, dtype=DTYPE, device="cuda")
        state = {"i": 0}

        def separate():
            k = case.caches[state["i"]][0]
            flashinfer.apply_llama31_rope_pos_ids_inplace(
                dummy_q, k.view(-1, HKV, D), pos, rope_scale=8.0, rope_theta=cfg.theta,
                low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192)
            plain()

        def setup(i):
            state["i"] = i % case.sets
            psetup(i)
        t_fused = time_us(fused, setup=fsetup, rep=rep)["median_us"]
        t_plain = time_us(plain, setup=psetup, rep=rep)["median_us"]
        t_sep = time_us(separate, setup=setup, rep=rep)["median_us"]
        r = {"batch": b, "kv_len": L, "fused_us": t_fused, "plain_attention_us": t_plain,
             "separate_rotary_plus_attention_us": t_sep, "speedup_fused_over_separate": t_sep / t_fused,
             "note": "separate rotary = flashinfer.apply_llama31_rope_pos_ids_inplace over all cached keys, "
                     "with a 1-head dummy query of as many rows (its API needs one)"}
        rows.append(r)
        log(f"rope b={b} kv={L}: fused {t_fused:.1f} us, plain {t_plain:.1f} us, rotary+attention {t_sep:.1f} us "
            f"(fused {r['speedup_fused_over_separate']:.2f}x faster)")
        del case
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
