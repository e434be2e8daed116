"""python -m perf COMMAND [options]: the benchmark suite's one entry point (`python -m perf COMMAND --help`).

    kernels   decode, prefill, append and merge against FlashInfer, FlashAttention-3 and FlexAttention (perf.kernels)
    compare   cell by cell change of two `kernels` results, exit 1 past the tolerance (perf.kernels)
    zoo       the model zoo's head configurations against FlashInfer and vLLM FA3 (perf.zoo)
    e2e       serving benchmark: --engine vllm (perf.e2e.vllm_bench) or --engine sglang (perf.e2e.sglang_bench)
    plan      host time of plan() for decode batches (perf.plan)
    composable  decode with shared prefixes against FlashInfer's cascade wrapper (perf.composable)
    plot      the plot of a results JSON (kernels or e2e), beside it
    trace     the ShareGPT (prompt, output) length trace (perf.sharegpt)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COMMANDS = ("kernels", "compare", "zoo", "e2e", "plan", "plot", "trace", "composable")
ENGINES = ("vllm", "sglang")


def _e2e(argv: list) -> int:
    """`e2e --engine vllm|sglang [bench options]`: the engine picks the bench; the rest goes to it."""
    rest, engine = [], None
    it = iter(argv)
    for x in it:
        if x == "--engine":
            engine = next(it, None)
        elif x.startswith("--engine="):
            engine = x.split("=", 1)[1]
        else:
            rest.append(x)
    if engine not in ENGINES:
        print(f"python -m perf e2e: --engine must be one of {', '.join(ENGINES)} (got {engine!r})", file=sys.stderr)
        return 2
    if engine == "vllm":
        from perf.e2e import vllm_bench as bench
    else:
        from perf.e2e import sglang_bench as bench
    return bench.main(rest)


def _plot(argv: list) -> int:
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] not in ("-o", "--output")):
        print("usage: python -m perf plot RESULT.json [-o OUT.png]", file=sys.stderr)
        return 2
    src = Path(argv[0])
    out = Path(argv[2]) if len(argv) == 3 else src.with_suffix(".png")
    r = json.loads(src.read_text())
    if "sections" in r:
        from perf.kernels import plot
    elif "runs" in r:
        from perf.e2e.plot import plot
    else:
        print(f"python -m perf plot: {src} is neither a kernels nor an e2e result", file=sys.stderr)
        return 2
    print(f"wrote {plot(r, out)}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"python -m perf: unknown command {cmd!r}; accepted: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if cmd == "kernels":
        from perf.kernels import main as run
    elif cmd == "compare":
        from perf.kernels import compare_main as run
    elif cmd == "zoo":
        from perf.zoo import main as run
    elif cmd == "plan":
        from perf.plan import main as run
    elif cmd == "composable":
        from perf.composable import main as run
    elif cmd == "trace":
        from perf.sharegpt import main as run
    elif cmd == "e2e":
        run = _e2e
    else:
        run = _plot
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
