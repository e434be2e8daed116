"""A/B summary of alternating perf.prefill runs (a b a b ...: two kernel builds on one machine, sources swapped
between runs, as in .carry's A/B scripts): one table, each cell our median us and (anchor us / ours) from the
same run, and b / a of the per-version means.

    python -m perf.ab perf/results/prefill_ab38 --title "..." --about "..."   # reads prefill_ab38_{a,b}_{i}.json

Writes <stem>.md and <stem>.json (the rows); the run files stay where they are.
"""
from __future__ import annotations

import argparse
import glob
import json
import re
import statistics


def _cells(d: dict) -> dict:
    """case -> (our us, anchor us) of one perf.prefill result (sections fa2 and flex)."""
    out = {}
    for r in d.get("fa2", {}).get("rows", []):
        out[f"fa2 {r['num_qo_heads']}/{r['num_kv_heads']} {r['batch']}x{r['seq_len']}"] = (r["ours_us"], r["fi_fa2_us"])
    for r in d.get("flex", {}).get("rows", []):
        out[f"flex {r['variant']} {r['batch']}x{r['seq_len']}"] = (r["ours_us"], r["flex_us"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stem", help="path prefix of the run files, e.g. perf/results/prefill_ab38")
    ap.add_argument("--title", required=True)
    ap.add_argument("--about", default="", help="a paragraph: what a and b are and how the runs were made")
    a = ap.parse_args()
    runs = []
    for path in glob.glob(f"{a.stem}_[ab]_*.json"):
        m = re.search(r"_([ab])_(\d+)\.json$", path)
        runs.append((int(m.group(2)), m.group(1), json.load(open(path))))
    if not runs:
        raise SystemExit(f"no run files {a.stem}_[ab]_<i>.json")
    runs.sort(key=lambda t: (t[0], t[1]))
    cells = [(f"{v} {i}", _cells(d)) for i, v, d in runs]
    first = runs[0][2]
    cases = list(cells[0][1])
    rows = []
    for case in cases:
        per = {label: c.get(case) for label, c in cells}
        mean = {v: statistics.mean(x[0] for lab, x in per.items() if x and lab.startswith(v)) for v in "ab"}
        rows.append({"case": case, "runs": {lab: {"ours_us": x[0], "anchor_us": x[1], "anchor_over_ours": x[1] / x[0]}
                                            for lab, x in per.items() if x},
                     "b_over_a": mean["b"] / mean["a"]})
    head = "| case | " + " | ".join(f"{lab} (ratio)" for lab, _ in cells) + " | b / a (mean) |"
    lines = [f"# {a.title}", "", a.about, "",
             f"Device: {first['device']['name']}, date {first['date'][:10]}. Each cell: our median us and (anchor us / "
             "ours) from the same run and process; fa2 rows: FlashInfer FA2, flex rows: FlexAttention.", "",
             head, "|" + "---|" * (len(cells) + 2)]
    for r in rows:
        vals = [r["runs"].get(lab) for lab, _ in cells]
        txt = [f"{x['ours_us']:.1f} ({x['anchor_us'] / x['ours_us']:.3f})" if x else "-" for x in vals]
        lines.append(f"| {r['case']} | " + " | ".join(txt) + f" | {r['b_over_a']:.3f} |")
    open(f"{a.stem}.md", "w").write("\n".join(lines) + "\n")
    commits = {f"{v} {i}": d.get("commit") for i, v, d in runs}  # the checked-out commit each run names
    json.dump({"title": a.title, "about": a.about, "device": first["device"], "date": first["date"],
               "run_commits": commits, "rows": rows},
              open(f"{a.stem}.json", "w"), indent=1)
    print(f"wrote {a.stem}.md, {a.stem}.json")


if __name__ == "__main__":
    main()
