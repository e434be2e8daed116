"""Kernel benchmarks: fi-backend's decode, prefill, append and merge against FlashInfer 0.6.14, FlashAttention-3
(vLLM's) and FlexAttention, on the same inputs in the same process, in alternating rounds.

    python -m perf kernels [--quick] [--sections decode,prefill,append,merge] [--merge FILE] [--no-vllm] [--fa3]
                           [--fa3-member [JSON]]
                           [--estimate] [--name NAME] [--rounds N] [--rep N]

Sections (32 query heads, head_dim 128, bf16 unless a cell says otherwise):
  decode   one query row per request over a paged KV cache (pages a random permutation of the pool, KV sets rotated
           past the L2; perf.decode): 8 KV heads, batch x KV length at page 16, page 1, uneven batches (one 32k request
           among 63 of 512; 64 ShareGPT requests) and fp8 e4m3 KV. Anchors: FlashInfer's decode wrapper (per round
           the faster of tensor cores on and off), vLLM's FA3 (pages of 16 and more, bf16).
  prefill  causal prefill from scratch, this step's K/V ragged (perf.prefill.Case): 32 and 8 KV heads. Anchors:
           FlashInfer FA2 ragged wrapper, vLLM FA3 varlen, FlexAttention (torch.compile, block mask), FlashInfer FA3
           with --fa3 (its first call JIT-compiles for about 100 s). The full grid adds 16 heads at batch 16 (as
           AttentionGym): causal, and the variants soft-cap 30, ALiBi and sliding window 1024 against FlexAttention.
  append   a query chunk appended to a paged cache (page 16, bottom-right causal; perf.prefill.AppendCase), 8 KV heads.
           Anchors: FlashInfer FA2 paged prefill wrapper, vLLM FA3 with a block table.
  merge    merge_state of two attention states (32k rows) and merge_states of 8 (8k rows). Anchors: FlashInfer's
           merge_state / merge_states, the same math in PyTorch ops.

Timing: each cell builds ours and its anchors once, checks ours against each anchor's output (relative L2
difference < 2e-2, else the run exits 1 after writing its results), then times all of them once per round for
`rounds` rounds (perf.common.time_rounds: CUDA events, median of up to `rep` calls after a 200 ms warm-up). A
figure is the median of its rounds; a ratio (anchor us / ours us, > 1: ours faster) the median of the rounds'
ratios. Each cell has a primary anchor (FlashInfer; FlexAttention for the variants) that `python -m perf compare`
normalises by.

--fa3-member times ours with FlashAttention-3's consumer loop (PREFILL_FA3_TUNINGS) beside member 0 in the causal
prefill cells; with a JSON list of overrides of that tuning, one column each (ours_fa3_fa3_1 for {"fa3": 1}).

--quick is the small grid (about 3-4 minutes on an H100 with FlashInfer's JIT cache cold) that `perf compare`
checks within 2% before and after a change. --estimate prints the plan and its time estimate and exits (no GPU).
Results: perf/results/<name>.json, .md and .png (also under $OUT when set); FI_COMMIT names the commit where the
tree travels without .git. A full run takes more than one 10-minute GPU command: split it with --sections and
join the parts with --merge FILE (rows of FILE's other sections kept, this run's cells winning).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

from perf.common import RESULTS, log, write_result

SECTIONS = ("decode", "prefill", "append", "merge")
PRIMARY = {"decode": "flashinfer", "prefill": "flashinfer_fa2", "append": "flashinfer_fa2", "merge": "flashinfer"}
HQ, HKV, D = 32, 8, 128
VARIANT_HEADS, VARIANT_BATCH = 16, 16
FLEX_VARIANTS = ("soft_cap_30", "alibi", "sliding_window_1024")
DEFAULT_ROUNDS = {True: 5, False: 5}           # quick: the before / after bar needs the rounds more than the cells
DEFAULT_REP = {True: 50, False: 100}
# Rough H100 figures for the estimate only: copy-bound and tensor-core-bound rates, per-figure overheads, and the
# one-off costs (FlashInfer JIT builds when its cache is cold, a FlexAttention compile per cell).
EST_BYTES_PER_S = 2.6e12
EST_FLOPS_PER_S = {"prefill": 4.0e14, "append": 3.0e14}
EST_FIGURE_OVERHEAD_S = 0.3
EST_CELL_SETUP_S = 0.5
EST_FLEX_COMPILE_S = 12.0
EST_JIT_S = {"flashinfer_decode": 50.0, "flashinfer_fa2": 40.0, "flashinfer_paged": 40.0, "flashinfer_fa3": 100.0,
             "flashinfer_merge": 20.0}


# ------------------------------------------------------------------------------ grid (pure, tested on the CPU)

def _decode_cell(b, L, page=16, kv_dtype="bf16", name=None, kv_lens=None):
    cell = name or f"{b}x{L} p{page}" + ("" if kv_dtype == "bf16" else f" {kv_dtype}")
    return {"section": "decode", "cell": cell, "batch": b, "kv_len": L, "page_size": page, "kv_dtype": kv_dtype,
            "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "kv_lens": kv_lens or [L] * b}


def uneven_kv_lens(name: str) -> list:
    """The uneven decode batches: one 32k request among 63 of 512, or 64 ShareGPT requests each with its prompt
    plus a random part of its output cached."""
    if name == "skewed":
        return [32768] + [512] * 63
    if name == "sharegpt64":
        import random

        from perf.sharegpt import load_trace
        rng = random.Random(0)
        return [p + 1 + rng.randrange(o) for p, o in load_trace(64)]
    raise ValueError(f"uneven batch {name!r}: accepted skewed, sharegpt64")


def decode_grid(quick: bool) -> list:
    if quick:
        cells = [_decode_cell(b, L) for b in (1, 16, 64) for L in (1024, 4096)]
        return cells + [_decode_cell(64, 0, name="sharegpt64", kv_lens=uneven_kv_lens("sharegpt64"))]
    cells = [_decode_cell(b, L) for b in (1, 16, 64, 256) for L in (1024, 4096, 16384, 32768)]
    cells += [_decode_cell(64, 4096, page=1), _decode_cell(16, 16384, page=1)]
    cells += [_decode_cell(64, 0, name=n, kv_lens=uneven_kv_lens(n)) for n in ("skewed", "sharegpt64")]
    cells += [_decode_cell(64, L, kv_dtype="fp8_e4m3") for L in (4096, 16384)]
    return cells


def _prefill_cell(b, s, hq, hkv, variant="causal"):
    tag = f"{hq}/{hkv}" if variant == "causal" else variant
    return {"section": "prefill", "cell": f"{tag} {b}x{s}", "variant": variant, "batch": b, "seq_len": s,
            "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": D}


def prefill_grid(quick: bool) -> list:
    from perf.prefill import fit_batch
    if quick:
        return [_prefill_cell(16, 1024, HQ, HKV), _prefill_cell(4, 4096, HQ, HKV), _prefill_cell(4, 4096, HQ, HQ)]
    cells = [_prefill_cell(b, s, HQ, hkv) for hkv in (HQ, HKV) for b, s in ((16, 1024), (4, 4096), (1, 16384))]
    for v in ("causal",) + FLEX_VARIANTS:    # AttentionGym's shapes, as the FlexAttention baseline was measured
        for s in (1024, 4096):
            b = fit_batch(VARIANT_BATCH, s, VARIANT_HEADS, D)
            cells.append(_prefill_cell(b, s, VARIANT_HEADS, VARIANT_HEADS, v))
    return cells


def _append_cell(b, q_len, kv_len, page=16):
    return {"section": "append", "cell": f"{b}x{q_len}+{kv_len - q_len} p{page}", "batch": b, "q_len": q_len,
            "kv_len": kv_len, "page_size": page, "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D}


def append_grid(quick: bool) -> list:
    shapes = ((16, 128, 2048), (8, 512, 4096)) if quick else \
        ((16, 128, 2048), (8, 512, 4096), (4, 1024, 8192), (1, 2048, 16384))
    return [_append_cell(*s) for s in shapes]


def merge_grid(quick: bool) -> list:
    return [{"section": "merge", "cell": "merge_state 32768 rows", "op": "merge_state", "rows": 32768, "states": 2,
             "num_heads": 32, "head_dim": D},
            {"section": "merge", "cell": "merge_states S8 8192 rows", "op": "merge_states", "rows": 8192, "states": 8,
             "num_heads": 32, "head_dim": D}]


GRIDS = {"decode": decode_grid, "prefill": prefill_grid, "append": append_grid, "merge": merge_grid}


def grid(sections, quick: bool) -> list:
    return [c for s in sections for c in GRIDS[s](quick)]


def anchors_for(cell: dict, *, vllm: bool = True, fa3: bool = False) -> list:
    """The anchors a cell is timed against (before any turns out unavailable), the primary one first."""
    sec = cell["section"]
    if sec == "decode":
        fa3_ok = vllm and cell["page_size"] % 16 == 0 and cell["kv_dtype"] == "bf16"   # FA3 paged: pages of 16k
        return ["flashinfer"] + (["vllm_fa3"] if fa3_ok else [])
    if sec == "prefill":
        if cell["variant"] != "causal":
            return ["flex"]
        return ["flashinfer_fa2"] + (["flashinfer_fa3"] if fa3 else []) + (["vllm_fa3"] if vllm else []) + ["flex"]
    if sec == "append":
        return ["flashinfer_fa2"] + (["vllm_fa3"] if vllm else [])
    return ["flashinfer", "torch"]


def primary_anchor(cell: dict) -> str:
    return "flex" if cell["section"] == "prefill" and cell["variant"] != "causal" else PRIMARY[cell["section"]]


def cell_work(cell: dict) -> tuple:
    """(bytes, flops) one call of the cell moves and computes: every KV byte once plus q and o (decode, append),
    every input read once and every output written once (merge), attended (query, key) pairs (prefill, append)."""
    from perf.prefill import attention_flops, unmasked_pairs
    sec = cell["section"]
    if sec == "decode":
        el = 1 if cell["kv_dtype"] == "fp8_e4m3" else 2
        kv = sum(cell["kv_lens"]) * cell["num_kv_heads"] * cell["head_dim"] * 2 * el
        return kv + 2 * 2 * len(cell["kv_lens"]) * cell["num_qo_heads"] * cell["head_dim"], 0
    if sec == "merge":
        n, h, d, st = cell["rows"], cell["num_heads"], cell["head_dim"], cell["states"]
        return (st + 1) * n * h * (d * 2 + 4), 0
    if sec == "prefill":
        window = 1024 if cell["variant"] == "sliding_window_1024" else -1
        pairs = cell["batch"] * unmasked_pairs(cell["seq_len"], cell["seq_len"], window_left=window)
        kv = 2 * cell["batch"] * cell["seq_len"] * cell["num_kv_heads"] * cell["head_dim"] * 2
        return kv, attention_flops(pairs, cell["num_qo_heads"], cell["head_dim"])
    pairs = cell["batch"] * unmasked_pairs(cell["q_len"], cell["kv_len"])
    kv = 2 * cell["batch"] * cell["kv_len"] * cell["num_kv_heads"] * cell["head_dim"] * 2
    return kv, attention_flops(pairs, cell["num_qo_heads"], cell["head_dim"])


def estimate_call_us(cell: dict) -> float:
    """A rough H100 time of one call (copy- or tensor-core-bound, plus a launch's worth)."""
    nbytes, flops = cell_work(cell)
    t = nbytes / EST_BYTES_PER_S
    if flops:
        t = max(t, flops / EST_FLOPS_PER_S[cell["section"]])
    return t * 1e6 + 8.0


def estimate_cell_s(cell: dict, rounds: int, rep: int, impls: int, flex: bool | None = None) -> float:
    """Seconds for one cell: its set-up, a FlexAttention compile when flex is an anchor (flex None: as
    anchors_for says), and `impls` figures a round."""
    from perf.common import timed_reps
    call = estimate_call_us(cell)
    figure = EST_FIGURE_OVERHEAD_S + 2.5 * timed_reps(call, rep) * call * 1e-6   # spin cover + timed calls
    if flex is None:
        flex = "flex" in anchors_for(cell, vllm=False)
    return EST_CELL_SETUP_S + (EST_FLEX_COMPILE_S if flex else 0.0) + rounds * impls * figure


def one_off_jit(cells: list, *, fa3: bool = False) -> dict:
    """FlashInfer's JIT builds a cold cache pays once a process (seconds by wrapper kind)."""
    secs = {c["section"] for c in cells}
    out = {}
    if "decode" in secs:
        out["flashinfer_decode"] = EST_JIT_S["flashinfer_decode"]
    if "prefill" in secs:
        out["flashinfer_fa2"] = EST_JIT_S["flashinfer_fa2"]
        if fa3:
            out["flashinfer_fa3"] = EST_JIT_S["flashinfer_fa3"]
    if "append" in secs:
        out["flashinfer_paged"] = EST_JIT_S["flashinfer_paged"]
    if "merge" in secs:
        out["flashinfer_merge"] = EST_JIT_S["flashinfer_merge"]
    return out


def estimate(cells: list, rounds: int, rep: int, *, vllm: bool = True, fa3: bool = False) -> dict:
    """{"cells": [seconds per cell], "jit": {kind: s}, "total_s"}: what the run should take on an H100."""
    per = []
    for c in cells:
        impls = 1 + len(anchors_for(c, vllm=vllm, fa3=fa3)) + (1 if c["section"] == "decode" else 0)  # FI: 2 paths
        per.append(estimate_cell_s(c, rounds, rep, impls))
    jit = one_off_jit(cells, fa3=fa3)
    return {"cells": per, "jit": jit, "total_s": sum(per) + sum(jit.values())}


def modules_needed(cells: list) -> list:
    """(kernel, variant name, head_dim, kv dtype, group) of our modules the cells run (perf.common.prebuild_specs
    takes them with the variant objects)."""
    out = []
    for c in cells:
        g = c.get("num_qo_heads", 1) // c.get("num_kv_heads", 1)
        if c["section"] == "decode":
            key = ("decode", "default", c["head_dim"], c["kv_dtype"], g)
        elif c["section"] in ("prefill", "append"):
            key = ("prefill", c.get("variant", "causal"), c["head_dim"], "bf16", g)
        else:
            continue
        if key not in out:
            out.append(key)
    return out


def prebuild(cells: list) -> dict:
    from fi_backend import variants

    from perf.common import prebuild_specs
    from perf.prefill import flex_specs
    by_name = {name: spec[0] for name, spec in flex_specs(None).items()}
    by_name["default"] = variants.DEFAULT
    return prebuild_specs([(k, by_name[v], d, kv, g) for k, v, d, kv, g in modules_needed(cells)])


def device_tag(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100": the short name results are filed under."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name or "")
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", (name or "gpu").lower()).strip("_")


# ------------------------------------------------------------------------------ figures (pure, tested on the CPU)

def summarise(times: dict, combine: dict | None = None) -> tuple:
    """(us, ratios) from time_rounds' {label: [us per round]}: us[label] = median over rounds; an anchor combined
    from several labels (combine {"flashinfer": ["fi_tc", "fi_cuda"]}) takes each round's fastest; ratios[anchor]
    = median over rounds of anchor us / ours us (> 1: ours faster)."""
    rounds = dict(times)
    for name, parts in (combine or {}).items():
        have = [rounds.pop(p) for p in parts if p in rounds]
        if have:
            rounds[name] = [min(xs) for xs in zip(*have)]
    ours = rounds["ours"]
    us = {k: statistics.median(v) for k, v in rounds.items()}
    ratios = {k: statistics.median(a / o for a, o in zip(v, ours)) for k, v in rounds.items() if k != "ours"}
    return us, ratios, rounds


def merge_results(old: dict, new: dict) -> dict:
    """new's cells over old's, section by section (rows keyed by cell); old's sections that new did not run kept."""
    out = {**old, **{k: v for k, v in new.items() if k != "sections"}}
    sections = dict(old.get("sections", {}))
    for sec, body in new.get("sections", {}).items():
        if sec not in sections:
            sections[sec] = body
            continue
        fresh = {r["cell"] for r in body["rows"]}
        rows = [r for r in sections[sec]["rows"] if r["cell"] not in fresh] + body["rows"]
        sections[sec] = {**sections[sec], **body, "rows": rows}
    out["sections"] = {s: sections[s] for s in SECTIONS if s in sections}
    out["summary"] = summary(out["sections"])
    return out


def summary(sections: dict) -> dict:
    """Per section: cells, and the min / median ratio against each anchor."""
    out = {}
    for sec, body in sections.items():
        by = {}
        for r in body["rows"]:
            for k, v in r.get("ratios", {}).items():
                by.setdefault(k, []).append(v)
        out[sec] = {"cells": len(body["rows"]),
                    **{k: {"median_ratio": statistics.median(v), "min_ratio": min(v), "cells": len(v)}
                       for k, v in by.items()}}
    return out


def compare(before: dict, after: dict, tolerance: float = 0.02) -> dict:
    """Cell by cell: ours' time over the cell's primary anchor (both from the same run), after / before - 1
    (> 0: ours slower against the anchor); a cell without the same anchor on both sides compares ours' raw time.
    moved: the cells whose change exceeds the tolerance either way."""
    def cells(doc):
        return {(sec, r["cell"]): r for sec, body in doc.get("sections", {}).items() for r in body["rows"]}
    b, a = cells(before), cells(after)
    rows, moved = [], []
    for key in [k for k in b if k in a]:
        rb, ra = b[key], a[key]
        anchor = rb.get("anchor")
        if anchor and anchor == ra.get("anchor") and rb.get("ratio") and ra.get("ratio"):
            change, basis = rb["ratio"] / ra["ratio"] - 1, anchor
        else:
            change, basis = ra["us"]["ours"] / rb["us"]["ours"] - 1, "raw"
        row = {"section": key[0], "cell": key[1], "basis": basis, "change": change,
               "raw_change": ra["us"]["ours"] / rb["us"]["ours"] - 1,
               "before_ratio": rb.get("ratio"), "after_ratio": ra.get("ratio"), "moved": abs(change) > tolerance}
        rows.append(row)
        if row["moved"]:
            moved.append(row)
    missing = sorted(f"{s} {c}" for s, c in set(b) ^ set(a))
    return {"tolerance": tolerance, "rows": rows, "moved": moved, "missing": missing,
            "before": {k: before.get(k) for k in ("date", "commit")}, "after": {k: after.get(k) for k in ("date", "commit")}}


def compare_markdown(res: dict) -> str:
    lines = [f"Before {res['before'].get('commit', '?')} ({res['before'].get('date', '?')}), after "
             f"{res['after'].get('commit', '?')} ({res['after'].get('date', '?')}); tolerance {res['tolerance']:.1%} of "
             "ours' time over the cell's anchor (same run).", "",
             "| section | cell | basis | ratio before | ratio after | change vs anchor | raw change | moved |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['section']} | {r['cell']} | {r['basis']} | {_f(r['before_ratio'], '.3f')} | "
                     f"{_f(r['after_ratio'], '.3f')} | {r['change']:+.1%} | {r['raw_change']:+.1%} | "
                     f"{'MOVED' if r['moved'] else ''} |")
    if res["missing"]:
        lines += ["", "In one file only: " + "; ".join(res["missing"])]
    lines += ["", f"{len(res['moved'])} of {len(res['rows'])} cells moved more than {res['tolerance']:.1%}."]
    return "\n".join(lines) + "\n"


def _f(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


ANCHOR_LABELS = {"ours_fa3": "ours fa3", "flashinfer": "FlashInfer", "flashinfer_fa2": "FI FA2", "flashinfer_fa3": "FI FA3",
                 "vllm_fa3": "vLLM FA3", "flex": "Flex", "torch": "PyTorch"}


def _anchor_order(section: str, rows: list) -> list:
    """The anchors the rows have, the section's primary one first."""
    names = list(dict.fromkeys(k for x in rows for k in x.get("ratios", {})))
    return sorted(names, key=lambda n: n != PRIMARY[section])


def markdown(r: dict) -> str:
    dev = r.get("device", {}).get("name", "?")
    lines = [f"# Kernels, {dev}, {str(r.get('date', '?'))[:10]}, commit {str(r.get('commit', '?'))[:12]}"
             + (" (--quick)" if r.get("quick") else ""), "",
             f"`{r.get('command', 'python -m perf kernels')}`. Same inputs, same process, {r.get('rounds')} alternating "
             "rounds; a figure is the median of its rounds' CUDA-event medians, a ratio (anchor us / ours us, > 1: ours "
             "faster) the median of the rounds' ratios. Anchors: "
             + "; ".join(f"{k}: {v}" for k, v in r.get("anchors", {}).items()) + ".", ""]
    for sec in SECTIONS:
        body = r.get("sections", {}).get(sec)
        if not body:
            continue
        names = _anchor_order(sec, body["rows"])
        rate = "TF/s" if sec in ("prefill", "append") else "GB/s"
        lines += [f"## {sec}", "", "| cell | ours us | ours " + rate + " | "
                  + " | ".join(f"{ANCHOR_LABELS.get(n, n)} us | ratio" for n in names) + " |",
                  "|---|---|---|" + "---|---|" * len(names)]
        for x in body["rows"]:
            fig = x.get("ours_tflops") if rate == "TF/s" else x.get("ours_gbps")
            cells = [x["cell"], _f(x["us"]["ours"]), _f(fig, ".0f")]
            for n in names:
                cells += [_f(x["us"].get(n)), _f(x.get("ratios", {}).get(n), ".3f")]
            lines.append("| " + " | ".join(cells) + " |")
        sm = r.get("summary", {}).get(sec, {})
        lines += ["", "Median ratio " + ", ".join(f"{ANCHOR_LABELS.get(k, k)} {v['median_ratio']:.3f} (min "
                                                  f"{v['min_ratio']:.3f})" for k, v in sm.items() if isinstance(v, dict))
                  + ".", ""]
    if r.get("errors"):
        lines += ["## Errors", ""] + [f"- {e}" for e in r["errors"]] + [""]
    return "\n".join(lines)


def plot(r: dict, path) -> Path:
    """One panel per section: each cell's ratio against each anchor (> 1: ours faster), a line at 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    secs = [s for s in SECTIONS if r.get("sections", {}).get(s, {}).get("rows")]
    if not secs:
        raise ValueError("the result holds no rows to plot")
    heights = [max(2.0, 0.28 * len(r["sections"][s]["rows"]) + 1.0) for s in secs]
    fig, axes = plt.subplots(len(secs), 1, figsize=(8, sum(heights)), gridspec_kw={"height_ratios": heights},
                             squeeze=False)
    for ax, sec in zip(axes[:, 0], secs):
        rows = r["sections"][sec]["rows"]
        names = _anchor_order(sec, rows)
        width = 0.8 / max(1, len(names))
        for j, n in enumerate(names):
            ys = [i + j * width for i in range(len(rows))]
            ax.barh(ys, [x.get("ratios", {}).get(n, 0) for x in rows], height=width, label=ANCHOR_LABELS.get(n, n))
        ax.set_yticks([i + 0.4 - width / 2 for i in range(len(rows))], [x["cell"] for x in rows], fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="k", linewidth=0.8)
        ax.set_title(f"{sec}: anchor us / ours us (> 1: ours faster)", fontsize=9)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))   # beside the bars, not over them
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"fi-backend kernels, {r.get('device', {}).get('name', '?')}, commit {str(r.get('commit', '?'))[:12]}",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(json_path: Path) -> None:
    """<name>.md and <name>.png beside the JSON (and under $OUT when set)."""
    r = json.loads(Path(json_path).read_text())
    md = Path(json_path).with_suffix(".md")
    md.write_text(markdown(r))
    outs = [md]
    try:
        outs.append(plot(r, Path(json_path).with_suffix(".png")))
    except ImportError as e:
        log(f"no plot ({e}); make it elsewhere with `python -m perf plot {json_path}` (pip install matplotlib)")
    except ValueError as e:
        log(f"no plot: {e}")
    if os.environ.get("OUT"):
        for p in outs:
            shutil.copy(p, Path(os.environ["OUT"], p.name))
    log("wrote " + ", ".join(str(p) for p in outs))


# ------------------------------------------------------------------------------------------------ GPU runs

class Anchors:
    """The anchors' wrappers, made once a process; an anchor that fails (not importable, a JIT build, a shape) is
    recorded in `broken` and not tried again."""

    def __init__(self, a):
        self.a = a
        self.broken: dict = {}
        self._fi_ragged: dict = {}
        self.fi_paged_state: dict = {}
        self._flex = None
        self.vllm_func, reason = (None, "skipped (--no-vllm)") if a.no_vllm else _vllm_fa3()
        if reason:
            self.broken["vllm_fa3"] = reason
            log(f"vLLM FA3 anchor unavailable: {reason}")
        try:
            import flashinfer
            self.flashinfer = flashinfer.__version__
        except Exception as e:   # timed ours-only then, and said so
            self.flashinfer = None
            for k in ("flashinfer", "flashinfer_fa2", "flashinfer_fa3"):
                self.broken[k] = f"flashinfer not importable: {type(e).__name__}: {e}"
            log(self.broken["flashinfer"])

    def fi_ragged(self, backend: str):
        from perf.prefill import FlashInferRagged
        if backend not in self._fi_ragged:
            self._fi_ragged[backend] = FlashInferRagged(backend)
        return self._fi_ragged[backend]

    def flex(self):
        if self._flex is None:
            from perf.prefill import compiled_flex
            self._flex = compiled_flex()
        return self._flex

    def describe(self) -> dict:
        d = {"flashinfer": f"FlashInfer {self.flashinfer}: decode wrapper (tensor cores on / off, the faster per "
                           "round); merge_state / merge_states" if self.flashinfer else "unavailable",
             "flashinfer_fa2": "FlashInfer FA2 prefill wrapper (ragged; paged for append)",
             "vllm_fa3": "vLLM flash_attn_varlen_func(fa_version=3)",
             "flex": "torch.compile(flex_attention, dynamic=False), block mask made outside the timing",
             "torch": "the merge in PyTorch ops (fp32)"}
        if self.a.fa3:
            d["flashinfer_fa3"] = "FlashInfer FA3 ragged prefill wrapper"
        for k, why in self.broken.items():
            d[k] = f"unavailable: {why}"
        return d


def _vllm_fa3():
    from perf.prefill import vllm_fa3
    return vllm_fa3()


def _ran(pair):
    """(fn, out) after one call of fn, so that out holds its result."""
    fn, out = pair
    fn()
    return fn, out


def fa3_member_name(over: dict) -> str:
    """The column of ours with FA3's consumer loop and tuning override `over` (--fa3-member): ours_fa3, or e.g.
    ours_fa3_fa3_1 for {"fa3": 1}."""
    return "ours_fa3" + "".join(f"_{k}_{v}" for k, v in sorted(over.items()))


def _try_anchor(ctx: Anchors, name: str, make, ours_out, label: str, fns: dict, checks: dict):
    """make() -> (fn, out) after one call; adds the anchor's timed fn and its output check, or records why not."""
    import torch

    from perf.common import diff_stats
    from perf.prefill import check
    if name in ctx.broken:
        return
    try:
        fn, out = make()
        torch.cuda.synchronize()
    except Exception as e:   # an anchor that fails is recorded and dropped, not fatal
        ctx.broken[name] = f"{type(e).__name__}: {e}"[:300]
        log(f"  anchor {name} failed on {label}, dropped: {ctx.broken[name]}")
        return
    fns[name] = fn
    checks[name] = check(f"{label} ours vs {name}", diff_stats(ours_out, out))


def run_decode(cell: dict, ctx: Anchors, rounds: int, rep: int) -> dict:
    import torch

    from perf import decode as dec
    from perf.common import rotating
    kv_dtype = torch.float8_e4m3fn if cell["kv_dtype"] == "fp8_e4m3" else dec.DTYPE
    case = dec.Case(cell["kv_lens"], cell["page_size"], kv_dtype=kv_dtype,
                    seed=len(cell["kv_lens"]) * 7919 + cell["kv_len"])
    label = f"decode {cell['cell']}"

    def timed(fn, setup):   # next KV set each call
        return rotating(lambda i: (setup(i), fn()), case.sets)
    fn, setup, _ = dec.ours(case)
    setup(0)
    fn()
    ours_out = case.out.clone()
    fns, checks = {"ours": timed(fn, setup)}, {}
    want = anchors_for(cell, vllm=not ctx.a.no_vllm, fa3=ctx.a.fa3)
    if "flashinfer" in want:
        for tc in (True, False):
            def make(tc=tc):
                f, s, out = dec.flashinfer_fn(case, tc)
                s(0)
                f()
                return timed(f, s), out
            _try_anchor(ctx, "flashinfer", make, ours_out, label, fns, checks)
            if "flashinfer" in fns:
                fns["fi_tc" if tc else "fi_cuda"] = fns.pop("flashinfer")
                checks["fi_tc" if tc else "fi_cuda"] = checks.pop("flashinfer")
    if "vllm_fa3" in want:
        def make_fa3():
            f, s, out = dec.vllm_fa3_fn(ctx.vllm_func, case)
            s(0)
            f()
            return timed(f, s), out
        _try_anchor(ctx, "vllm_fa3", make_fa3, ours_out, label, fns, checks)
    row = _timed_row(cell, fns, checks, rounds, rep, {"flashinfer": ["fi_tc", "fi_cuda"]})
    row["sets"] = case.sets
    return row


def run_prefill(cell: dict, ctx: Anchors, rounds: int, rep: int) -> dict:
    import torch

    from fi_backend import reference, variants
    from perf import prefill as P
    case = P.Case(cell["batch"], cell["seq_len"], cell["num_qo_heads"], cell["num_kv_heads"],
                  seed=cell["seq_len"] + cell["num_kv_heads"])
    label = f"prefill {cell['cell']}"
    if cell["variant"] == "causal":
        variant, params = variants.DEFAULT, {}
        score_mod, mask_mod = None, P.flex_specs(None)["causal"][3]
    else:
        slopes = reference.alibi_slopes(cell["num_qo_heads"]).to(torch.float32).cuda()
        variant, params, score_mod, mask_mod, _ = P.flex_specs(slopes)[cell["variant"]]
    fn, ours_out, info = P.ours_fn(case, variant=variant, params=params)
    fn()
    fns, checks = {"ours": fn}, {}
    want = anchors_for(cell, vllm=not ctx.a.no_vllm, fa3=ctx.a.fa3)
    for over in (getattr(ctx.a, "fa3_member", None) or []) if cell["variant"] == "causal" else []:
        # FA3's consumer loop beside member 0: PREFILL_FA3_TUNINGS with each override, a column each
        from fi_backend.wrappers import PREFILL_FA3_TUNINGS
        def make_fa3_member(over=over):
            f, out, _ = P.ours_fn(case, variant=variant, params=params, tuning={**PREFILL_FA3_TUNINGS[case.d], **over})
            f()
            return f, out
        _try_anchor(ctx, fa3_member_name(over), make_fa3_member, ours_out, label, fns, checks)
    for backend in ("fa2", "fa3"):
        if f"flashinfer_{backend}" in want:
            _try_anchor(ctx, f"flashinfer_{backend}", lambda b=backend: _ran(ctx.fi_ragged(b).fn(case)), ours_out,
                        label, fns, checks)
    if "vllm_fa3" in want:
        _try_anchor(ctx, "vllm_fa3", lambda: _ran(P.vllm_fn(ctx.vllm_func, case)), ours_out, label, fns, checks)
    first = {}
    if "flex" in want:
        def make_flex():
            f, result = P.flex_fn(ctx.flex(), case, score_mod, mask_mod)
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            first["flex_first_call_s"] = time.perf_counter() - t0   # its torch.compile for this shape
            return f, result()
        _try_anchor(ctx, "flex", make_flex, ours_out, label, fns, checks)
    row = _timed_row(cell, fns, checks, rounds, rep)
    row.update(first, rows_per_tile=info["rows_per_tile"], num_ctas=info["num_ctas"])
    return row


def run_append(cell: dict, ctx: Anchors, rounds: int, rep: int) -> dict:
    from perf import prefill as P
    case = P.AppendCase(cell["batch"], cell["q_len"], cell["kv_len"], cell["num_qo_heads"], cell["num_kv_heads"],
                        page_size=cell["page_size"], seed=cell["kv_len"] + cell["q_len"])
    label = f"append {cell['cell']}"
    fn, ours_out, info = P.ours_fn(case, paged=case.pool)
    fn()
    fns, checks = {"ours": fn}, {}
    want = anchors_for(cell, vllm=not ctx.a.no_vllm, fa3=ctx.a.fa3)
    if "flashinfer_fa2" in want:
        _try_anchor(ctx, "flashinfer_fa2", lambda: _ran(P.flashinfer_paged_fn(case, case.pool, ctx.fi_paged_state)),
                    ours_out, label, fns, checks)
    if "vllm_fa3" in want:
        _try_anchor(ctx, "vllm_fa3", lambda: _ran(P.vllm_paged_fn(ctx.vllm_func, case)), ours_out, label, fns,
                    checks)
    row = _timed_row(cell, fns, checks, rounds, rep)
    row.update(rows_per_tile=info["rows_per_tile"], num_ctas=info["num_ctas"])
    return row


def run_merge(cell: dict, ctx: Anchors, rounds: int, rep: int) -> dict:
    import torch

    from fi_backend import ops
    from perf import merge as M
    g = torch.Generator(device="cuda").manual_seed(cell["rows"])
    n, h, d, dt = cell["rows"], cell["num_heads"], cell["head_dim"], torch.bfloat16
    label = f"merge {cell['cell']}"
    fns, checks = {}, {}
    if cell["op"] == "merge_state":
        v_a, v_b = (torch.randn(n, h, d, generator=g, device="cuda", dtype=dt) for _ in range(2))
        s_a, s_b = (torch.randn(n, h, generator=g, device="cuda") * 3 for _ in range(2))
        out, out_lse = torch.empty_like(v_a), torch.empty_like(s_a)
        fns["ours"] = lambda: ops.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
        fi = ("merge_state", (v_a, s_a, v_b, s_b))
        torch_fn = lambda: M.torch_merge_state(v_a, s_a, v_b, s_b)   # noqa: E731
    else:
        v = torch.randn(n, cell["states"], h, d, generator=g, device="cuda", dtype=dt)
        s = torch.randn(n, cell["states"], h, generator=g, device="cuda") * 3
        out, out_lse = torch.empty(n, h, d, device="cuda", dtype=dt), torch.empty(n, h, device="cuda")
        fns["ours"] = lambda: ops.merge_states(v, s, out=out, out_lse=out_lse)
        fi = ("merge_states", (v, s))
        torch_fn = lambda: M.torch_merge_states(v, s)   # noqa: E731
    fns["ours"]()
    want = anchors_for(cell)
    if "torch" in want:
        _try_anchor(ctx, "torch", lambda: (torch_fn, torch_fn()[0]), out, label, fns, checks)
    if "flashinfer" in want and "flashinfer" not in ctx.broken:
        try:   # base-2 log-sum-exp: timed on the same tensors, its output not comparable
            import flashinfer
            f = getattr(flashinfer, fi[0])
            f(*fi[1])
            torch.cuda.synchronize()
            fns["flashinfer"] = lambda: f(*fi[1])
        except Exception as e:
            ctx.broken["flashinfer_merge"] = f"{type(e).__name__}: {e}"[:300]
            log(f"  anchor flashinfer failed on {label}: {ctx.broken['flashinfer_merge']}")
    return _timed_row(cell, fns, checks, rounds, rep)


RUNNERS = {"decode": run_decode, "prefill": run_prefill, "append": run_append, "merge": run_merge}


def _timed_row(cell: dict, fns: dict, checks: dict, rounds: int, rep: int, combine: dict | None = None) -> dict:
    from perf.common import time_rounds
    times = time_rounds(fns, rounds, rep)
    us, ratios, per_round = summarise(times, combine)
    row = {k: v for k, v in cell.items() if k != "kv_lens"}
    if cell["section"] == "decode" and cell["cell"] in ("skewed", "sharegpt64"):
        row["kv_lens"] = cell["kv_lens"]
    nbytes, flops = cell_work(cell)
    row.update(us=us, us_per_round=per_round, ratios=ratios, checks=checks, rounds=rounds,
               ours_gbps=nbytes / (us["ours"] * 1e-6) / 1e9)
    if flops:
        row["ours_tflops"] = flops / (us["ours"] * 1e-6) / 1e12
        row["flops"] = flops
    anchor = primary_anchor(cell)
    row["anchor"] = anchor if anchor in ratios else None
    row["ratio"] = ratios.get(anchor)
    return row


def run(a, cells: list, est: dict) -> dict:
    import torch

    from perf.common import stamp
    from perf.prefill import failures
    ctx = Anchors(a)
    rows = {s: [] for s in a.section_list}
    errors = []
    t0 = time.perf_counter()
    for i, cell in enumerate(cells):
        elapsed = time.perf_counter() - t0
        left = sum(est["cells"][i:]) + (sum(est["jit"].values()) if i == 0 else 0.0)
        log(f"[{i + 1}/{len(cells)}] {cell['section']} {cell['cell']} (elapsed {elapsed:.0f} s, about {left:.0f} s left)")
        try:
            r = RUNNERS[cell["section"]](cell, ctx, a.rounds, a.rep)
        except Exception as e:   # recorded (the run exits 1), the other cells still run
            errors.append(f"{cell['section']} {cell['cell']}: {type(e).__name__}: {e}"[:400])
            log(f"  ERROR {errors[-1]}")
            torch.cuda.empty_cache()
            continue
        rows[cell["section"]].append(r)
        log("  ours {:.1f} us".format(r["us"]["ours"]) + "".join(
            f" | {k} {r['us'][k]:.1f} us ratio {v:.3f}" for k, v in r["ratios"].items()))
        torch.cuda.empty_cache()
    sections = {s: {"primary_anchor": PRIMARY[s], "rows": rows[s]} for s in a.section_list}
    errors += failures()
    return {**stamp(), "quick": a.quick, "rounds": a.rounds, "rep": a.rep, "command": a.command,
            "anchors": ctx.describe(), "estimate_s": round(est["total_s"]), "wall_s": round(time.perf_counter() - t0),
            "sections": sections, "summary": summary(sections), "errors": errors}


# ------------------------------------------------------------------------------------------------ CLI

def build_parser(prog="python -m perf kernels") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small grid (the before / after bar)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--merge", metavar="FILE", help="join this run's cells into the results JSON FILE")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's FlashAttention-3 anchor")
    ap.add_argument("--fa3", action="store_true", help="prefill: also FlashInfer's FA3 template (about 100 s JIT)")
    ap.add_argument("--fa3-member", nargs="?", const="[{}]", default=None, metavar="JSON",
                    help="prefill: also ours with FA3's consumer loop (tuning PREFILL_FA3_TUNINGS, off by default); "
                         "JSON: a list of overrides of that tuning, a column each, e.g. '[{\"fa3\": 1}, {\"fa3\": 2}]'")
    ap.add_argument("--estimate", action="store_true", help="print the plan and its time estimate; run nothing")
    ap.add_argument("--name", help="results name (default kernels_<device>, with _quick for --quick)")
    ap.add_argument("--rounds", type=int, help=f"alternating rounds per cell (default {DEFAULT_ROUNDS[True]})")
    ap.add_argument("--rep", type=int, help="timed calls per figure at most (default 100; --quick 50)")
    return ap


def resolve_args(argv=None, prog="python -m perf kernels"):
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    a.section_list = [x.strip() for x in a.sections.split(",") if x.strip()]
    bad = [x for x in a.section_list if x not in SECTIONS]
    if bad or not a.section_list:
        ap.error(f"--sections: unknown {bad}; accepted: {', '.join(SECTIONS)}")
    a.section_list = [s for s in SECTIONS if s in a.section_list]
    if a.merge and not Path(a.merge).is_file():
        ap.error(f"--merge: no results JSON at {a.merge}")
    if a.fa3_member is not None:
        try:
            a.fa3_member = json.loads(a.fa3_member)
        except ValueError:
            a.fa3_member = None
        if not (isinstance(a.fa3_member, list) and a.fa3_member and all(isinstance(x, dict) for x in a.fa3_member)):
            ap.error("--fa3-member: a JSON list of tuning overrides (objects), e.g. '[{\"fa3\": 1}, {\"fa3\": 2}]'")
    a.rounds = a.rounds if a.rounds is not None else DEFAULT_ROUNDS[a.quick]
    a.rep = a.rep if a.rep is not None else DEFAULT_REP[a.quick]
    if a.rounds < 1 or a.rep < 1:
        ap.error(f"--rounds and --rep must be >= 1 (got {a.rounds}, {a.rep})")
    a.command = " ".join(["python -m perf kernels", *(sys.argv[2:] if argv is None else argv)])
    return a


def print_plan(a, cells: list, est: dict) -> None:
    by = {}
    for c, s in zip(cells, est["cells"]):
        n, t = by.get(c["section"], (0, 0.0))
        by[c["section"]] = (n + 1, t + s)
    for sec, (n, t) in by.items():
        log(f"{sec}: {n} cells, about {t:.0f} s")
    jit = sum(est["jit"].values())
    log(f"estimate: about {est['total_s']:.0f} s ({est['total_s'] / 60:.1f} min) on an H100, {a.rounds} rounds x "
        f"{a.rep} calls, including up to {jit:.0f} s of FlashInfer JIT builds when its cache is cold")


def main(argv=None) -> int:
    a = resolve_args(argv)
    cells = grid(a.section_list, a.quick)
    est = estimate(cells, a.rounds, a.rep, vllm=not a.no_vllm, fa3=a.fa3)
    print_plan(a, cells, est)
    if a.estimate:
        return 0
    import torch
    if not torch.cuda.is_available():
        log("perf kernels needs a CUDA GPU (--estimate runs without one)")
        return 2
    try:
        built = prebuild(cells)
    except Exception as e:   # the cells build lazily instead
        built = {"error": f"{type(e).__name__}: {e}"}
        log(f"prebuild failed ({built['error']}); modules build lazily")
    results = run(a, cells, est)
    results["prebuild"] = built
    if a.merge:
        results = merge_results(json.loads(Path(a.merge).read_text()), results)
    name = a.name or f"kernels_{device_tag(results['device']['name'])}" + ("_quick" if a.quick else "")
    path = write_result(name, {k: v for k, v in results.items() if k not in ("benchmark", "date", "commit")})
    write_outputs(path)
    log(f"total {results['wall_s']} s (estimate {results['estimate_s']} s)")
    if results["errors"]:
        log("errors:\n  " + "\n  ".join(results["errors"]))
        return 1
    return 0


def compare_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf compare",
                                 description="Cell by cell change of two `perf kernels` results: ours' time over the "
                                             "cell's anchor from the same run; exit 1 when a cell moved more than the "
                                             "tolerance.")
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--tolerance", type=float, default=0.02, help="fraction (default 0.02)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the table to FILE")
    a = ap.parse_args(argv)
    if not 0 < a.tolerance < 1:
        ap.error(f"--tolerance must be a fraction between 0 and 1 (got {a.tolerance})")
    docs = []
    for p in (a.before, a.after):
        try:
            docs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            ap.error(f"{p}: not a readable results JSON ({e})")
        if "sections" not in docs[-1]:
            ap.error(f"{p}: not a `perf kernels` result (no sections)")
    res = compare(docs[0], docs[1], a.tolerance)
    md = compare_markdown(res)
    print(md)
    if a.markdown:
        Path(a.markdown).write_text(md)
    if not res["rows"]:
        log("no cell in common")
        return 1
    return 1 if res["moved"] else 0


if __name__ == "__main__":
    sys.exit(main())
