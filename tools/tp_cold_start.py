"""Cold start of the ranks of one tensor-parallel model on one machine: N processes start at once with the same
fresh kernel cache, each builds or loads the kernel modules its rank needs, then plans and runs one decode and
one prefill batch, checked against the float64 reference.

    python3 tools/tp_cold_start.py                          # Llama-3.1-70B TP 8: 8 ranks of 8 / 1 heads, head 128
    python3 tools/tp_cold_start.py --model Qwen2.5-32B --tp 4 --ranks 4
    python3 tools/tp_cold_start.py --build-only --kernels decode --ranks 3    # no GPU: the builds only

Ranks share the GPUs as vLLM and SGLang place them: rank r on device r % device_count (all on one GPU when
there is one; CUDA_VISIBLE_DEVICES is the same for every rank). A rank makes its two wrappers exactly as the
vLLM adapter does at start-up (adapters.vllm._make_wrapper), so the modules it loads are the ones an engine's
rank loads. Each rank counts the modules it compiled and the ones it found, through the loader's build call
(kernels.loader.build, wrapped in the rank's process); the report says whether every module was compiled
exactly once over all ranks, whether every rank came up (none may time out waiting on a build lock), each
rank's time from the common start to ready, and the wall time. It is written as JSON to
--out (default $OUT/tp_cold_start.json, else ./tp_cold_start.json); exit 0 only if all of that holds.

The cache is --cache-dir (default: a new directory under the system's temporary directory), which must be
empty or absent: a cold start needs a cold cache.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # run from a checkout without installing fi-backend
    sys.path.insert(0, str(REPO))

KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn"}
KERNELS = ("decode", "prefill")
TOLERANCE = 1e-2   # bf16 / fp16 output against float64, relative to the reference's largest magnitude


def _rank_model(model_name: str, tp: int):
    from fi_backend import models
    model = models.tp_slice(models.find(model_name), tp)
    ok, reason = models.check(model)
    if not ok:
        raise ValueError(f"{model.name}: refused: {reason}")
    return model


def _count_builds(records: list) -> None:
    """Wrap the loader's build call so this process records (module, compiled here?, seconds) for each load."""
    from fi_backend.kernels import loader
    real = loader.build

    def counted(spec, **kw):
        result = real(spec, **kw)
        records.append({"module": result.name, "built": bool(result.built), "seconds": round(result.seconds, 2)})
        return result

    loader.build = counted


def _specs(model, kv_dtype: str, kernels: tuple) -> list:
    """The modules of the rank's decode and prefill wrappers (models.modules_of, kept to `kernels`)."""
    from fi_backend import models
    return [s for s in models.modules_of(model, kv_dtypes=(kv_dtype,), q_dtype="bf16") if s.family in kernels]


def _plan_params(variant) -> dict:
    """Plan (and reference) parameters of a zoo variant, small enough to bite at the run's lengths."""
    return {k: v for k, v in (("window_left", 37), ("logits_soft_cap", 2.5)) if k in variant.params}


def _plan_and_run(wrapper, kernel: str, page: int, device, params: dict) -> float:
    """One batch through `wrapper` (odd lengths, random pages): the largest error over the reference's largest
    magnitude."""
    import torch
    from fi_backend import reference as ref
    from fi_backend.formats import from_block_table
    g = torch.Generator(device="cpu").manual_seed(1234)
    kv_lens = [1001, 37, 530] if kernel == "decode" else [700, 129, 2049]
    q_lens = [1, 1, 1] if kernel == "decode" else [173, 129, 61]
    blocks = [-(-n // page) for n in kv_lens]
    perm = torch.randperm(sum(blocks), generator=g).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[start:start + b]
        start += b
    qo = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    kv = torch.tensor(kv_lens, dtype=torch.int32)
    bsr = from_block_table(table.to(device), kv.to(device), qo.to(device), page)
    hq, hkv, d = wrapper.num_qo_heads, wrapper.num_kv_heads, wrapper.head_dim
    cache = torch.randn(sum(blocks), page, hkv, 2 * d, generator=g).to(device=device, dtype=torch.bfloat16)
    q = torch.randn(int(qo[-1]), hq, d, generator=g).to(device=device, dtype=torch.bfloat16)
    wrapper.plan(qo, kv, bsr, causal=True, **params)
    out = wrapper.run(q, cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wrapper.check_errors()
    o_ref, _ = ref.attention_bsr(q.double(), cache[..., :d].double(), cache[..., d:].double(), bsr, causal=True,
                                  **params)
    scale = float(o_ref.abs().max())
    return float((out.double() - o_ref).abs().max()) / max(scale, 1e-6)


def _rank_main(rank: int, args: dict, barrier, results) -> None:
    """One rank: wait for the common start, build / load its modules, plan and run; report to `results`."""
    report = {"rank": rank, "pid": os.getpid(), "up": False}
    try:
        import torch
        from fi_backend import kernels, models
        from fi_backend.adapters import vllm as adapter   # imports nothing of vLLM
        model = _rank_model(args["model"], args["tp"])
        gpus = torch.cuda.device_count() if not args["build_only"] else 0
        records: list = []
        _count_builds(records)
        barrier.wait()   # every rank has imported what an engine imports before attention: start together
        start = time.time()
        report["start"] = start
        if gpus:
            index = rank % gpus
            torch.cuda.set_device(index)   # as the engines do before building a rank's model
            device = torch.device("cuda", index)
            report["device"] = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
            kv = getattr(torch, KV_DTYPES[args["kv_dtype"]])
            made = []
            for variant in models.variants_of(model):   # Gemma-2: a windowed and a global layer kind
                for kernel in args["kernels"]:
                    wrapper = adapter._make_wrapper(
                        kernel, device=device, num_qo_heads=model.num_qo_heads, num_kv_heads=model.num_kv_heads,
                        head_dim=model.head_dim, q_dtype=torch.bfloat16, kv_dtype=kv, page_size=args["page"],
                        variant=variant, max_requests=256, max_rows=8192)
                    if wrapper.workspace.buffer.device != device:
                        raise RuntimeError(f"rank {rank}: workspace on {wrapper.workspace.buffer.device}, not {device}")
                    report.setdefault("modules", []).extend(wrapper.module_names)
                    made.append((variant, kernel, wrapper))
            report["ready_s"] = round(time.time() - start, 2)   # what an engine's start-up waits for
            if args["kv_dtype"] == "bf16":   # the check draws bf16 caches
                report["relative_error"] = {
                    f"{variant.name} {kernel}": _plan_and_run(wrapper, kernel, args["page"], device,
                                                              _plan_params(variant))
                    for variant, kernel, wrapper in made}
        else:
            for spec in _specs(model, args["kv_dtype"], tuple(args["kernels"])):
                kernels.loader.build(spec)
            report["device"] = "none (builds only)"
            report["ready_s"] = round(time.time() - start, 2)
        report["builds"] = records
        report["up"] = True
    except BaseException as e:   # reported, not raised: the parent says which rank failed and why
        report["error"] = f"{type(e).__name__}: {e}"
    results.put(report)


def _commit() -> str:
    if os.environ.get("FI_COMMIT"):  # the GPU machine's tree travels without a current .git
        return os.environ["FI_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def summarise(reports: list, ranks: int, cache: Path) -> dict:
    """Per module, the ranks that compiled it and how many loaded it; the verdicts (pure: tested on the CPU)."""
    modules: dict = {}
    for r in reports:
        for b in r.get("builds", []):
            m = modules.setdefault(b["module"], {"built_by": [], "found_by": [], "build_s": 0.0})
            (m["built_by"] if b["built"] else m["found_by"]).append(r["rank"])
            m["build_s"] = max(m["build_s"], b["seconds"])
    up = sorted(r["rank"] for r in reports if r.get("up"))
    leftovers = sorted(p.name for p in cache.glob(".tmp-*")) + sorted(p.name for p in cache.glob("*.failed"))
    errors = [e for r in reports for e in r.get("relative_error", {}).values()]
    verdict = {
        "every_rank_up": len(up) == ranks,
        "each_module_built_once": bool(modules) and all(len(m["built_by"]) == 1 for m in modules.values()),
        "every_rank_loaded_every_module": all(len(m["built_by"]) + len(m["found_by"]) == len(up)
                                              for m in modules.values()),
        "no_leftovers_in_cache": not leftovers,
    }
    if any("relative_error" in r for r in reports):   # runs on a GPU (not with --build-only)
        verdict["outputs_match_reference"] = all(e <= TOLERANCE for e in errors) and all(
            "relative_error" in r for r in reports if r.get("up"))
    return {"modules": modules, "ranks_up": up, "cache_leftovers": leftovers, "verdict": verdict,
            "ok": all(verdict.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Llama-3.1-70B", help="a zoo model (fi-backend models)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel degree whose rank configuration runs")
    ap.add_argument("--ranks", type=int, default=None, help="processes started at once (default: --tp)")
    ap.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPES))
    ap.add_argument("--kernels", default="decode,prefill", help="comma-separated, of: decode, prefill")
    ap.add_argument("--page", type=int, default=16, help="KV page size of the run (vLLM's default block size)")
    ap.add_argument("--cache-dir", help="the shared kernel cache; must be empty or absent (default: a new one)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a rank may take to come up")
    ap.add_argument("--build-only", action="store_true", help="build / load the modules only (no GPU needed)")
    ap.add_argument("--out", help="JSON report (default: $OUT/tp_cold_start.json, else ./tp_cold_start.json)")
    a = ap.parse_args(argv)
    kernels = tuple(k.strip() for k in a.kernels.split(",") if k.strip())
    bad = [k for k in kernels if k not in KERNELS]
    if bad or not kernels:
        ap.error(f"--kernels: {', '.join(bad) or 'none given'}; accepted: {', '.join(KERNELS)}")
    ranks = a.ranks or a.tp
    if ranks < 1:
        ap.error(f"--ranks must be >= 1, got {ranks}")
    try:
        model = _rank_model(a.model, a.tp)
    except (KeyError, ValueError) as e:
        ap.error(f"--model {a.model} --tp {a.tp}: {e.args[0] if isinstance(e, KeyError) else e}")
    cache = Path(a.cache_dir) if a.cache_dir else Path(tempfile.mkdtemp(prefix="fi_tp_cold_"))
    if cache.exists() and any(cache.iterdir()):
        ap.error(f"--cache-dir {cache} is not empty: a cold start needs an empty (or absent) kernel cache")
    cache.mkdir(parents=True, exist_ok=True)
    out = Path(a.out) if a.out else Path(os.environ.get("OUT") or ".") / "tp_cold_start.json"

    os.environ["FI_BACKEND_CACHE_DIR"] = str(cache)   # inherited by every rank, as an engine's ranks inherit it
    os.environ.setdefault("FI_BACKEND_QUIET", "1")
    import torch
    gpus = 0 if a.build_only else torch.cuda.device_count()
    if not gpus and not a.build_only:
        ap.error("no CUDA device: run on a GPU machine, or pass --build-only to test the builds alone")
    args = {"model": a.model, "tp": a.tp, "kv_dtype": a.kv_dtype, "kernels": kernels, "page": a.page,
            "build_only": a.build_only}
    ctx = mp.get_context("spawn")   # fresh processes, like an engine's ranks: nothing loaded, nothing memoised
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args, barrier, results), daemon=True) for r in range(ranks)]
    launched = time.time()
    for p in procs:
        p.start()
    reports, deadline = [], launched + a.timeout + 120   # + the ranks' imports before the common start
    while len(reports) < ranks and time.time() < deadline:
        try:
            reports.append(results.get(timeout=max(0.1, min(5.0, deadline - time.time()))))
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()   # a rank that did not come up in time: reported below
    starts = [r["start"] for r in reports if "start" in r]
    t0 = min(starts) if starts else launched
    for r in reports:
        if r.get("up") and r["ready_s"] + (r["start"] - t0) > a.timeout:
            r["up"], r["error"] = False, f"came up after {r['ready_s']:.0f} s, past --timeout {a.timeout:.0f} s"
    missing = sorted(set(range(ranks)) - {r["rank"] for r in reports})
    reports += [{"rank": r, "up": False, "error": f"no report within {a.timeout:.0f} s (timed out)"} for r in missing]
    reports.sort(key=lambda r: r["rank"])
    summary = summarise(reports, ranks, cache)
    ready = [r["ready_s"] + r["start"] - t0 for r in reports if r.get("up")]
    result = {
        "what": f"cold start of {ranks} ranks of {model.name} ({model.num_qo_heads} query / {model.num_kv_heads} KV "
                f"heads, head {model.head_dim}, KV {a.kv_dtype}, kernels {', '.join(kernels)}) with one fresh cache",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": _commit(),
        "gpus": gpus, "device": next((r["device"] for r in reports if r.get("device")), None),
        "ranks": ranks, "cache_dir": str(cache), "wall_s": round(time.time() - t0, 2),
        "ready_s_max": round(max(ready), 2) if ready else None, **summary,
        "per_rank": [{k: v for k, v in r.items() if k not in ("start",)} for r in reports],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    v = summary["verdict"]
    print(f"{result['what']}: {len(summary['ranks_up'])}/{ranks} ranks up, {len(summary['modules'])} modules, "
          f"built once each: {v['each_module_built_once']}, slowest rank ready {result['ready_s_max']} s, wall "
          f"{result['wall_s']} s -> {out}")
    for r in reports:
        if not r.get("up"):
            print(f"  rank {r['rank']}: {r.get('error')}", file=sys.stderr)
    if not summary["ok"]:
        print(f"  failed: {', '.join(k for k, ok in v.items() if not ok)}", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
