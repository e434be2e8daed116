"""One profiled launch (after 3 warm-ups) of ours / FlashInfer FA3 / FA2 / vLLM's FA3 on perf.prefill's Case, for
ncu:

    ncu --profile-from-start off --set full -o ours python3 -m perf.tools.ncu_prefill ours 1x16384 32 [TUNING_JSON]
        [--head-dim D] [--full]

argv: impl (ours: BatchAttention on ragged K / V, the CuTe member where it applies; fa2, fa3: FlashInfer's; vllm_fa3:
vLLM's flash_attn_varlen_func(fa_version=3), ragged; cute: the CuTe probe's CTA with overlap and ping-pong;
cute_pagedN: its overlapped CTA on pages of N tokens in random order, N = 0 ragged), BxS, KV heads (32 query
heads), optionally our kernel shape as JSON. --full: no causal mask (every impl)."""
import json
import sys

from perf.common import profile_once
from perf.prefill import Case, FlashInferRagged, ours_fn

IMPLS = ("ours", "fa2", "fa3", "vllm_fa3", "cute", "cute_pagedN")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    head_dim = None
    if "--head-dim" in argv:  # 128 unless given (perf.prefill's D)
        k = argv.index("--head-dim")
        head_dim, argv = int(argv[k + 1]), argv[:k] + argv[k + 2:]
    causal = "--full" not in argv
    argv = [a for a in argv if a != "--full"]
    paged = argv[0].startswith("cute_paged") and argv[0][len("cute_paged"):].isdigit() if argv else False
    if len(argv) < 3 or not (argv[0] in IMPLS[:-1] or paged):
        print(f"usage: python3 -m perf.tools.ncu_prefill {{{','.join(IMPLS)}}} BxS KV_HEADS [TUNING_JSON]",
              file=sys.stderr)
        return 2
    impl, bs, hkv = argv[0], argv[1], int(argv[2])
    b, s = (int(x) for x in bs.split("x"))
    case = Case(b, s, 32, hkv) if head_dim is None else Case(b, s, 32, hkv, head_dim=head_dim)
    if impl == "ours":
        fn, out, info = ours_fn(case, tuning=json.loads(argv[3]) if len(argv) > 3 else None, causal=causal)
        print(info, flush=True)
    elif impl == "vllm_fa3":
        from perf.prefill import vllm_fa3, vllm_fn
        func, why = vllm_fa3()
        if func is None:
            print(f"vllm_fa3: {why}", file=sys.stderr)
            return 1
        fn, out = vllm_fn(func, case, causal=causal)
    elif impl == "cute":
        from perf.tools.cute_probe import probe_fn
        fn, out = probe_fn(case, "cute_pingpong", causal=causal)
    elif impl.startswith("cute_paged"):  # cute_paged0: the same CTA (overlap, no ping-pong) on ragged K / V
        from perf.tools.cute_probe import paged_fn, probe_fn
        page = int(impl[len("cute_paged"):])
        fn, out = paged_fn(case, page, causal=causal) if page else probe_fn(case, "cute_overlap", causal=causal)
    else:
        fn, out = FlashInferRagged(impl).fn(case, causal=causal)
    profile_once(fn)
    print("done", impl, bs, hkv, "causal" if causal else "full", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
