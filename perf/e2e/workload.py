"""What the serving benchmark sends: request lengths per dataset, Poisson arrival times, random token ids.

Datasets (names accepted by --dataset):
  sharegpt        (prompt_len, output_len) pairs of the committed trace perf/data/sharegpt_trace.json,
                  already filtered by vLLM's ShareGPT rules (perf/sharegpt.py says how it was made);
                  seed 0 keeps the trace's order, i.e. the first n pairs vLLM's sampler would draw.
  u512-2048       the FlashInfer paper's synthetic set: prompt lengths uniform on [512, 2048], 256 outputs.
  u4096-16384     likewise with prompt lengths uniform on [4096, 16384].
  sharegpt-n8     parallel generation: each ShareGPT prompt asks for 8 samples (the engine's n = 8), which share
                  the prompt's KV; --num-prompts counts prompts, the metrics count samples; 256 outputs.
  sysprompt4k-sharegpt  a shared system prompt: the same 4096 tokens before every ShareGPT prompt; 256 outputs.

Arrivals follow vLLM's `get_request` (vllm/benchmarks/serve.py): exponential gaps (gamma with shape 1)
of mean 1/rate, accumulated, then rescaled so the last request is sent at n/rate exactly; rate inf sends
everything at once. Our generator is numpy's default_rng seeded per (seed, dataset, rate) rather than
vLLM's global np.random.seed, so draws differ from vLLM's but follow the same law and repeat exactly
across backends.

Token ids are uniform below the vocabulary size and are drawn afresh for every (dataset, rate), so no
run hits the prefix cache left by another (the benchmark also resets it between runs).

numpy only: the CPU tests import this without vLLM.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from perf import sharegpt

UNIFORM_OUTPUT_LEN = 256
DATASETS = {
    "sharegpt": None,
    "u512-2048": (512, 2048),
    "u4096-16384": (4096, 16384),
    "sharegpt-n8": None,
    "sysprompt4k-sharegpt": None,
}
# The shared-prefix datasets (issue 28, docs/composable.md): samples per prompt, and tokens of a system prompt.
SAMPLES = {"sharegpt-n8": 8}
SYSTEM_PROMPT = {"sysprompt4k-sharegpt": 4096}
# Issue 28's parallel-generation workloads fix the output length; the prompts keep the trace's lengths.
FIXED_OUTPUT = {"sharegpt-n8": UNIFORM_OUTPUT_LEN, "sysprompt4k-sharegpt": UNIFORM_OUTPUT_LEN}


def samples_per_prompt(dataset: str) -> int:
    """The n of each request (parallel sampling): 1 but for sharegpt-n8."""
    return SAMPLES.get(check_dataset(dataset), 1)


def system_prompt_tokens(dataset: str) -> int:
    """Tokens of the system prompt every prompt of the dataset starts with (0: none)."""
    return SYSTEM_PROMPT.get(check_dataset(dataset), 0)


def check_dataset(name: str) -> str:
    if name not in DATASETS:
        raise ValueError(f"--dataset: unknown dataset {name!r}; accepted: {', '.join(DATASETS)}")
    return name


def _stream_seed(seed: int, *parts) -> np.random.Generator:
    """A generator keyed by seed and stable labels (crc32, not hash(), which Python salts per process)."""
    keys = [int(seed) & 0xFFFFFFFF] + [zlib.crc32(str(p).encode()) for p in parts]
    return np.random.default_rng(keys)


def sample_lengths(dataset: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """n (prompt_len, output_len) pairs of `dataset`; the same (dataset, n, seed) always gives the same."""
    check_dataset(dataset)
    if not (isinstance(n, int) and n > 0):
        raise ValueError(f"--num-prompts must be a positive int; got {n!r}")
    if DATASETS[dataset] is None:   # the ShareGPT trace, with a system prompt before each prompt where one is set
        avail = len(sharegpt.load_trace())
        if n > avail:
            raise ValueError(f"--num-prompts: the ShareGPT trace holds {avail} pairs; asked for {n}")
        system = system_prompt_tokens(dataset)
        fixed = FIXED_OUTPUT.get(dataset)
        return [(system + p, fixed or o) for p, o in sharegpt.load_trace(n, seed)]
    lo, hi = DATASETS[dataset]
    lens = _stream_seed(seed, dataset, "lengths").integers(lo, hi, size=n, endpoint=True)
    return [(int(p), UNIFORM_OUTPUT_LEN) for p in lens]


def max_total_len(dataset: str) -> int:
    """The longest prompt + output the dataset can produce (what max_model_len must hold)."""
    check_dataset(dataset)
    if DATASETS[dataset] is None:   # the trace's longest pair, or its longest prompt + the fixed output
        return system_prompt_tokens(dataset) + sharegpt.MAX_TOTAL_LEN + FIXED_OUTPUT.get(dataset, 0)
    return DATASETS[dataset][1] + UNIFORM_OUTPUT_LEN


def arrival_times(n: int, rate: float, seed: int = 0, key: str = "") -> list[float]:
    """Send times in seconds from the benchmark's start, as vLLM's get_request with burstiness 1."""
    if not (rate > 0):
        raise ValueError(f"--rates: a request rate must be > 0 or inf; got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = _stream_seed(seed, key, "arrivals", repr(float(rate))).exponential(1.0 / rate, size=n)
    t = np.cumsum(gaps)
    if t[-1] != 0:
        t *= (n / rate) / t[-1]      # vLLM: the last request goes out at n/rate, whatever the draw
    return [float(x) for x in t]


def prompt_token_ids(prompt_lens: list[int], vocab_size: int, seed: int = 0, key: str = "") -> list[list[int]]:
    """Random prompts of the given lengths, ids in [0, vocab_size)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2; got {vocab_size}")
    rng = _stream_seed(seed, key, "tokens")
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in prompt_lens]


def dataset_prompts(dataset: str, pairs: list[tuple[int, int]], vocab_size: int, seed: int = 0,
                    key: str = "") -> list[list[int]]:
    """A run's prompts for `pairs` of `dataset`: random ids (prompt_token_ids), behind one system prompt drawn for
    the run where the dataset has one."""
    system = system_prompt_tokens(dataset)
    if not system:
        return prompt_token_ids([p for p, _ in pairs], vocab_size, seed, key)
    head = prompt_token_ids([system], vocab_size, seed, key + "/system")[0]
    return [head + ids for ids in prompt_token_ids([p - system for p, _ in pairs], vocab_size, seed, key)]


def parse_rates(text: str) -> list[float]:
    """'1,4,inf' -> [1.0, 4.0, inf]."""
    rates = []
    for item in (s.strip() for s in text.split(",")):
        try:
            r = float(item)
        except ValueError:
            raise ValueError(f"--rates: {item!r} is not a number or 'inf' (e.g. --rates 1,4,inf)") from None
        if not r > 0:
            raise ValueError(f"--rates: a request rate must be > 0 or inf; got {item!r}")
        rates.append(r)
    if not rates:
        raise ValueError("--rates: give at least one rate, e.g. --rates 4,inf")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_num_prompts(text: str, datasets: list[str]) -> dict[str, int]:
    """'200' (every dataset) or 'sharegpt=200,u4096-16384=50' (the rest keep the first plain number, or
    200)."""
    default, per = 200, {}
    for item in (s.strip() for s in str(text).split(",") if s.strip()):
        name, _, val = item.rpartition("=")
        try:
            n = int(val)
        except ValueError:
            raise ValueError(f"--num-prompts: {item!r} is not N or DATASET=N") from None
        if n <= 0:
            raise ValueError(f"--num-prompts: counts must be positive; got {item!r}")
        if name:
            per[check_dataset(name)] = n
        else:
            default = n
    return {d: per.get(d, default) for d in datasets}


# ------------------------------------------------------------------------------------------ estimate
# Rough H100 figures for Llama-3.1-8B (32 layers) in bf16, from ENGINES.md's runs; only for the
# "this will take about N minutes" line printed before a run, never reported as results.
EST_STARTUP_S = 60.0
EST_EXTRA_STARTUP_S = {"FLASHINFER": 40.0}   # its kernels JIT-compile on first use (either engine's spelling)
EST_DECODE_TOK_S = 5000.0      # output tokens per second with a full batch
EST_PREFILL_TOK_S = 15000.0    # prompt tokens per second
EST_STEP_S = 0.012             # one decode step at moderate batch


def estimate_run_s(pairs: list[tuple[int, int]], rate: float, num_layers: int = 32, samples: int = 1) -> float:
    scale = max(num_layers / 32, 0.15)   # the non-attention, non-GEMM overhead does not shrink with layers
    total_in = sum(p for p, _ in pairs)
    total_out = samples * sum(o for _, o in pairs)
    work = scale * (total_out / EST_DECODE_TOK_S + total_in / EST_PREFILL_TOK_S)
    send = 0.0 if math.isinf(rate) else len(pairs) / rate
    tail = scale * EST_STEP_S * max(o for _, o in pairs)
    return max(send, work) + tail


def estimate_backend_s(backend: str, runs_s: list[float], warmup_s: float = 5.0) -> float:
    return EST_STARTUP_S + EST_EXTRA_STARTUP_S.get(backend.upper(), 0.0) + warmup_s + sum(runs_s)
