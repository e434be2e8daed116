"""Plot a serving result JSON (perf.e2e.vllm_bench or sglang_bench): median ITL and median TTFT against request
rate, one line per backend.

    python -m perf plot perf/results/e2e_vllm_sharegpt_b10fecd.json [-o out.png]      (pip install matplotlib)

One column per dataset; rows are median ITL, p99 ITL and median TTFT. Rates are evenly spaced labels
("inf" last), since an infinite rate has no place on a numeric axis.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OURS = ("CUSTOM", "fi_backend")   # fi-backend's backend in vLLM and in SGLang
ROWS = (("median_itl_ms", "median ITL (ms)"), ("p99_itl_ms", "p99 ITL (ms)"), ("median_ttft_ms", "median TTFT (ms)"))


def plot(r: dict, path: Path | str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = r["settings"]
    datasets = [d for d in s["datasets"] if any(x["dataset"] == d for x in r["runs"])]
    if not datasets:
        raise ValueError("the result holds no runs to plot")
    rates = s["rates"]
    backends = [b for b in r["backends"] if any(x["backend"] == b for x in r["runs"])]
    fig, axes = plt.subplots(len(ROWS), len(datasets), figsize=(4.2 * len(datasets), 2.8 * len(ROWS)),
                             squeeze=False)
    by = {(x["dataset"], x["rate"], x["backend"]): x["metrics"] for x in r["runs"]}
    for j, d in enumerate(datasets):
        for i, (key, label) in enumerate(ROWS):
            ax = axes[i][j]
            for b in backends:
                pts = [(k, by[(d, rate, b)][key]) for k, rate in enumerate(rates) if (d, rate, b) in by]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b,
                            linewidth=2.5 if b in OURS else 1.5)
            ax.set_xticks(range(len(rates)), rates)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(d)
            if i == len(ROWS) - 1:
                ax.set_xlabel("request rate (req/s)")
            if j == 0:
                ax.set_ylabel(label)
    axes[0][0].legend(fontsize=8)
    engine = str(r.get("benchmark", "e2e_vllm")).removeprefix("e2e_")
    label = {"vllm": "vLLM", "sglang": "SGLang"}.get(engine, engine)
    fig.suptitle(f"{label} {r.get(engine)} on {r['device'].get('name')}, {r['model']['num_hidden_layers']} layers, "
                 f"commit {str(r['commit'])[:12]}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a perf.e2e.vllm_bench or sglang_bench result JSON")
    ap.add_argument("-o", "--output", help="PNG path (default: beside the JSON, same name)")
    a = ap.parse_args(argv)
    src = Path(a.json)
    try:
        out = plot(json.loads(src.read_text()), a.output or src.with_suffix(".png"))
    except ImportError:
        print("perf.e2e.plot: matplotlib is missing; pip install matplotlib", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
