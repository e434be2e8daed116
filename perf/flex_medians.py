"""Per-cell medians of several flex runs (perf.prefill --sections flex, one process each).

    python -m perf.flex_medians perf/results/prefill_flex_h100_09711a7_r*.json --name prefill_flex_h100_09711a7_medians

The flex ratio of one cell moves by up to 4% between processes on the same kernels and inputs (ours more
than flex: 2298-2387 us for causal 16 x 4k over six runs at 09711a7), so a bar of 1.2 is judged on the
per-cell median over runs; the minimum and every run's figure are kept beside it. Writes perf/results/<name>.json
and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from perf.common import write_result


def medians(paths: list) -> dict:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    commits = sorted({r["commit"] for r in runs})
    cells = {}
    for r in runs:
        for x in r["flex"]["rows"]:
            c = cells.setdefault((x["variant"], x["batch"], x["seq_len"]), {"ratios": [], "ours_us": [], "flex_us": []})
            c["ratios"].append(x["ratio_flex_over_ours"])
            c["ours_us"].append(x["ours_us"])
            c["flex_us"].append(x["flex_us"])
    bar = runs[0]["bars"]["flex_ratio_min"]
    rows = []
    for (variant, batch, seq_len), c in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        med = statistics.median(c["ratios"])
        rows.append({"variant": variant, "batch": batch, "seq_len": seq_len, "runs": len(c["ratios"]),
                     "ratio_median": med, "ratio_min": min(c["ratios"]), "ratio_max": max(c["ratios"]),
                     "ratios": c["ratios"], "ours_us_median": statistics.median(c["ours_us"]),
                     "flex_us_median": statistics.median(c["flex_us"]), "bar_met_by_median": med >= bar})
    return {"benchmark": "flex medians", "device": runs[0]["device"], "commits": commits, "bar": bar,
            "sources": [str(p) for p in paths], "dates": [r["date"] for r in runs], "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# Flex ratios, per-cell medians of {len(res['sources'])} runs, {res['device']['name']}, "
             f"commit {', '.join(res['commits'])}", "",
             "One process a run (`python -m perf.prefill --sections flex`); ratio = flex time / ours (> 1: ours faster), "
             f"bar {res['bar']}. Sources: " + ", ".join(f"`{Path(s).name}`" for s in res["sources"]) + ".", "",
             "| variant | batch x len | ours us (median) | flex us (median) | ratio median | min | max | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for x in res["rows"]:
        lines.append(f"| {x['variant']} | {x['batch']}x{x['seq_len']} | {x['ours_us_median']:.1f} | "
                     f"{x['flex_us_median']:.1f} | {x['ratio_median']:.3f} | {x['ratio_min']:.3f} | "
                     f"{x['ratio_max']:.3f} | {x['runs']} |")
    met = sum(x["bar_met_by_median"] for x in res["rows"])
    lines += ["", f"Bar met by the median in {met} of {len(res['rows'])} cells; single runs as low as "
                  f"{min(x['ratio_min'] for x in res['rows']):.3f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="flex JSONs written by perf.prefill")
    ap.add_argument("--name", required=True, help="perf/results/<name>.json and .md")
    a = ap.parse_args()
    res = medians(a.runs)
    md = markdown(res)
    write_result(a.name, res).with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
