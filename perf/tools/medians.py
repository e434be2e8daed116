"""Per-cell medians of several `python -m perf kernels` runs (one process each), for cells whose ratio moves
between processes (FlexAttention's by up to 4% on the same kernels and inputs): a bar is judged on the median over
runs; each run's figure and the minimum are kept beside it.

    python -m perf.tools.medians run1.json run2.json run3.json --name kernels_h100_medians [--section prefill]

Writes perf/results/<name>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from perf.common import write_result


def medians(paths: list, section: str | None = None) -> dict:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    cells = {}
    for r in runs:
        for sec, body in r["sections"].items():
            if section and sec != section:
                continue
            for x in body["rows"]:
                for anchor, ratio in x.get("ratios", {}).items():
                    c = cells.setdefault((sec, x["cell"], anchor), {"ratios": [], "ours_us": []})
                    c["ratios"].append(ratio)
                    c["ours_us"].append(x["us"]["ours"])
    rows = [{"section": sec, "cell": cell, "anchor": anchor, "runs": len(c["ratios"]),
             "ratio_median": statistics.median(c["ratios"]), "ratio_min": min(c["ratios"]),
             "ratio_max": max(c["ratios"]), "ratios": c["ratios"], "ours_us_median": statistics.median(c["ours_us"])}
            for (sec, cell, anchor), c in cells.items()]
    return {"benchmark": "kernels medians", "device": runs[0]["device"], "commits": sorted({r["commit"] for r in runs}),
            "sources": [str(p) for p in paths], "dates": [r["date"] for r in runs], "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# Per-cell medians of {len(res['sources'])} kernels runs, {res['device']['name']}, commit "
             f"{', '.join(res['commits'])}", "",
             "One process a run; ratio = anchor us / ours us (> 1: ours faster). Sources: "
             + ", ".join(f"`{Path(s).name}`" for s in res["sources"]) + ".", "",
             "| section | cell | anchor | ours us (median) | ratio median | min | max | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for x in res["rows"]:
        lines.append(f"| {x['section']} | {x['cell']} | {x['anchor']} | {x['ours_us_median']:.1f} | "
                     f"{x['ratio_median']:.3f} | {x['ratio_min']:.3f} | {x['ratio_max']:.3f} | {x['runs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tools.medians", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="results JSONs written by python -m perf kernels")
    ap.add_argument("--name", required=True, help="perf/results/<name>.json and .md")
    ap.add_argument("--section", help="one section only")
    a = ap.parse_args(argv)
    res = medians(a.runs, a.section)
    md = markdown(res)
    write_result(a.name, res).with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
