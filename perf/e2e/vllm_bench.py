"""End-to-end serving benchmark on vLLM 0.26.0: fi-backend (CUSTOM) against vLLM's own attention backends.

    source /tmp/vllm-env.sh          # on the GPU machine: vLLM on PYTHONPATH, VLLM_USE_FLASHINFER_SAMPLER=0
    python -m perf e2e --engine vllm --smoke                     # 2 layers, 16 prompts, one rate
    python -m perf e2e --engine vllm --dataset sharegpt --rates 8,inf --num-prompts 200 \\
        --backends CUSTOM,FLASH_ATTN,TRITON_ATTN                 # about 6 minutes on an H100
    python -m perf e2e --engine vllm ... --dry-run               # plan and time estimate only (no vLLM)
    python -m perf e2e --engine vllm --merge a.json b.json --name e2e_vllm_h100   # runs split over commands
    python -m perf e2e --engine vllm --report results.json       # markdown (and plot) again
    python -m perf e2e --engine vllm --tp 2 ...                  # tensor_parallel_size 2

What it measures is what `vllm bench serve` measures (perf/e2e/metrics.py), without HTTP or a tokenizer:
an in-process AsyncLLM gets random token-id prompts (TokensPrompt) at Poisson arrival times
(perf/e2e/workload.py), streams every token back (RequestOutputKind.DELTA, as vLLM's OpenAI server does
for stream=True) and each chunk is time-stamped on arrival. Every request produces exactly its
output_len tokens (ignore_eos=True, greedy). The engine is built with `vllm serve`'s defaults
(UsageContext.OPENAI_API_SERVER: on an H100 max_num_batched_tokens 8192, max_num_seqs 1024), chunked
prefill and prefix caching on, CUDA graphs on (default compilation config), dummy weights from a
config.json (load_format="dummy", skip_tokenizer_init=True). The prefix cache is reset between runs and
token ids differ between runs, so nothing is reused across (dataset, rate).

Each backend runs in its own child process (one engine per process, so GPU memory is free again for the
next one); the parent collects the children's JSON and writes <name>.json, <name>.md and <name>.png to
$OUT when set (the GPU machine returns that folder), else perf/results/. Children's logs and partial
JSON go to <name>_logs/ beside them. Ratios are CUSTOM / other backend: below 1 means fi-backend is
faster. The plan, child loop, outputs and command line are perf/e2e/serving.py's, shared with the SGLang bench.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
import time
from pathlib import Path

from perf.e2e import metrics as M
from perf.e2e import serving as S
from perf.e2e.serving import log, write_json

ITL_BAR = {"FLASH_ATTN": 1.0, "TRITON_ATTN": 0.85}   # issue 5: CUSTOM's median ITL at most this ratio
TTFT_BAR = 1.05                                      # and median TTFT within 5% of FLASH_ATTN's


def bar(rows: list[dict]) -> dict:
    """Issue 5's bar: median ITL <= FLASH_ATTN's on ShareGPT and U(512, 2048); >= 15% below TRITON_ATTN's on
    ShareGPT; median TTFT within 5% of FLASH_ATTN's."""
    checks = []
    for r in (r for r in rows if r.get("backend", "CUSTOM") == "CUSTOM"):
        if r["vs"] == "FLASH_ATTN" and r["dataset"] in ("sharegpt", "u512-2048") and r["median_itl"] is not None:
            checks.append({"check": f"median ITL <= FLASH_ATTN ({r['dataset']} @ {r['rate']})",
                           "ratio": r["median_itl"], "limit": ITL_BAR["FLASH_ATTN"],
                           "pass": r["median_itl"] <= ITL_BAR["FLASH_ATTN"]})
        if r["vs"] == "TRITON_ATTN" and r["dataset"] == "sharegpt" and r["median_itl"] is not None:
            checks.append({"check": f"median ITL <= 0.85 x TRITON_ATTN ({r['dataset']} @ {r['rate']})",
                           "ratio": r["median_itl"], "limit": ITL_BAR["TRITON_ATTN"],
                           "pass": r["median_itl"] <= ITL_BAR["TRITON_ATTN"]})
        if r["vs"] == "FLASH_ATTN" and r["median_ttft"] is not None:
            checks.append({"check": f"median TTFT <= 1.05 x FLASH_ATTN ({r['dataset']} @ {r['rate']})",
                           "ratio": r["median_ttft"], "limit": TTFT_BAR, "pass": r["median_ttft"] <= TTFT_BAR})
    return {"checks": checks, "all_pass": bool(checks) and all(c["pass"] for c in checks)}


ENGINE = S.Engine(
    name="vllm", label="vLLM", module="perf.e2e.vllm_bench",
    backends=("CUSTOM", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION"), ours="CUSTOM",
    anchors=("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"), default_backends="CUSTOM,FLASH_ATTN,TRITON_ATTN,FLASHINFER",
    method="In-process AsyncLLM with `vllm serve`'s defaults (UsageContext.OPENAI_API_SERVER).",
    settings={"usage_context": "OPENAI_API_SERVER (vllm serve defaults)"},
    child_env={"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1"},   # its sampler would import FlashInfer
    bar=bar, variants={"CUSTOM_SHARED": {"FI_BACKEND_SHARED_PREFIX": "1"}})   # CUSTOM with shared-prefix groups
REPO = S.REPO
# Engine arguments of a variant: CUSTOM_SHARED runs fi-backend's opt-in worker, whose host block tables give the
# adapter its groups (vLLM 0.26 gives build() none; docs/composable.md). CUSTOM is fi-backend as users start it.
VARIANT_ARGS = {"CUSTOM_SHARED": {"worker_cls": "fi_backend.adapters.vllm_worker.Worker"}}


# ------------------------------------------------------------------------------------------------ child

def backend_unavailable(backend: str) -> str | None:
    """Why a backend cannot run here, checked before paying for an engine start-up; None if it may."""
    if backend == "FLASHINFER" and importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not importable here (not staged on this machine)"
    if backend == "CUSTOM":
        eps = importlib.metadata.entry_points(group="vllm.general_plugins")
        if not any(ep.value.startswith("fi_backend") or (ep.dist and ep.dist.name in ("fi-backend", "fi_backend"))
                   for ep in eps):
            return ("fi-backend's vllm.general_plugins entry point is not installed: install the package with "
                    "its metadata (pip install --no-index --no-deps --no-build-isolation --target /tmp/fi-site .) "
                    "and put /tmp/fi-site on PYTHONPATH")
    return None


async def _one_request(engine, tokens_prompt, sp, rid, prompt_len, output_len):
    """A request's RequestRecord; with sp.n > 1 a list of them, one a sample (CompletionOutput.index)."""
    start = time.perf_counter()
    recs = [M.RequestRecord(prompt_len=prompt_len, output_len=output_len, start=start) for _ in range(sp.n)]
    try:
        async for out in engine.generate(tokens_prompt, sp, request_id=rid):
            t = time.perf_counter()
            for c in out.outputs:
                k = len(c.token_ids)
                if k:    # a finishing output can come without new tokens; vLLM's client times only chunks with output
                    rec = recs[getattr(c, "index", 0)]
                    rec.chunk_times.append(t)
                    rec.chunk_tokens.append(k)
    except Exception as e:  # noqa: BLE001 - a failed request is a result (counted in `failed`), not a crash
        for rec in recs:
            rec.error = f"{type(e).__name__}: {e}"[:300]
    return recs if sp.n > 1 else recs[0]


async def _run_requests(engine, prompts, output_lens, send_times, tag, timeout_s, samples=1):
    """Send prompt i at send_times[i] after the start, `samples` completions each (n); wait for all. Returns
    (records, duration_s, timed_out), a record a sample."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    def send(i):
        ids, n = prompts[i], output_lens[i]
        # vLLM refuses n > 1 with greedy sampling: the samples of a prompt are drawn at temperature 1 (seeded per
        # request, the same in every backend); ignore_eos keeps the lengths
        greedy = dict(temperature=0.0) if samples == 1 else dict(temperature=1.0, seed=i)
        sp = SamplingParams(n=samples, max_tokens=n, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA, **greedy)
        return _one_request(engine, TokensPrompt(prompt_token_ids=ids), sp, f"{tag}-{i}", len(ids), n)
    return await S.run_requests(send, len(prompts), send_times, timeout_s)


async def _serve(plan: dict, backend: str, result: dict, out_path: Path, t_child: float) -> None:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    s = plan["settings"]
    result["vllm"] = vllm.__version__
    kw = {}
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if s.get(key) is not None:
            kw[key] = s[key]
    args = AsyncEngineArgs(model=plan["model_dir"], load_format="dummy", skip_tokenizer_init=True,
                           max_model_len=s["max_model_len"], gpu_memory_utilization=s["gpu_memory_utilization"],
                           attention_backend=ENGINE.engine_backend(backend), seed=s["seed"], enforce_eager=s["enforce_eager"],
                           tensor_parallel_size=s.get("tensor_parallel_size", 1), enable_log_requests=False, **kw,
                           **VARIANT_ARGS.get(backend, {}))
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER)
    try:
        result["startup_s"] = time.perf_counter() - t0
        vc = engine.vllm_config
        result["engine"] = {
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "enable_chunked_prefill": getattr(vc.scheduler_config, "enable_chunked_prefill", None),
            "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
            "block_size": vc.cache_config.block_size,
            "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
            "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
            "attention_backend": str(vc.attention_config.backend),
            "dtype": str(vc.model_config.dtype),
        }
        log(f"{backend}: engine up in {result['startup_s']:.1f}s ({result['engine']['cudagraph_mode']}, "
            f"{result['engine']['num_gpu_blocks']} KV blocks) [elapsed {time.perf_counter() - t_child:.0f}s]")
        write_json(out_path, result)
        await S.measure_runs(plan, backend, result, out_path, t_child,
                             functools.partial(_run_requests, engine), engine.reset_prefix_cache)
    finally:
        engine.shutdown()


main = S.entry_point(ENGINE, __doc__, backend_unavailable, _serve)


if __name__ == "__main__":
    sys.exit(main())
