"""The model zoo's head configurations: fi-backend against FlashInfer 0.6.14, same inputs, same process.

    python -m perf zoo [--quick] [--sections decode,prefill] [--name zoo_h100] [--no-flashinfer]
                       [--configs 32/8/128,28/4/128] [--merge]
                       [--prefill-tunings '[{"warps": 12, "mfrags": 1, "producer": 1}]']   # other shapes beside ours

Sections:
  decode   every distinct (query heads, KV heads, head_dim) among the zoo models that fi_backend.models.check()
           accepts (--quick: those of QUICK_MODELS), at pages 1, 16, 64, 128, for batch x KV length cells
           7x1000, 64x2047, 128x4099 (--quick: 64x2047); bf16 q and KV. Ours: BatchAttention(kernel="decode")
           as perf/decode.py runs it (pages a random permutation of the pool; KV sets rotated so that 256 MB
           separate two reads of one set, perf.decode.L2_ROTATE_BYTES). Anchor: FlashInfer's
           BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) on the same q and pages (its NHD layout
           [pages, 2, page, Hkv, D]; ours reads the k and v views by strides), for head_dim 64 / 128 / 256
           (FI_HEAD_DIMS); head_dim 80 / 96 time ours only (anchor "none"). ratio = FlashInfer us / ours us,
           the median of the rounds' ratios (> 1: ours faster). Bar: ratio >= 0.98 in every cell.
  prefill  causal bf16, batch x length 4x4096 (also with --quick), this step's K/V ragged (a page-1 identity BSR,
           perf.prefill.ours_fn), for GQA groups 3..7 at head_dim 128 (PREFILL_CONFIGS) and 32/32 heads at head_dim
           96 (Phi-3-mini) and 80. Anchors: FlashInfer's FA2 ragged wrapper (perf.prefill.FlashInferRagged, head_dim
           in FI_HEAD_DIMS) and vLLM's FlashAttention-3 when importable (perf.prefill.vllm_fa3; skipped cleanly
           otherwise). TFLOP/s count causal (query, key) pairs: 4 * h * d * pairs (perf.prefill.attention_flops /
           unmasked_pairs). Bars: at head_dim 128 each group's TFLOP/s >= 0.95 of group 4's (32/8 heads) and
           >= 1.1x FlashInfer FA2's; at head_dim 96 ours >= 0.9 of vLLM FA3's TFLOP/s.

Timing: perf.common.time_rounds (alternating rounds, ours then the anchors, each figure the median of CUDA-event
timings, perf.common.time_us); figures are the medians of the rounds, ratios the medians of the rounds' ratios.
Correctness: ours against the anchor on the whole batch and against a float32 reference on two requests
(decode) or SDPA on request 0 (prefill); a relative L2 difference above 2e-2 fails the run (exit 1) after the
JSON is written. Our kernel modules are built first, in parallel (--no-prebuild: lazily); FlashInfer JIT-compiles
each new head configuration on its first call (~26 s each for decode, timed and recorded).

A full run takes more than one 10-minute command on the GPU machine: split it with --configs (and --sections),
copying each run's JSON back to perf/results/ and passing --merge, which adds the new rows to
perf/results/<name>.json (rows keyed by heads, head_dim, page and shape; the new ones win).
Results: perf/results/<name>.json and .md (also under $OUT when set). FI_COMMIT names the commit where the tree
travels without .git.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from perf.common import RESULTS, commit, device_info, rotating, write_result
from perf.decode import Case

DTYPE = torch.bfloat16
DEVICE = "cuda"                        # the decode cases' device (the CPU tests set "cpu")
FI_HEAD_DIMS = (64, 128, 256)          # head sizes FlashInfer 0.6.14 has kernels for
PAGE_SIZES = (1, 16, 64, 128)
DECODE_CELLS = ((7, 1000), (64, 2047), (128, 4099))   # (batch, KV length), odd on purpose
QUICK_CELLS = ((64, 2047),)
QUICK_MODELS = ("Llama-3.1-8B", "Qwen2.5-7B", "Qwen2.5-14B", "Llama-3.2-3B", "Qwen2.5-1.5B", "Gemma-2-9B",
                "Llama-3.1-405B", "Gemma-3-1B")
# (query heads, KV heads, head_dim, label): the group-4 reference first
PREFILL_CONFIGS = (
    (32, 8, 128, "group 4 (Llama-3.1-8B)"),
    (24, 8, 128, "group 3 (Llama-3.2-3B)"),
    (40, 8, 128, "group 5 (Qwen2.5-14B)"),
    (12, 2, 128, "group 6 (Qwen2.5-1.5B)"),
    (24, 4, 128, "group 6 (24/4)"),
    (28, 4, 128, "group 7 (Qwen2.5-7B)"),
    (32, 32, 96, "head_dim 96 (Phi-3-mini)"),
    (32, 32, 80, "head_dim 80 (32/32)"),
)
PREFILL_SHAPES = ((4, 4096),)
BARS = {"decode_ratio_min": 0.98, "prefill_over_group4_min": 0.95, "prefill_over_fi_fa2_min": 1.1,
        "prefill_d96_over_vllm_fa3_min": 0.9,
        # issue 30: ours over vLLM FA3 by head_dim, causal and full masks
        "prefill_over_vllm_fa3_min": {128: 1.0, 64: 0.95, 256: 0.95}}
PREFILL_MASKS = ("causal", "full")
FI_PREFILL_BACKENDS = ("fa2", "fa3")
MAX_REL_DIFF = 2e-2
SECTIONS = ("decode", "prefill")
_failures: list = []


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ pure helpers (tested on the CPU)

def config_key(hq: int, hkv: int, d: int) -> str:
    return f"{hq}/{hkv}/{d}"


def parse_configs(text):
    """"32/8/128,28/4/128" -> [(32, 8, 128), (28, 4, 128)] (None or "" -> None: no filter)."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split("/")
        if len(parts) != 3:
            raise ValueError(f"config {item!r}: expected query_heads/kv_heads/head_dim, e.g. 32/8/128")
        hq, hkv, d = (int(p) for p in parts)
        if hq < 1 or hkv < 1 or d < 1 or hq % hkv:
            raise ValueError(f"config {item!r}: query heads must be a positive multiple of KV heads")
        if (hq, hkv, d) not in out:
            out.append((hq, hkv, d))
    return out


def parse_shapes(text, sep="x"):
    """"7x1000,64x2047" -> [(7, 1000), (64, 2047)]."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.lower().split(sep)
        if len(parts) != 2:
            raise ValueError(f"shape {item!r}: expected batch{sep}length, e.g. 64{sep}2047")
        b, n = int(parts[0]), int(parts[1])
        if b < 1 or n < 1:
            raise ValueError(f"shape {item!r}: batch and length must be >= 1")
        out.append((b, n))
    return out


def parse_ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def fi_supports(head_dim: int, fi_head_dims=FI_HEAD_DIMS) -> bool:
    return head_dim in fi_head_dims


def decode_configs(only=None, quick=False, fi_head_dims=FI_HEAD_DIMS):
    """(configs, refused): the distinct (query heads, KV heads, head_dim) of the zoo's accepted models as dicts
    (models using each, anchor "flashinfer" or "none"), ordered by head_dim, group, heads; refused: [(model, why)].
    quick: only QUICK_MODELS' configs; only: [(hq, hkv, d)] keeps those (and adds any not in the zoo, as
    "(not in the zoo)"), which overrides quick."""
    from fi_backend.models import ZOO, check
    by, refused = {}, []
    for m in ZOO:
        ok, why = check(m)
        if not ok:
            refused.append((m.name, why))
            continue
        by.setdefault((m.num_qo_heads, m.num_kv_heads, m.head_dim), []).append(m.name)
    if only is not None:
        keys = list(only)
    elif quick:
        keys = [k for k, names in by.items() if any(n in QUICK_MODELS for n in names)]
    else:
        keys = list(by)
    keys = sorted(set(keys), key=lambda k: (k[2], k[0] // k[1], k[0]))
    configs = []
    for hq, hkv, d in keys:
        configs.append({"num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "group": hq // hkv,
                        "config": config_key(hq, hkv, d), "models": by.get((hq, hkv, d), ["(not in the zoo)"]),
                        "anchor": "flashinfer" if fi_supports(d, fi_head_dims) else "none"})
    return configs, refused


def prefill_configs(only=None, extra=None):
    """PREFILL_CONFIGS as dicts, filtered by `only` [(hq, hkv, d)] when given; `extra` [(hq, hkv, d)] replaces the
    list (labels "group g")."""
    base = PREFILL_CONFIGS
    if extra:
        labels = {(hq, hkv, d): label for hq, hkv, d, label in PREFILL_CONFIGS}
        base = tuple((hq, hkv, d, labels.get((hq, hkv, d), f"group {hq // hkv}")) for hq, hkv, d in extra)
    out = []
    for hq, hkv, d, label in base:
        if only is not None and (hq, hkv, d) not in only:
            continue
        out.append({"num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "group": hq // hkv,
                    "config": config_key(hq, hkv, d), "label": label})
    return out


def decode_kv_bytes(batch: int, kv_len: int, hkv: int, d: int, element_bytes: int = 2) -> int:
    return batch * kv_len * hkv * d * 2 * element_bytes


def parse_tunings(text):
    """--prefill-tunings: a JSON list of non-empty dicts (None or empty text: [])."""
    if not text:
        return []
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--prefill-tunings: not JSON ({e})") from None
    if not isinstance(val, list) or not all(isinstance(t, dict) and t for t in val):
        raise ValueError(f"--prefill-tunings: a JSON list of non-empty objects, got {text!r}")
    return val


def round_ratio(anchor_rounds, ours_rounds):
    """Median over rounds of anchor time / our time (> 1: ours faster); None when a side has no figures."""
    pairs = [(a, o) for a, o in zip(anchor_rounds or [], ours_rounds or []) if a and o]
    if not pairs:
        return None
    return statistics.median(a / o for a, o in pairs)


def add_group_ratios(rows):
    """Each prefill row's ours TFLOP/s over group 4's (32/8 heads) of the same shape: at the same head_dim when
    that row exists, else at head_dim 128 (named in group4_ref). Bars only at head_dim 128 (not on group 4)."""
    ref = {}
    causal = [r for r in rows if r.get("mask", "causal") == "causal"]   # the group bars are on causal rows
    for r in causal:
        if r["num_qo_heads"] == 32 and r["num_kv_heads"] == 8 and r.get("ours_tflops"):
            ref[(r["batch"], r["seq_len"], r["head_dim"])] = r["ours_tflops"]
    for r in causal:
        shape = (r["batch"], r["seq_len"])
        d = r["head_dim"] if shape + (r["head_dim"],) in ref else 128
        g4 = ref.get(shape + (d,))
        r["group4_ref"] = config_key(32, 8, d) if g4 else None
        r["over_group4"] = r["ours_tflops"] / g4 if g4 and r.get("ours_tflops") else None
        is_g4 = r["num_qo_heads"] == 32 and r["num_kv_heads"] == 8
        if r["head_dim"] == 128 and not is_g4 and r["over_group4"] is not None:
            r["bar_group4_met"] = r["over_group4"] >= BARS["prefill_over_group4_min"]
        else:
            r.pop("bar_group4_met", None)
    return rows


def estimate(a) -> dict:
    """Seconds the run should take on an H100 (perf.kernels' per-cell model): {"timing_s", "jit_s" (FlashInfer's
    JIT builds when its cache is cold), "total_s"}."""
    from perf import kernels as K
    total, jit = 0.0, 0.0
    if "decode" in a.section_list:
        configs, _ = decode_configs(parse_configs(a.configs), a.quick, a.fi_head_dims)
        cells = parse_shapes(a.cells) if a.cells else list(QUICK_CELLS if a.quick else DECODE_CELLS)
        pages = parse_ints(a.pages) if a.pages else list(PAGE_SIZES)
        for c in configs:
            anchored = c["anchor"] == "flashinfer" and not a.no_flashinfer
            jit += K.EST_JIT_S["flashinfer_decode"] / 2 if anchored else 0.0   # one wrapper kind a config
            for page in pages:
                for b, L in cells:
                    cell = {"section": "decode", "kv_dtype": "bf16", "kv_lens": [L] * b, "page_size": page,
                            "num_qo_heads": c["num_qo_heads"], "num_kv_heads": c["num_kv_heads"],
                            "head_dim": c["head_dim"]}
                    total += K.estimate_cell_s(cell, a.rounds, a.rep, 1 + anchored, flex=False)
    if "prefill" in a.section_list:
        shapes = parse_shapes(a.prefill_shapes) if a.prefill_shapes else list(PREFILL_SHAPES)
        for c in prefill_configs(parse_configs(a.configs), parse_configs(a.prefill_configs)):
            impls = (1 + (not a.no_flashinfer and fi_supports(c["head_dim"], a.fi_head_dims)) * len(a.fi_prefill_list)
                     + (not a.no_vllm))
            for b, s in shapes:
                cell = {"section": "prefill", "variant": "causal", "batch": b, "seq_len": s,
                        "num_qo_heads": c["num_qo_heads"], "num_kv_heads": c["num_kv_heads"], "head_dim": c["head_dim"]}
                total += K.estimate_cell_s(cell, a.rounds, a.rep, impls, flex=False) * len(a.prefill_mask_list)
        jit += 0.0 if a.no_flashinfer else K.EST_JIT_S["flashinfer_fa2"] * len(a.fi_prefill_list)
    return {"timing_s": total, "jit_s": jit, "total_s": total + jit}


def decode_row_key(r):
    return (r["num_qo_heads"], r["num_kv_heads"], r["head_dim"], r["page_size"], r["batch"], r["kv_len"])


def prefill_row_key(r):
    return (r["num_qo_heads"], r["num_kv_heads"], r["head_dim"], r["batch"], r["seq_len"], r.get("mask", "causal"))


def merge_results(old: dict, new: dict) -> dict:
    """new's rows over old's (decode keyed by heads, head_dim, page, batch, KV; prefill by heads, head_dim,
    batch, length), the rest of new winning; summaries recomputed."""
    out = dict(old)
    out.update({k: v for k, v in new.items() if k not in SECTIONS})
    for sec, key in (("decode", decode_row_key), ("prefill", prefill_row_key)):
        if sec not in new:
            continue
        if sec not in old:
            out[sec] = new[sec]
            continue
        fresh = {key(r) for r in new[sec]["rows"]}
        rows = [r for r in old[sec]["rows"] if key(r) not in fresh] + new[sec]["rows"]
        merged = {**old[sec], **new[sec], "rows": rows}
        if sec == "decode":
            rows.sort(key=lambda r: (r["head_dim"], r["num_qo_heads"] // r["num_kv_heads"], r["num_qo_heads"],
                                     r["page_size"], r["batch"], r["kv_len"]))
            merged["configs"] = {**old[sec].get("configs", {}), **new[sec].get("configs", {})}
        else:
            add_group_ratios(rows)
        out[sec] = merged
    summarize(out)
    return out


def summarize(results: dict) -> dict:
    """Each section's bar summary, from its rows (in place; returns results)."""
    if "decode" in results:
        rows = results["decode"]["rows"]
        ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
        below = [f"{r['config']} page {r['page_size']} {r['batch']}x{r['kv_len']}: {r['ratio']:.3f}"
                 for r in rows if r.get("ratio") is not None and r["ratio"] < BARS["decode_ratio_min"]]
        results["decode"]["summary"] = {
            "cells": len(rows), "cells_with_anchor": len(ratios), "min_ratio": min(ratios) if ratios else None,
            "median_ratio": statistics.median(ratios) if ratios else None, "cells_below_bar": below,
            "bar": f"ratio (FlashInfer us / ours us) >= {BARS['decode_ratio_min']} in every cell",
            "bar_met": (not below) if ratios else None}
    if "prefill" in results:
        rows = results["prefill"]["rows"]
        fails = []
        for r in rows:
            tag = f"{r['config']} {r['batch']}x{r['seq_len']} {r.get('mask', 'causal')}"
            if r.get("bar_group4_met") is False:
                fails.append(f"{tag}: {r['over_group4']:.3f} of group 4")
            if r.get("bar_fi_fa2_met") is False:
                fails.append(f"{tag}: {r['ratio_fi_fa2']:.3f}x FlashInfer FA2")
            if r.get("bar_vllm_fa3_met") is False or r.get("bar_fa3_class_met") is False:
                fails.append(f"{tag}: {r['ratio_vllm_fa3']:.3f} of vLLM FA3")
        results["prefill"]["summary"] = {
            "rows": len(rows), "bars_missed": fails,
            "bar": (f"head_dim 128: >= {BARS['prefill_over_group4_min']} of group 4's TFLOP/s and >= "
                    f"{BARS['prefill_over_fi_fa2_min']}x FlashInfer FA2; head_dim 96: >= "
                    f"{BARS['prefill_d96_over_vllm_fa3_min']} of vLLM FA3's TFLOP/s (when importable); issue 30, both "
                    f"masks: ours / vLLM FA3 >= {BARS['prefill_over_vllm_fa3_min']} by head_dim")}
    return results


# ------------------------------------------------------------------------------------------------ decode (GPU)

class DecodeCase(Case):
    """perf.decode.Case with the zoo config's heads and head_dim, keeping the block table on the host too (the
    float32 reference reads it)."""

    def __init__(self, hq, hkv, d, kv_lens, page_size, sets=None, seed=0, device=None):
        super().__init__(kv_lens, page_size, sets, seed, hq=hq, hkv=hkv, d=d, device=device or DEVICE)
        self.blocks = (self.kv_lens + page_size - 1) // page_size
        self.table_cpu = self.block_table.cpu()


def ours_decode(case: DecodeCase):
    """(fn, out, run): our decode kernel on the case (perf.decode.ours with the case's heads); run(i) on set i."""
    from fi_backend import formats
    from fi_backend.workspace import Workspace
    from fi_backend.wrappers import BatchAttention
    num_ctas = BatchAttention.recommended_num_ctas("cuda", case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=DTYPE)
    tile_q = BatchAttention.query_tile_rows(case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=DTYPE)
    ws = Workspace("cuda", max_requests=case.B, max_tokens=case.B, num_ctas=num_ctas, max_tile_q=max(16, tile_q),
                   num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d)
    attn = BatchAttention(ws, case.hq, case.hkv, case.d, q_dtype=DTYPE, kv_dtype=DTYPE, page_size=case.page)
    bsr = formats.from_block_table(case.block_table, case.kv_lens.cuda(), case.qo_indptr.cuda(), case.page,
                                   num_kv_blocks=case.num_pages)
    attn.plan(case.qo_indptr, case.kv_lens, bsr)
    out = torch.empty_like(case.q)
    kv = case.kv_pairs

    def run(i):
        attn.run(case.q, kv[i], out=out)
    fn = rotating(run, case.sets)
    fn.num_ctas = num_ctas
    fn.ws = ws
    return fn, out, run


class FlashInferDecode:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True), NHD, one wrapper re-planned per
    case; the first plan + run + synchronise of each head configuration (its JIT build when cold) is timed."""

    def __init__(self):
        import flashinfer
        self.buf = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.buf, "NHD", use_tensor_cores=True)
        self.first_call_s = {}

    def fn(self, case: DecodeCase):
        t0 = time.perf_counter()
        self.w.plan(case.indptr, case.indices, case.last_page_len, case.hq, case.hkv, case.d, case.page,
                    q_data_type=DTYPE, kv_data_type=DTYPE)
        out = torch.empty_like(case.q)
        w, caches = self.w, case.caches

        def run(i):
            w.run(case.q, caches[i], out=out)
        key = config_key(case.hq, case.hkv, case.d)
        if key not in self.first_call_s:
            run(0)
            torch.cuda.synchronize()
            self.first_call_s[key] = time.perf_counter() - t0
            log(f"  flashinfer decode {key}: first plan + run {self.first_call_s[key]:.1f} s (JIT build if cold)")
        return rotating(run, case.sets), out, run


def decode_reference(case: DecodeCase, req: int, set_index: int = 0) -> torch.Tensor:
    """float32 attention of request `req`'s query over its pages in set `set_index`: [Hq, D]."""
    L = int(case.kv_lens[req])
    c = case.caches[set_index]
    pages = case.table_cpu[req, :int(case.blocks[req])].long().to(c.device)
    k = c[pages, 0].reshape(-1, case.hkv, case.d)[:L].float()
    v = c[pages, 1].reshape(-1, case.hkv, case.d)[:L].float()
    g = case.hq // case.hkv
    q = case.q[req].float().view(case.hkv, g, case.d)
    logits = torch.einsum("hgd,lhd->hgl", q, k) / math.sqrt(case.d)
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hgl,lhd->hgd", p, v).reshape(case.hq, case.d)


def _check(label, stats):
    stats = dict(stats)
    stats["ok"] = bool(stats["rel_diff"] < MAX_REL_DIFF)
    if not stats["ok"]:
        _failures.append(f"{label}: relative difference {stats['rel_diff']:.3e} "
                         f"(max |diff| {stats['max_abs_diff']:.3e})")
        log(f"MISMATCH {_failures[-1]}")
    return stats


def decode_cell(a, cfg, page, b, L, fi, info):
    """(row, anchored): one decode cell, ours and (fi not None) FlashInfer in alternating rounds; anchored False
    when FlashInfer failed here (info records why; the caller drops the anchor for the config's other cells)."""
    from perf.common import diff_stats, time_rounds
    hq, hkv, d, key = cfg["num_qo_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["config"]
    case = DecodeCase(hq, hkv, d, [L] * b, page, seed=b * 7919 + L)
    fn, out, run = ours_decode(case)
    r = {"config": key, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "group": hq // hkv,
         "models": cfg["models"], "page_size": page, "batch": b, "kv_len": L, "sets": case.sets,
         "kv_bytes": case.kv_bytes, "bytes": case.bytes, "num_ctas": fn.num_ctas, "rounds": a.rounds}
    run(0)
    ours0 = out.clone()
    label = f"decode {key} page {page} {b}x{L}"
    checks = {}
    for req in sorted({0, b - 1}):
        checks[f"ref_req{req}"] = _check(f"{label} ours vs reference req {req}",
                                         diff_stats(ours0[req], decode_reference(case, req)))
    fns = {"ours": fn}
    anchored = fi is not None
    if anchored:
        try:
            ffn, fout, frun = fi.fn(case)
            frun(0)
            torch.cuda.synchronize()
            checks["fi"] = _check(f"{label} ours vs FlashInfer", diff_stats(ours0, fout))
            fns["fi"] = ffn
        except Exception as e:  # an anchor failing (its JIT build, a shape) is recorded, not fatal
            info["anchor_error"] = f"{type(e).__name__}: {e}"
            info["anchor"] = "none (failed)"
            log(f"  FlashInfer failed on {label}, anchor dropped for this config: {info['anchor_error']}")
            anchored = False
    r["checks"] = checks
    times = time_rounds(fns, a.rounds, a.rep)
    r["ours_us_rounds"] = times["ours"]
    r["ours_us"] = statistics.median(times["ours"])
    r["ours_gbps"] = case.bytes / (r["ours_us"] * 1e-6) / 1e9
    msg = (f"  decode {key} page {page:3d} {b:3d}x{L:5d}: ours {r['ours_us']:8.1f} us "
           f"({r['ours_gbps']:6.0f} GB/s, {case.sets} sets)")
    if "fi" in times:
        r["fi_us_rounds"] = times["fi"]
        r["fi_us"] = statistics.median(times["fi"])
        r["ratio_rounds"] = [f / o for f, o in zip(times["fi"], times["ours"])]
        r["ratio"] = round_ratio(times["fi"], times["ours"])
        r["bar_met"] = r["ratio"] >= BARS["decode_ratio_min"]
        msg += (f"  FI {r['fi_us']:8.1f} us  ratio {r['ratio']:.3f}"
                + ("" if r["bar_met"] else f"  BELOW {BARS['decode_ratio_min']}"))
    else:
        r["anchor"] = "none"
    log(msg)
    return r, anchored


def decode_section(a, with_fi, fi_reason) -> dict:
    from perf.decode import MAX_SET_BYTES
    only = parse_configs(a.configs)
    configs, refused = decode_configs(only, a.quick, a.fi_head_dims)
    cells = parse_shapes(a.cells) if a.cells else list(QUICK_CELLS if a.quick else DECODE_CELLS)
    pages = parse_ints(a.pages) if a.pages else list(PAGE_SIZES)
    fi, fi_error = None, None
    if with_fi and any(c["anchor"] == "flashinfer" for c in configs):
        try:
            fi = FlashInferDecode()
        except Exception as e:
            fi_error = f"{type(e).__name__}: {e}"
            log(f"FlashInfer decode wrapper unavailable ({fi_error}): ours only")
    rows, cfg_info, errors = [], {}, []
    n_cells = len(configs) * len(pages) * len(cells)
    done = 0
    log(f"== decode: {len(configs)} head configs x pages {pages} x cells {cells} = {n_cells} cells, "
        f"{a.rounds} rounds")
    for ci, cfg in enumerate(configs):
        hq, hkv, d, key = cfg["num_qo_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["config"]
        anchored = fi is not None and cfg["anchor"] == "flashinfer"
        none_why = f"head_dim {d} has no FlashInfer kernel" if cfg["anchor"] == "none" else fi_reason or fi_error
        why = "" if anchored else f" (anchor none: {none_why})"
        log(f"decode config [{ci + 1}/{len(configs)}] {key} group {cfg['group']} ({', '.join(cfg['models'])})"
            + (": FlashInfer JIT-compiles a new head config on first use (~26 s when cold)" if anchored else why))
        info = {"models": cfg["models"], "anchor": "flashinfer tensor-core decode" if anchored else "none"}
        t_cfg = time.perf_counter()
        for page in pages:
            for b, L in cells:
                done += 1
                kv_bytes = decode_kv_bytes(b, L, hkv, d)
                if kv_bytes > MAX_SET_BYTES:
                    log(f"  skip {key} page {page} {b}x{L}: KV {kv_bytes / 2**30:.1f} GiB over the limit")
                    continue
                try:
                    r, anchored = decode_cell(a, cfg, page, b, L, fi if anchored else None, info)
                except Exception as e:   # recorded (the run fails at the end), the other cells still run
                    _record_error(errors, f"decode {key} page {page} {b}x{L}", e, config=key, page_size=page,
                                  batch=b, kv_len=L)
                    torch.cuda.empty_cache()
                    continue
                r["cell"] = f"{done}/{n_cells}"
                rows.append(r)
                torch.cuda.empty_cache()
        info["seconds"] = time.perf_counter() - t_cfg
        if fi is not None and key in fi.first_call_s:
            info["fi_first_call_s"] = fi.first_call_s[key]
        cfg_info[key] = info
    import_note = {}
    if with_fi:
        import flashinfer
        import_note["flashinfer"] = flashinfer.__version__
    return {**_stamp(), **import_note,
            "anchor": ("FlashInfer BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True), NHD, same q and pages; "
                       f"head_dim {'/'.join(map(str, a.fi_head_dims))} only" if with_fi else
                       f"none ({fi_reason})"),
            "dtype": "bf16 q and KV", "kv": "pages a random permutation of the pool; KV sets rotated past L2 "
                                           "(perf.decode.L2_ROTATE_BYTES between two reads of one set)",
            "ratio": "FlashInfer us / ours us, median of the rounds' ratios (> 1: ours faster)",
            "pages": pages, "cells": cells, "refused_models": refused, "configs": cfg_info, "errors": errors,
            "rows": rows}


# ------------------------------------------------------------------------------------------------ prefill (GPU)

def _record_error(errors: list, what: str, e: Exception, **cell) -> None:
    """A cell that raised: logged, in the section's errors (with its coordinates) and the run's failures (exit 1)."""
    _failures.append(f"{what}: {type(e).__name__}: {e}")
    log(f"  ERROR {_failures[-1]}")
    errors.append({**cell, "error": f"{type(e).__name__}: {e}"})


def sdpa_reference_check(case, out, label, causal=True) -> dict:
    """ours' request 0 against torch SDPA (bf16) on the same q / k / v."""
    from perf.common import diff_stats
    s, g = case.seq_len, case.hq // case.hkv
    q = case.q[:s].transpose(0, 1).unsqueeze(0)
    k = case.k[:s].repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
    v = case.v[:s].repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)[0].transpose(0, 1)
    return _check(label, diff_stats(out[:s], ref))


def prefill_cell(a, cfg, b, s, fis: dict, vfunc, fi_broken: dict, mask: str = "causal") -> dict:
    """One prefill row: ours, FlashInfer's ragged wrappers (fis: backend -> FlashInferRagged; head_dim in
    --fi-head-dims and not broken) and vLLM FA3 (vfunc not None) in alternating rounds on the same q / k / v, with
    the mask (causal or full). fi_broken: (backend, head_dim) -> why it failed there (filled here; a failed JIT
    build is not retried)."""
    from perf.common import diff_stats, time_rounds
    from fi_backend import env
    from perf.prefill import Case, Paged, attention_flops, ours_fn, tflops, unmasked_pairs, vllm_fn, vllm_paged_fn
    hq, hkv, d, key = cfg["num_qo_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["config"]
    causal = mask == "causal"
    label = f"prefill {key} {b}x{s} {mask}"
    case = Case(b, s, hq, hkv, d, seed=s + 31 * hq + hkv + d)
    flops = attention_flops(b * unmasked_pairs(s, s, causal=causal), hq, d)
    # --prefill-page P: ours reads the same K / V from pages of P tokens in random order (an engine's cache), so
    # the prefill family's CuTe member runs where it applies; then the tile family alone too (ours_family)
    paged = Paged(case, a.prefill_page) if getattr(a, "prefill_page", 0) else None
    fn, out, info = ours_fn(case, paged=paged, causal=causal)
    fn()
    torch.cuda.synchronize()
    r = {"config": key, "label": cfg["label"], **case.shape(), "mask": mask, "group": hq // hkv, "flops": flops,
         "num_ctas": info["num_ctas"], "rows_per_tile": info["rows_per_tile"], "rounds": a.rounds,
         "page_size": paged.page_size if paged else 0, "cute_step": info["cute_step"],
         "cute_unsupported": info["cute_unsupported"]}
    checks = {"sdpa_req0": sdpa_reference_check(case, out, f"{label} ours vs SDPA req 0", causal)}
    fns = {"ours": fn}
    if info["cute_step"]:
        with env.setting(env.PREFILL_CUTE, "0"):
            ffn, fout, _ = ours_fn(case, paged=paged, causal=causal)
        ffn()
        torch.cuda.synchronize()
        checks["ours_family"] = _check(f"{label} ours vs the tile family", diff_stats(out, fout))
        fns["ours_family"] = ffn
    for backend, fi in fis.items():
        k = f"fi_{backend}"
        if not fi_supports(d, a.fi_head_dims) or (backend, d) in fi_broken:
            continue
        try:
            ffn, fout = fi.fn(case, causal=causal)
            ffn()
            torch.cuda.synchronize()
            checks[k] = _check(f"{label} ours vs FlashInfer {backend}", diff_stats(out, fout))
            fns[k] = ffn
        except Exception as e:
            fi_broken[(backend, d)] = r[f"{k}_error"] = f"{type(e).__name__}: {e}"
            log(f"  FlashInfer {backend} failed on {label} (dropped at head_dim {d}): {r[f'{k}_error']}")
    if vfunc is not None:
        try:
            vfn, vout = vllm_fn(vfunc, case, causal=causal)
            vfn()
            torch.cuda.synchronize()
            checks["vllm_fa3"] = _check(f"{label} ours vs vLLM FA3", diff_stats(out, vout))
            fns["vllm_fa3"] = vfn
            if paged is not None:   # the same pages as ours, through its block table (what vLLM serves with)
                vfn, vout = vllm_paged_fn(vfunc, case, paged, causal=causal)
                vfn()
                torch.cuda.synchronize()
                checks["vllm_fa3_paged"] = _check(f"{label} ours vs vLLM FA3 paged", diff_stats(out, vout))
                fns["vllm_fa3_paged"] = vfn
        except Exception as e:
            r["vllm_fa3_error"] = f"{type(e).__name__}: {e}"
            log(f"  vLLM FA3 failed on {label}: {r['vllm_fa3_error']}")
    for i, tuning in enumerate(getattr(a, "prefill_tuning_list", [])):   # other kernel shapes, same rounds
        k = f"ours_t{i}"
        try:
            tfn, tout, _ = ours_fn(case, tuning=tuning, causal=causal)
            tfn()
            torch.cuda.synchronize()
            checks[k] = _check(f"{label} ours vs tuning {tuning}", diff_stats(out, tout))
            fns[k] = tfn
            r[f"{k}_tuning"] = tuning
        except Exception as e:
            r[f"{k}_error"] = f"{type(e).__name__}: {e}"
            log(f"  tuning {tuning} failed on {label}: {r[f'{k}_error']}")
    r["checks"] = checks
    times = time_rounds(fns, a.rounds, a.rep)
    r["ours_us_rounds"] = times["ours"]
    r["ours_us"] = statistics.median(times["ours"])
    r["ours_tflops"] = tflops(flops, r["ours_us"])
    msg = f"  prefill {key:>10} {b}x{s}: ours {r['ours_us']:8.1f} us {r['ours_tflops']:5.0f} TF/s"
    for k in ("fi_fa2", "fi_fa3", "vllm_fa3", "vllm_fa3_paged", "ours_family"):
        if k not in times:
            continue
        r[f"{k}_us_rounds"] = times[k]
        r[f"{k}_us"] = statistics.median(times[k])
        r[f"{k}_tflops"] = tflops(flops, r[f"{k}_us"])
        r[f"ratio_{k}"] = round_ratio(times[k], times["ours"])   # ours' speed over the anchor's
        msg += f" | {k} {r[f'{k}_tflops']:5.0f} TF/s, ours x{r[f'ratio_{k}']:.3f}"
    for k in sorted(x for x in times if x.startswith("ours_t")):
        r[f"{k}_us"] = statistics.median(times[k])
        r[f"ratio_{k}"] = round_ratio(times["ours"], times[k])   # the tuning's speed over ours
        msg += f" | {k} {r[f'{k}_us']:8.1f} us, x{r[f'ratio_{k}']:.3f} of ours' speed"
    if r.get("ratio_fi_fa2") is not None and d == 128 and causal:
        r["bar_fi_fa2_met"] = r["ratio_fi_fa2"] >= BARS["prefill_over_fi_fa2_min"]
        msg += "" if r["bar_fi_fa2_met"] else f" BELOW {BARS['prefill_over_fi_fa2_min']}x FA2"
    if r.get("ratio_vllm_fa3") is not None and d == 96:
        r["bar_vllm_fa3_met"] = r["ratio_vllm_fa3"] >= BARS["prefill_d96_over_vllm_fa3_min"]
        msg += "" if r["bar_vllm_fa3_met"] else f" BELOW {BARS['prefill_d96_over_vllm_fa3_min']} of FA3"
    fa3_bar = BARS["prefill_over_vllm_fa3_min"].get(d)
    if r.get("ratio_vllm_fa3") is not None and fa3_bar is not None and hq in (32,) and hkv in (8, 32):
        r["bar_fa3_class_met"] = r["ratio_vllm_fa3"] >= fa3_bar
        msg += "" if r["bar_fa3_class_met"] else f" BELOW {fa3_bar}x FA3 (issue 30)"
    log(msg)
    return r


def prefill_section(a, with_fi, fi_reason) -> dict:
    from perf.prefill import FlashInferRagged, vllm_fa3
    only = parse_configs(a.configs)
    configs = prefill_configs(only, parse_configs(a.prefill_configs))
    shapes = parse_shapes(a.prefill_shapes) if a.prefill_shapes else list(PREFILL_SHAPES)
    fis, broken, fi_broken = {}, {}, {}
    if with_fi and any(fi_supports(c["head_dim"], a.fi_head_dims) for c in configs):
        for backend in a.fi_prefill_list:
            try:
                fis[backend] = FlashInferRagged(backend)
            except Exception as e:
                broken[f"fi_{backend}"] = f"{type(e).__name__}: {e}"
                log(f"FlashInfer {backend} ragged wrapper unavailable ({broken[f'fi_{backend}']}): no such anchor")
    vfunc, vllm_reason = (None, "skipped (--no-vllm)") if a.no_vllm else vllm_fa3()
    if vllm_reason:
        log(f"vLLM FA3 anchor unavailable: {vllm_reason}")
    rows, errors = [], []
    masks = a.prefill_mask_list
    n = len(configs) * len(shapes) * len(masks)
    log(f"== prefill: {len(configs)} head configs x shapes {shapes} x masks {masks} = {n} cells, {a.rounds} rounds")
    fi_announced = set()
    for (b, s) in shapes:
        for cfg in configs:
            for mask in masks:
                key, d = cfg["config"], cfg["head_dim"]
                jit = [f"FlashInfer {x} JIT-compiles head_dim {d} on first use (when cold)" for x in fis
                       if fi_supports(d, a.fi_head_dims) and (x, d, mask) not in fi_announced]
                fi_announced.update((x, d, mask) for x in fis)
                log(f"prefill [{len(rows) + len(errors) + 1}/{n}] {key} {cfg['label']} {b}x{s} {mask}"
                    + (": " + "; ".join(jit) if jit else ""))
                try:
                    rows.append(prefill_cell(a, cfg, b, s, fis, vfunc, fi_broken, mask))
                except Exception as e:   # recorded (the run fails at the end), the other cells still run
                    _record_error(errors, f"prefill {key} {b}x{s} {mask}", e, config=key, batch=b, seq_len=s,
                                  mask=mask)
                torch.cuda.empty_cache()
    add_group_ratios(rows)
    for r in rows:
        if r.get("over_group4") is not None:
            log(f"  prefill {r['config']:>10} {r['batch']}x{r['seq_len']}: {r['over_group4']:.3f} of group 4 "
                f"({r['group4_ref']})")
    fl = {}
    for backend, fi in fis.items():
        fl[f"fi_{backend}_first_call_s"] = fi.first_call_s
    ver = {}
    if with_fi:
        import flashinfer
        ver["flashinfer"] = flashinfer.__version__
    broken.update({f"fi_{x}_d{d}": why for (x, d), why in fi_broken.items()})
    return {**_stamp(), **ver, **fl, "vllm_fa3": "available" if vfunc else vllm_reason, "anchor_errors": broken,
            "errors": errors,
            "flops": "4 * h * d * causal pairs (perf.prefill.attention_flops / unmasked_pairs), h = query heads",
            "kv": (f"ours: pages of {a.prefill_page} tokens in random order (perf.prefill.Paged)" if a.prefill_page
                   else "ours: ragged (a ragged=True wrapper on formats.from_ragged's BSR, perf.prefill.ours_fn)")
                  + "; anchors: FlashInfer ragged wrappers, vLLM flash_attn_varlen_func(fa_version=3), ragged; with "
                    "pages, vLLM FA3 also on ours' pages through its block table (vllm_fa3_paged)",
            "ratio": "anchor us / ours us, median of the rounds' ratios (> 1: ours faster)",
            "anchor_fi": (f"FlashInfer BatchPrefillWithRaggedKVCacheWrapper backends {', '.join(fis) or 'none'}"
                          if with_fi else f"none ({fi_reason})"),
            "masks": list(masks), "shapes": shapes, "rows": rows}


# ------------------------------------------------------------------------------------------------ prebuild

def prebuild(decode_cfgs, prefill_cfgs, jobs=None, prefill_page=0) -> dict:
    """Our decode and prefill modules for the configs (the CuTe member's too: its ragged ones for prefill_page 0,
    else those for pages of prefill_page), built (or found cached) in parallel first."""
    from fi_backend import variants
    from perf.common import prebuild_specs
    return prebuild_specs([("decode", variants.DEFAULT, c["head_dim"], "bf16", c["group"]) for c in decode_cfgs]
                          + [("prefill", variants.DEFAULT, c["head_dim"], "bf16", c["group"]) for c in prefill_cfgs],
                          jobs, cute_pages=(prefill_page,))


# ------------------------------------------------------------------------------------------------ report

def _stamp() -> dict:
    import datetime
    return {"device": device_info(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit()}


def _f(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def write_report(json_path) -> Path:
    """perf/results/<name>.md: the tables of a results JSON (its figures; nothing recomputed but formatting)."""
    r = json.loads(Path(json_path).read_text())
    dev = r.get("device", {}).get("name", "?")
    lines = [f"# Model zoo head configurations, {dev}, {str(r.get('date', '?'))[:10]}, commit "
             f"{str(r.get('commit', '?'))[:12]}", "",
             "fi-backend against FlashInfer (and vLLM FA3 where importable), same inputs, same process, alternating "
             "rounds; each figure the median of the rounds' CUDA-event medians, each ratio the median of the rounds' "
             "ratios (anchor us / ours us, > 1: ours faster). Each section names its own date and commit.", ""]
    if "decode" in r:
        s = r["decode"]
        sm = s.get("summary", {})
        lines += [f"## Decode ({str(s.get('date', '?'))[:10]}, commit {str(s.get('commit', '?'))[:12]})", "",
                  f"{s.get('dtype')}; {s.get('kv')}. Anchor: {s.get('anchor')}. Bar: {sm.get('bar')}: "
                  f"{'met' if sm.get('bar_met') else 'NOT met' if sm.get('bar_met') is False else 'no anchor'}; "
                  f"min ratio {_f(sm.get('min_ratio'), '.3f')}, median {_f(sm.get('median_ratio'), '.3f')} over "
                  f"{sm.get('cells_with_anchor')} anchored cells of {sm.get('cells')}.", ""]
        if sm.get("cells_below_bar"):
            lines += ["Below the bar: " + "; ".join(sm["cells_below_bar"]) + ".", ""]
        lines += ["| heads q/kv | D | group | models | page | batch x KV | ours us | ours GB/s | FI us | FI / ours | "
                  "rel diff vs FI |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in s["rows"]:
            models = ", ".join(x["models"][:3]) + (f" +{len(x['models']) - 3}" if len(x["models"]) > 3 else "")
            lines.append(f"| {x['num_qo_heads']}/{x['num_kv_heads']} | {x['head_dim']} | {x['group']} | {models} | "
                         f"{x['page_size']} | {x['batch']}x{x['kv_len']} | {_f(x['ours_us'])} | "
                         f"{_f(x.get('ours_gbps'), '.0f')} | {_f(x.get('fi_us'))} | {_f(x.get('ratio'), '.3f')} | "
                         f"{_f(x.get('checks', {}).get('fi', {}).get('rel_diff'), '.1e')} |")
        fc = {k: v.get("fi_first_call_s") for k, v in s.get("configs", {}).items() if v.get("fi_first_call_s")}
        if fc:
            lines += ["", "FlashInfer first plan + run per head config (s, JIT build when cold): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in fc.items()) + "."]
        lines.append("")
    if "prefill" in r:
        s = r["prefill"]
        sm = s.get("summary", {})
        lines += [f"## Prefill ({str(s.get('date', '?'))[:10]}, commit {str(s.get('commit', '?'))[:12]})", "",
                  f"bf16, masks {'/'.join(s.get('masks', ['causal']))}. TFLOP/s = {s.get('flops')}. KV: {s.get('kv')}. "
                  f"vLLM FA3: {s.get('vllm_fa3')}. FlashInfer first plan + run: FA2 "
                  f"{_f(s.get('fi_fa2_first_call_s'))} s, FA3 {_f(s.get('fi_fa3_first_call_s'))} s. "
                  f"ours' family: the tile family alone where the CuTe member ran. Bar: {sm.get('bar')}"
                  + (": missed " + "; ".join(sm["bars_missed"]) if sm.get("bars_missed") else ": met where measured")
                  + ".", "",
                  "| config | heads q/kv | D | batch x len | mask | ours us | ours TF/s | CuTe member | ours / family | "
                  "over group 4 | FI FA2 TF/s | ours / FA2 | FI FA3 TF/s | ours / FI FA3 | vLLM FA3 TF/s | ours / FA3 | "
                  "vLLM FA3 paged TF/s | ours / FA3 paged | rel diff vs SDPA |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in s["rows"]:
            lines.append(f"| {x['label']} | {x['num_qo_heads']}/{x['num_kv_heads']} | {x['head_dim']} | "
                         f"{x['batch']}x{x['seq_len']} | {x.get('mask', 'causal')} | {_f(x['ours_us'])} | "
                         f"{_f(x['ours_tflops'], '.0f')} | {'yes' if x.get('cute_step') else 'no'} | "
                         f"{_f(x.get('ratio_ours_family'), '.3f')} | "
                         f"{_f(x.get('over_group4'), '.3f')} | {_f(x.get('fi_fa2_tflops'), '.0f')} | "
                         f"{_f(x.get('ratio_fi_fa2'), '.3f')} | {_f(x.get('fi_fa3_tflops'), '.0f')} | "
                         f"{_f(x.get('ratio_fi_fa3'), '.3f')} | {_f(x.get('vllm_fa3_tflops'), '.0f')} | "
                         f"{_f(x.get('ratio_vllm_fa3'), '.3f')} | {_f(x.get('vllm_fa3_paged_tflops'), '.0f')} | "
                         f"{_f(x.get('ratio_vllm_fa3_paged'), '.3f')} | "
                         f"{_f(x.get('checks', {}).get('sdpa_req0', {}).get('rel_diff'), '.1e')} |")
        lines.append("")
    out = Path(json_path).with_suffix(".md")
    out.write_text("\n".join(lines))
    log(f"wrote {out}")
    return out


# ------------------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf zoo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"decode: the configs of {', '.join(QUICK_MODELS)} at 64x2047 only; 3 rounds, 50 repeats")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--name", default="zoo_h100", help="results name: perf/results/<name>.json (default zoo_h100)")
    ap.add_argument("--no-flashinfer", action="store_true", help="time ours only")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's FA3 prefill anchor")
    ap.add_argument("--configs", help="only these head configs, query_heads/kv_heads/head_dim comma-separated "
                                      "(e.g. 32/8/128,28/4/128); applies to both sections; overrides --quick's list")
    ap.add_argument("--prefill-configs", help="prefill: these head configs instead of the default list")
    ap.add_argument("--cells", help="decode batch x KV length, comma-separated (default 7x1000,64x2047,128x4099; "
                                    "--quick 64x2047)")
    ap.add_argument("--pages", help="decode page sizes, comma-separated (default 1,16,64,128)")
    ap.add_argument("--prefill-tunings", metavar="JSON",
                    help='prefill: a JSON list of kernel-shape overrides (e.g. \'[{"warps": 12, "mfrags": 1, "producer": 1}]\'), '
                         "each timed beside ours in the same rounds as ours_t<i> (ratio: its speed over ours)")
    ap.add_argument("--prefill-shapes", help="prefill batch x length, comma-separated (default 4x4096)")
    ap.add_argument("--prefill-masks", default="causal",
                    help=f"prefill masks, comma-separated, of {', '.join(PREFILL_MASKS)} (default causal)")
    ap.add_argument("--fi-prefill", default="fa2",
                    help=f"prefill: FlashInfer's ragged-wrapper backends to time, of {', '.join(FI_PREFILL_BACKENDS)} "
                         "(default fa2; fa3 JIT-compiles about 100 s a head_dim when cold)")
    ap.add_argument("--prefill-page", type=int, default=0, metavar="P",
                    help="prefill: ours reads K / V from pages of P tokens in random order (0: ragged, the default), "
                         "so the CuTe member runs where it applies; then the tile family alone too (ours_family) and "
                         "vLLM FA3 on the same pages (vllm_fa3_paged)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds per cell (default 5; --quick 3)")
    ap.add_argument("--rep", type=int, default=None, help="timed calls per figure at most (default 100; --quick 50)")
    ap.add_argument("--fi-head-dims", default=",".join(map(str, FI_HEAD_DIMS)),
                    help="head sizes to try FlashInfer at (default 64,128,256)")
    ap.add_argument("--no-prebuild", action="store_true", help="build our kernel modules lazily, one at a time")
    ap.add_argument("--jobs", type=int, default=None, help="parallel module builds (default min(16, CPUs))")
    ap.add_argument("--merge", action="store_true",
                    help="add this run's rows to perf/results/<name>.json instead of replacing it")
    ap.add_argument("--report", metavar="JSON", help="only write the markdown table of a results JSON")
    return ap


def _choices(flag, text, accepted):
    """A comma-separated option's values, each one of accepted (ValueError naming the flag otherwise)."""
    vals = [x for x in text.split(",") if x]
    bad = [x for x in vals if x not in accepted]
    if bad or not vals:
        raise ValueError(f"{flag}: {bad or 'none given'}; accepted: {', '.join(accepted)}")
    return vals


def resolve_args(argv=None):
    """Parsed and checked arguments, with the --quick defaults filled in (CPU-testable)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    a.section_list = [x for x in a.sections.split(",") if x]
    bad = [x for x in a.section_list if x not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; accepted: {', '.join(SECTIONS)}")
    try:
        parse_configs(a.configs)
        parse_configs(a.prefill_configs)
        if a.cells:
            parse_shapes(a.cells)
        if a.prefill_shapes:
            parse_shapes(a.prefill_shapes)
        a.fi_head_dims = tuple(parse_ints(a.fi_head_dims))
        a.prefill_tuning_list = parse_tunings(a.prefill_tunings)
        a.prefill_mask_list = _choices("--prefill-masks", a.prefill_masks, PREFILL_MASKS)
        a.fi_prefill_list = _choices("--fi-prefill", a.fi_prefill, FI_PREFILL_BACKENDS)
        if a.pages:
            parse_ints(a.pages)
    except ValueError as e:
        ap.error(str(e))
    if a.rounds is None:
        a.rounds = 3 if a.quick else 5
    if a.rep is None:
        a.rep = 50 if a.quick else 100
    return a


def main(argv=None):
    a = resolve_args(argv)
    if a.report:
        write_report(a.report)
        return 0
    est = estimate(a)
    log(f"estimate: about {est['timing_s']:.0f} s of timing on an H100, plus up to {est['jit_s']:.0f} s of FlashInfer "
        f"JIT builds when its cache is cold ({est['total_s'] / 60:.1f} min in all)")
    t0 = time.perf_counter()
    with_fi, fi_reason = not a.no_flashinfer, "--no-flashinfer" if a.no_flashinfer else None
    if with_fi:
        try:
            import flashinfer
            log(f"flashinfer {flashinfer.__version__}")
        except Exception as e:
            with_fi, fi_reason = False, f"flashinfer not importable: {type(e).__name__}: {e}"
            log(f"{fi_reason}: timing ours only")
    results = {"device": device_info(), "bars": BARS, "quick": a.quick, "rounds": a.rounds, "rep": a.rep,
               "argv": sys.argv[1:] if argv is None else list(argv),
               "notes": [f"correctness: relative L2 difference < {MAX_REL_DIFF} against the anchor and a reference "
                         "(not a substitute for tests)"]}
    if not a.no_prebuild:
        dcfg = (decode_configs(parse_configs(a.configs), a.quick, a.fi_head_dims)[0]
                if "decode" in a.section_list else [])
        pcfg = (prefill_configs(parse_configs(a.configs), parse_configs(a.prefill_configs))
                if "prefill" in a.section_list else [])
        try:
            results["prebuild"] = prebuild(dcfg, pcfg, a.jobs, a.prefill_page)
        except Exception as e:   # the sections build lazily instead
            log(f"prebuild failed ({type(e).__name__}: {e}); modules build lazily")
            results["prebuild"] = {"error": f"{type(e).__name__}: {e}"}
    for name in a.section_list:
        runner = decode_section if name == "decode" else prefill_section
        results[name] = runner(a, with_fi, fi_reason)
    results["wall_s"] = time.perf_counter() - t0
    old_path = RESULTS / f"{a.name}.json"
    if a.merge and old_path.is_file():
        results = merge_results(json.loads(old_path.read_text()), results)
    else:
        summarize(results)
    path = write_result(a.name, results)
    md = write_report(path)
    if os.environ.get("OUT"):
        shutil.copy(md, Path(os.environ["OUT"], md.name))
    for sec in SECTIONS:
        if sec in results and sec in a.section_list:
            log(f"{sec}: {json.dumps(results[sec].get('summary'))}")
    log(f"total {results['wall_s']:.0f} s")
    if _failures:
        log("correctness checks failed:\n  " + "\n  ".join(_failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
