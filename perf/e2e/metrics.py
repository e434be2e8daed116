"""Serving metrics as `vllm bench serve` (vLLM 0.26.0) defines them, from per-request arrival timestamps.

vllm/benchmarks/lib/endpoint_request_func.py times each streamed chunk that carries output: TTFT is the
first chunk's time minus the request's start, ITL holds the gaps between consecutive chunks after the
first, and latency (E2EL) is the last chunk's time minus the start. vllm/benchmarks/serve.py
`calculate_metrics` then pools every request's ITLs into one list, takes TPOT per request as
(latency - ttft) / (output_tokens - 1) for requests with more than one output token, and reports
np.mean / np.median / np.std / np.percentile (linear interpolation) in milliseconds, with throughputs
over the benchmark's wall time. A chunk can carry several tokens when the engine's output collector
merges deltas the consumer had not yet read (the same happens behind vLLM's HTTP server); such a chunk
yields one ITL sample, as in vLLM, and `multi_token_chunk_frac` says how often that happened.

numpy only: the CPU tests import this without vLLM.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """One request as the client saw it: times in seconds from time.perf_counter()."""
    prompt_len: int
    output_len: int                      # tokens asked for (max_tokens)
    start: float                         # when the request was handed to the engine
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk carrying tokens
    chunk_tokens: list[int] = field(default_factory=list)    # tokens in each such chunk
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and len(self.chunk_times) > 0

    @property
    def output_tokens(self) -> int:
        return int(sum(self.chunk_tokens))

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t[:-1], t[1:])]

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None

    def to_json(self) -> dict:
        return asdict(self)


def _stats(values: list[float], name: str) -> dict:
    """mean, median, std and the PERCENTILES of `values` (seconds) in ms; zeros for an empty list as vLLM
    (np.mean(values or 0))."""
    v = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(v)), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(np.std(v))}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(v, p))
    return out


def compute_metrics(records: list[RequestRecord], duration_s: float) -> dict:
    """The benchmark's summary over `records`, run over `duration_s` seconds of wall time."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0; got {duration_s!r}")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itl]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    e2els = [r.latency for r in ok]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunk_tokens) for r in ok)
    multi = sum(1 for r in ok for k in r.chunk_tokens if k > 1)
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input": total_input,
        "total_output": total_output,
        "output_len_mismatch": sum(1 for r in ok if r.output_tokens != r.output_len),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "multi_token_chunk_frac": multi / chunks if chunks else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_stats(values, name))
    errors = [r.error for r in records if r.error]
    if errors:
        out["errors"] = sorted(set(errors))[:5]
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is not positive."""
    if a is None or b is None or not b > 0:
        return None
    return a / b
