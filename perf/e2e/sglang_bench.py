"""End-to-end serving benchmark on SGLang 0.5.15: fi-backend (attention_backend="fi_backend") against SGLang's own
triton and flashinfer attention backends.

    source /tmp/sglang-env.sh        # on the GPU machine: SGLang on PYTHONPATH; fi-backend installed with its
                                     # sglang.srt.plugins entry point (as integration_tests/sglang does)
    python -m perf e2e --engine sglang --smoke                   # 2 layers, 16 prompts, one rate
    python -m perf e2e --engine sglang --dataset sharegpt --rates 8,inf --num-prompts 200
    python -m perf e2e --engine sglang ... --dry-run             # plan and time estimate only (no SGLang)
    python -m perf e2e --engine sglang --tp 2 ...                # tp_size 2
    python -m perf e2e --engine sglang --merge a.json b.json --name e2e_sglang_h100

The same workloads, arrivals and metrics as the vLLM bench (perf/e2e/serving.py, perf/e2e/workload.py,
perf/e2e/metrics.py): the ShareGPT trace, U(512, 2048) and U(4096, 16384) prompts, Poisson arrivals at each rate,
random token-id prompts, every request producing exactly its output length (ignore_eos, greedy). Here an offline
`sgl.Engine(model_path=<config.json folder>, load_format="dummy", skip_tokenizer_init=True, attention_backend=B,
tp_size=N)` with `sglang.launch_server`'s defaults otherwise (chunked prefill, radix cache, CUDA graphs) takes the
token ids through `async_generate(input_ids=..., stream=True)`; each streamed chunk is time-stamped on arrival and
counts the tokens it adds (meta_info["completion_tokens"] is cumulative in either streaming mode). The radix cache
is flushed before each (dataset, rate) run. One child process per backend; ratios are fi_backend / other backend
(below 1: fi-backend faster).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import time
from pathlib import Path

from perf.e2e import metrics as M
from perf.e2e import serving as S
from perf.e2e.serving import log, write_json

ENGINE = S.Engine(
    name="sglang", label="SGLang", module="perf.e2e.sglang_bench", backends=("fi_backend", "triton", "flashinfer"),
    ours="fi_backend", anchors=("triton", "flashinfer"), default_backends="fi_backend,triton,flashinfer",
    method="Offline sgl.Engine (async_generate, streamed) with `sglang.launch_server`'s defaults.",
    settings={"server_defaults": "sglang.launch_server's (chunked prefill, radix cache, CUDA graphs)"},
    child_env={"SGLANG_DISABLE_REQUEST_LOGGING": "1"}, normalise=str.lower,
    variants={"fi_backend_shared": {"FI_BACKEND_SHARED_PREFIX": "1"}})   # fi_backend, shared-prefix groups on


# ------------------------------------------------------------------------------------------------ child

def backend_unavailable(backend: str) -> str | None:
    """Why a backend cannot run here, checked before paying for an engine start-up; None if it may."""
    if importlib.util.find_spec("sglang") is None:
        return "the sglang package is not importable here (source /tmp/sglang-env.sh first)"
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not importable here (not staged on this machine)"
    if backend == "fi_backend":
        eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
        if not any(ep.value.startswith("fi_backend") for ep in eps):
            return ("fi-backend's sglang.srt.plugins entry point is not installed: install the package with its "
                    "metadata (pip install --no-index --no-deps --no-build-isolation --target /tmp/fi-site .) and "
                    "put /tmp/fi-site on PYTHONPATH")
    return None


def engine_kwargs(plan: dict, backend: str) -> dict:
    """sgl.Engine's arguments for the plan: the bench's settings mapped onto SGLang's names (None: its default)."""
    s = plan["settings"]
    kw = {"model_path": plan["model_dir"], "load_format": "dummy", "skip_tokenizer_init": True,
          "attention_backend": ENGINE.engine_backend(backend), "tp_size": s.get("tensor_parallel_size", 1),
          "context_length": s["max_model_len"], "mem_fraction_static": s["gpu_memory_utilization"],
          "random_seed": s["seed"], "log_level": "warning"}
    if s["enforce_eager"]:
        kw["disable_cuda_graph"] = True
    if s["max_num_seqs"] is not None:
        kw["max_running_requests"] = s["max_num_seqs"]
    if s["max_num_batched_tokens"] is not None:
        kw["chunked_prefill_size"] = s["max_num_batched_tokens"]
    if s.get("block_size") is not None:
        kw["page_size"] = s["block_size"]
    return kw


async def _one_request(engine, ids: list, output_len: int, samples: int = 1):
    """A request's RequestRecord; with samples > 1 (SGLang's n: the prompt cached, then one request a sample) a list
    of them, told apart by each chunk's "index"."""
    start = time.perf_counter()
    recs = [M.RequestRecord(prompt_len=len(ids), output_len=output_len, start=start) for _ in range(samples)]
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    if samples > 1:
        params["n"] = samples
    seen = [0] * samples
    try:
        stream = await engine.async_generate(input_ids=ids, sampling_params=params, stream=True)
        async for out in stream:
            t = time.perf_counter()
            i = int(out.get("index", 0))
            total = int((out.get("meta_info") or {}).get("completion_tokens", len(out.get("output_ids") or [])))
            if total > seen[i]:   # a chunk that adds no token is not a chunk to vLLM's client either
                recs[i].chunk_times.append(t)
                recs[i].chunk_tokens.append(total - seen[i])
                seen[i] = total
    except Exception as e:  # noqa: BLE001 - a failed request is a result (counted in `failed`), not a crash
        for rec in recs:
            rec.error = f"{type(e).__name__}: {e}"[:300]
    return recs if samples > 1 else recs[0]


async def _run_requests(engine, prompts, output_lens, send_times, tag, timeout_s, samples=1):
    return await S.run_requests(lambda i: _one_request(engine, prompts[i], output_lens[i], samples), len(prompts),
                                send_times, timeout_s)


def _serve(plan: dict, backend: str, result: dict, out_path: Path, t_child: float) -> None:
    import asyncio

    import sglang as sgl
    result["sglang"] = importlib.metadata.version("sglang")
    kw = engine_kwargs(plan, backend)
    t0 = time.perf_counter()
    engine = sgl.Engine(**kw)
    try:
        result["startup_s"] = time.perf_counter() - t0
        sa = getattr(engine, "server_args", None)
        result["engine"] = {k: getattr(sa, k, kw.get(k)) for k in (
            "attention_backend", "tp_size", "context_length", "chunked_prefill_size", "max_running_requests",
            "mem_fraction_static", "disable_cuda_graph", "disable_radix_cache", "page_size", "kv_cache_dtype")}
        log(f"{backend}: engine up in {result['startup_s']:.1f}s [elapsed {time.perf_counter() - t_child:.0f}s]")
        write_json(out_path, result)

        async def flush():   # the radix cache, emptied between runs (engine.flush_cache() would nest the loop)
            await engine.tokenizer_manager.flush_cache()

        async def runs():
            await S.measure_runs(plan, backend, result, out_path, t_child,
                                 lambda *a: _run_requests(engine, *a), flush)
        loop = getattr(engine, "loop", None)   # the engine's own event loop, where its tokenizer manager lives
        if loop is not None:
            loop.run_until_complete(runs())
        else:
            asyncio.run(runs())
    finally:
        engine.shutdown()


main = S.entry_point(ENGINE, __doc__, backend_unavailable, _serve)


if __name__ == "__main__":
    sys.exit(main())
