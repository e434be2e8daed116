"""The model zoo's head configurations against FlashInfer 0.6.14, same inputs, same process, alternating rounds.

  prefill: causal bf16, ragged KV, batch x length 4x4k by default; ours against FlashInfer's FA2 template
    (where it has the head size) in alternating rounds (perf.prefill.time_rounds), and each group's TFLOP/s
    over group 4's (32 / 8 heads) at the same head size.
  decode: every distinct (query heads, KV heads, head size) of the zoo's models that FlashInfer has a head size
    for, pages 1 / 16 / 64 / 128, bf16, KV sets rotated past L2 (perf.decode.Case); FlashInfer's tensor-core
    decode (any group) as the anchor; the ratio FlashInfer us / ours us is the median of the rounds' ratios.

    python -m perf.groups [--sections prefill,decode] [--shapes 4x4096] [--cells 7x1001,64x2047]

Bars (issue 26): groups 3, 5, 6, 7 at >= 0.95 of group 4's TFLOP/s and >= 1.1x FlashInfer's FA2; decode >= 0.98
of FlashInfer in every cell.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from perf import decode as dec
from perf.common import time_us, write_result
from perf.prefill import (Case, FlashInferRagged, _check, _stamp, attention_flops, diff_stats, log, ours_fn, tflops,
                          time_rounds, unmasked_pairs)

# (query heads, KV heads, head size, model) at group 3 .. 7 and the group-4 reference; 80 / 96 without FA2.
CONFIGS = ((32, 8, 128, "group 4 (Llama-3.1-8B)"), (24, 8, 128, "group 3 (Llama-3.2-3B)"),
           (40, 8, 128, "group 5 (Qwen2.5-14B)"), (24, 4, 128, "group 6"), (12, 2, 128, "group 6 (Qwen2.5-1.5B)"),
           (28, 4, 128, "group 7 (Qwen2.5-7B)"), (32, 32, 128, "MHA 32 heads"), (32, 32, 96, "head 96 (Phi-3-mini)"),
           (32, 32, 80, "head 80"), (32, 8, 96, "head 96, group 4"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4x4096", help="batch x length, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--name", default="zoo_h100")
    ap.add_argument("--sections", default="prefill,decode")
    ap.add_argument("--cells", default="7x1001,64x2047", help="decode batch x KV length, comma-separated")
    ap.add_argument("--pages", default="1,16,64,128")
    a = ap.parse_args(argv)
    out = {**_stamp()}
    if "prefill" in a.sections:
        out["prefill"] = prefill_section(a)
    if "decode" in a.sections:
        out["decode"] = decode_section(a)
    write_result(a.name, out)
    return 0


def zoo_decode_configs() -> list:
    """Distinct (query heads, KV heads, head size) of the zoo's accepted models, with the models' names."""
    from fi_backend import models
    by = {}
    for m in models.ZOO:
        if models.check(m)[0]:
            by.setdefault((m.num_qo_heads, m.num_kv_heads, m.head_dim), []).append(m.name)
    return sorted(by.items())


def decode_section(a) -> dict:
    rows, lines = [], ["| heads | D | models | page | batch x KV | ours us | FlashInfer us | FI / ours |",
                       "|---|---|---|---|---|---|---|---|"]
    for (hq, hkv, d), names in zoo_decode_configs():
        dec.HQ, dec.HKV, dec.D = hq, hkv, d  # perf.decode's Case / ours / flashinfer_fn read these
        for page in (int(p) for p in a.pages.split(",")):
            for cell in a.cells.split(","):
                b, kv = (int(x) for x in cell.split("x"))
                case = dec.Case([kv] * b, page)
                fn, setup, _ = dec.ours(case)
                fns = [("ours", fn, setup)]
                if not a.no_flashinfer and d in (64, 128, 256):
                    ffn, fsetup, fout = dec.flashinfer_fn(case, True)
                    setup(0), fn(), fsetup(0), ffn()
                    dec.check_close(case, case.out, fout)
                    fns.append(("fi", ffn, fsetup))
                times = {k: [] for k, _, _ in fns}
                for _ in range(a.rounds):
                    for k, f, su in fns:
                        times[k].append(time_us(f, setup=su, rep=a.rep)["median_us"])
                row = {"num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "models": names, "page_size": page,
                       "batch": b, "kv_len": kv, "ours_us": statistics.median(times["ours"]), "ours_us_rounds": times["ours"]}
                if "fi" in times:
                    row["fi_us"] = statistics.median(times["fi"])
                    row["fi_us_rounds"] = times["fi"]
                    row["fi_over_ours"] = statistics.median(f / o for f, o in zip(times["fi"], times["ours"]))
                rows.append(row)
                line = (f"| {hq}/{hkv} | {d} | {', '.join(names)} | {page} | {cell} | {row['ours_us']:.1f} | "
                        f"{row.get('fi_us', float('nan')):.1f} | {row.get('fi_over_ours', float('nan')):.3f} |")
                lines.append(line)
                log(line)
                del fn, fns, case
                torch.cuda.empty_cache()
    print("\n".join(lines))
    ratios = [r["fi_over_ours"] for r in rows if "fi_over_ours" in r]
    return {"anchor": "FlashInfer 0.6.14 BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True), same q and pages, "
                      "alternating rounds", "rows": rows, "table": lines,
            "min_fi_over_ours": min(ratios) if ratios else None}


def prefill_section(a) -> dict:
    fa2 = None
    if not a.no_flashinfer:
        try:
            fa2 = FlashInferRagged("fa2")
        except Exception as e:  # not staged: ours only
            log(f"FlashInfer unavailable ({type(e).__name__}: {e}); timing ours only")
    rows = []
    for shape in a.shapes.split(","):
        b, s = (int(x) for x in shape.split("x"))
        for hq, hkv, d, label in CONFIGS:
            case = Case(b, s, hq, hkv, d)
            flops = attention_flops(b * unmasked_pairs(s, s), hq, d)
            fn, out, info = ours_fn(case)
            fns = {"ours": fn}
            if fa2 is not None and d in (64, 128, 256):
                ffn, fout = fa2.fn(case)
                _check(f"{label} {shape} vs FlashInfer FA2", diff_stats(out, fout))
                fns["fa2"] = ffn
            times = time_rounds(fns, a.rounds, a.rep)
            row = {"shape": shape, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "label": label,
                   "ours_us": statistics.median(times["ours"]), "ours_us_rounds": times["ours"], **info}
            row["ours_tflops"] = tflops(flops, row["ours_us"])
            if "fa2" in times:
                row["fa2_us"] = statistics.median(times["fa2"])
                row["over_fa2"] = statistics.median(f / o for f, o in zip(times["fa2"], times["ours"]))
            rows.append(row)
            log(f"{shape} {label} {hq}/{hkv} d{d}: ours {row['ours_us']:.1f} us {row['ours_tflops']:.1f} TF/s"
                + (f", FA2 {row['fa2_us']:.1f} us, ours / FA2 speed {row['over_fa2']:.3f}" if "fa2" in times else ""))
            del fn, out, fns, case
            torch.cuda.empty_cache()
        ref = {r["head_dim"]: r["ours_tflops"] for r in rows if r["shape"] == shape and r["num_qo_heads"] == 32
               and r["num_kv_heads"] == 8}
        for r in rows:
            if r["shape"] == shape and r["head_dim"] in ref:
                r["over_group4_tflops"] = r["ours_tflops"] / ref[r["head_dim"]]
    lines = ["| shape | config | heads | D | ours TF/s | over group 4 | FA2 us | ours / FA2 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['label']} | {r['num_qo_heads']}/{r['num_kv_heads']} | {r['head_dim']} | "
                     f"{r['ours_tflops']:.1f} | {r.get('over_group4_tflops', float('nan')):.3f} | "
                     f"{r.get('fa2_us', float('nan')):.1f} | {r.get('over_fa2', float('nan')):.3f} |")
    print("\n".join(lines))
    return {"anchor": "FlashInfer 0.6.14 BatchPrefillWithRaggedKVCacheWrapper fa2, same inputs, alternating rounds; "
                      "group 4 = 32/8 heads at the same head size", "rows": rows, "table": lines}


if __name__ == "__main__":
    sys.exit(main())
