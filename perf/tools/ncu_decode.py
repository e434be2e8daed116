"""One profiled launch (after 3 warm-ups) of our single-format decode or FlashInfer's tensor-core decode on a
perf.composable cell (B requests sharing an L-token prefix's pages, S unique tokens each), for ncu:

    ncu --profile-from-start off --set full -o ours python3 -m perf.tools.ncu_decode ours 128x1024x256 [--unshared]
        [--heads 128/8/128]

argv: impl (ours, flashinfer; groups: ours with the prefix groups, on the prefill kernel as the planner picks),
BxLxS, --unshared for the same lengths on distinct pages (the control: every request its own prefix pages), --heads
Q/KV/D for other heads than Llama-3.1-8B's (perf.composable's). Used to find
why FlashInfer's decode gains more from shared pages than ours (docs/composable.md, finding 1), and on distinct
pages where DRAM bounds both (docs/decode.md)."""
import sys

from perf import composable
from perf.common import profile_once
from perf.composable import Cell, flashinfer_decode, ours

IMPLS = ("ours", "flashinfer", "groups")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in IMPLS:
        print(f"usage: python3 -m perf.tools.ncu_decode {{{','.join(IMPLS)}}} BxLxS [--unshared]", file=sys.stderr)
        return 2
    impl = argv[0]
    if "--heads" in argv:
        composable.set_heads(*(int(x) for x in argv[argv.index("--heads") + 1].split("/")))
    B, L, S = (int(x) for x in argv[1].split("x"))
    cell = Cell(B, L, S, 1 if "--unshared" in argv[2:] else 0)
    if impl in ("ours", "groups"):
        fn, _, info = ours(cell, "decode", False) if impl == "ours" else ours(cell, "prefill", True)
        print(info, flush=True)
    else:
        fn, _ = flashinfer_decode(cell)
    profile_once(fn)
    print("done", impl, argv[1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
